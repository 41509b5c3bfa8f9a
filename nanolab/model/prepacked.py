"""The layers' matrix products on the CPU, faster than F.linear's (opt-in, `EngineConfig.prepack_weights`).

On the CPU, `torch.nn.functional.linear` hands each product to MKL's sgemm, which first copies the
weight matrix into the blocked layout its inner loops read, on every call. With few rows (a decode step
of a few dozen requests) that copy is a large share of the product. `Prepacked` lays each weight matrix
of a model's layers out once, in oneDNN's layout, and `linear` then multiplies with it directly
(``torch.ops.mkldnn._linear_pointwise``), applying GPT-2's GELU in the same call.

Products of one or two rows (a decode step at batch 1 or 2) read the weight as it is, through
``nanolab._C.linear_rows`` (csrc/linear_rows.h) where the C++ kernels are built: all there is to such
a product is reading the weight from memory, and the kernel streams it on every thread, serving both rows
from each weight row it loads. The output layer's weight is laid out too (`Transformer.compute_logits`),
so a step's logits go the same ways.

Measured on 2 cores (an AMD EPYC) with ``bench/bench_linear.py``, the weights read per second, 40
matrices of a GPT-2-small-shaped layer one after another: at 1 row, F.linear 14 GB/s, oneDNN 22-24 and
``linear_rows`` 28-35 (reading a buffer: 31-34); at 2 rows 7-8, 20-21 and 26-28; at 3 rows 6-7, 25-27
and 23-24, so products of `KERNEL_MAX_ROWS` rows or fewer take the kernel and longer ones oneDNN. Every
layer's products at 64 rows together take about 0.75x F.linear's time.

The layouts belong to an engine, not to the model: `linear` uses them only inside `Prepacked.active`,
which the engine's model runner puts around its forward and its logits. Another engine, or a learner's
runner, on the same model computes as F.linear does, and so does a product whose gradient is wanted
(neither oneDNN's call nor the kernel has a backward). A weight changed through its parameter after it
was laid out (``copy_``, ``mul_``, ``load_state_dict``, a new tensor assigned) is multiplied by F.linear,
not by its stale copy: its version counter or its storage has moved. A write that bypasses the counter
(through ``weight.data``, a NumPy view, or a weight made under ``torch.inference_mode``, which has no
counter) is seen by the kernel, which reads the weight itself, but not by the layouts, so products would
then depend on their number of rows: build a new engine after one.

oneDNN and the kernel sum each product in another order than MKL, so results differ from F.linear's by
float rounding (about 1e-6 relative). Greedy outputs can then differ where the top two logits are that
close; that is why the layouts are not the default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from nanolab import _ext

KERNEL_MAX_ROWS = 2
"""Products of this many rows or fewer go through ``nanolab._C.linear_rows`` where it is built."""

HAS_KERNEL = _ext.HAS_C and hasattr(_ext._C, "linear_rows")

_ACTIVE: contextvars.ContextVar[dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] | None] = (
    contextvars.ContextVar("nanolab_prepacked", default=None)
)


def available() -> bool:
    """Whether this build of torch has oneDNN's CPU products."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Prepacked:
    """oneDNN layouts of ``weights`` (float32 matrices on the CPU), made once; see the module docstring."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        if not available():
            raise RuntimeError("prepack_weights needs oneDNN, which this build of torch lacks")
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        for w in weights:
            if w.dim() != 2 or w.dtype is not torch.float32 or not w.is_cpu:
                raise ValueError(
                    f"prepack_weights lays out float32 matrices on the CPU, got a {w.dtype} tensor of shape "
                    f"{tuple(w.shape)} on {w.device}"
                )
            self._packed[id(w)] = (w, _version(w), w.data_ptr(), layout(w))  # holding w keeps its id its own

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Prepacked:
        """The weight matrices of every layer of a nanolab `Transformer` (attention and MLP) and of its output
        layer (`Transformer.compute_logits`; tied to the embeddings or not, the layout is a copy)."""
        weights = [
            m.weight for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)
        ]
        return cls([*weights, model.lm_head.weight])

    def __len__(self) -> int:
        return len(self._packed)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """`linear` uses these layouts inside this block (in this thread or task only)."""
        token = _ACTIVE.set(self._packed)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def _version(w: torch.Tensor) -> int:
    """The tensor's version counter (-1 for an inference tensor, which keeps none)."""
    return -1 if w.is_inference() else w._version


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False):
    """``F.linear(x, weight, bias)``, then GELU (tanh approximation) if ``gelu``. Where a `Prepacked`
    layout of ``weight`` is active and up to date, no gradient is wanted and ``x`` is (rows, in) float32:
    through ``nanolab._C.linear_rows`` for up to `KERNEL_MAX_ROWS` rows (where the C++ kernels are built),
    else through the layout."""
    active = _ACTIVE.get()
    if active is not None and x.dim() == 2 and x.shape[0] > 0 and x.dtype is torch.float32:
        entry = active.get(id(weight))
        grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if entry is not None and not grad and entry[1] == _version(weight) and entry[2] == weight.data_ptr():
            if HAS_KERNEL and x.shape[0] <= KERNEL_MAX_ROWS and _streamable(x, weight, bias):
                y = _linear_rows(x, weight, bias)
                return F.gelu(y, approximate="tanh") if gelu else y
            return onednn_linear(x, entry[3], bias, gelu)
    y = F.linear(x, weight, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


def layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) laid out for oneDNN's product: a copy, made for 64 rows and used for any number."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False
) -> torch.Tensor:
    """``F.linear`` by oneDNN's product on a `layout` of the weight, then GELU (tanh) in the same call if
    ``gelu``. No checks: `linear` is the safe way in."""
    if bias is not None:
        bias = bias.contiguous()  # oneDNN's call reads a bias as if it were (it ignores strides)
    post, algorithm = ("gelu", "tanh") if gelu else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post, [], algorithm)


def _streamable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can read the tensors in place: contiguous float32 (the kernel's binding would
    copy anything else)."""
    return (
        x.is_cpu
        and x.is_contiguous()
        and not x.is_neg()  # a lazily negated view, which NumPy cannot take
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous() and bias.is_cpu))
    )


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nanolab._C.linear_rows`` on zero-copy NumPy views, on torch's threads."""
    b = None if bias is None else bias.detach().numpy()
    y = _ext._C.linear_rows(x.detach().numpy(), weight.detach().numpy(), b, torch.get_num_threads())
    return torch.from_numpy(y)
