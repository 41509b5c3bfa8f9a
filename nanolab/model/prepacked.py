"""Matrix products over weights laid out once for oneDNN: a faster CPU path for the engine (opt-in).

On the CPU, `torch.nn.functional.linear` hands each product to MKL's sgemm, which first copies the
weight matrix into the blocked layout its inner loops read, on every call. With few rows (a decode step
of a few dozen requests) that copy is a large share of the product. `Prepacked` lays each weight matrix
of a model's layers out once, in oneDNN's layout, and `linear` then multiplies with it directly
(``torch.ops.mkldnn._linear_pointwise``), applying GPT-2's GELU in the same call.

Measured on 2 cores with the GPT-2-small-shaped model of ``bench/bench_roofline.py``: every layer's
products together take about 0.75x F.linear's time at 64 rows; one 768 x 3072 product with its GELU
0.5-0.65x at 4 to 16 rows, and at 1 or 2 rows the same as F.linear, so products of fewer than
`MIN_ROWS` rows use F.linear.

The layouts belong to an engine, not to the model: `linear` uses them only inside `Prepacked.active`,
which the engine's model runner puts around its forward. Another engine, or a learner's runner, on the
same model computes as F.linear does, and so does a product whose gradient is wanted (oneDNN's call has
none). A weight changed through its parameter after it was laid out (``copy_``, ``mul_``,
``load_state_dict``, a new tensor assigned) is multiplied by F.linear, not by its stale copy: its version
counter or its storage has moved. A write that bypasses the counter (through ``weight.data``, a NumPy view,
or a weight made under ``torch.inference_mode``, which has no counter) is not seen: build a new engine
after one.

oneDNN sums each product in another order than MKL, so results differ from F.linear's by float rounding
(about 1e-6 relative). Greedy outputs can then differ where the top two logits are that close; that is
why the layouts are not the default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 4
"""Products with fewer rows use F.linear (at 1 or 2 rows oneDNN's call is no faster)."""

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
            # laid out for 64 rows, and used for any number
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
            self._packed[id(w)] = (w, _version(w), w.data_ptr(), packed)  # holding w keeps its id its own

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Prepacked:
        """The weight matrices of every layer of a nanolab `Transformer` (attention and MLP); the output
        layer computes its logits with F.linear."""
        weights = [
            m.weight for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)
        ]
        return cls(weights)

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
    """``F.linear(x, weight, bias)``, then GELU (tanh approximation) if ``gelu``; through a `Prepacked`
    layout of ``weight`` where one is active and up to date and ``x`` is (rows, in) with rows >=
    `MIN_ROWS`."""
    active = _ACTIVE.get()
    if active is not None and x.dim() == 2 and x.shape[0] >= MIN_ROWS:
        entry = active.get(id(weight))
        grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if entry is not None and not grad and entry[1] == _version(weight) and entry[2] == weight.data_ptr():
            if gelu:
                return torch.ops.mkldnn._linear_pointwise(x, entry[3], bias, "gelu", [], "tanh")
            return torch.ops.mkldnn._linear_pointwise(x, entry[3], bias, "none", [], "")
    y = F.linear(x, weight, bias)
    return F.gelu(y, approximate="tanh") if gelu else y
