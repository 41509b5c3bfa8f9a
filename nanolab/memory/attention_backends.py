"""The backends behind `nanolab.memory.paged_attention`: gather-then-SDPA in PyTorch, and the C++ kernel.

The torch backend is the readable one: copy the sequence's blocks into one contiguous (ctx, n_kv_heads,
head_dim) tensor, then run ordinary attention over it. The copy is the price of paging in PyTorch; the
C++ kernel (csrc/paged_attention.cpp) avoids it by reading K/V straight out of the blocks.

Validation lives here too, so both backends reject bad input with the same messages: shapes are
checked in Python for every call; index values (context lengths, block ids) are checked in Python
for the torch backend and inside the kernel for the C++ one, which saves a few tensor ops per layer.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from nanolab import _ext
from nanolab.memory.paging import cdiv
from nanolab.model.attention import chunk_mask, sdpa

Backend = Literal["auto", "cpp", "torch"]

_CPU = torch.device("cpu")

HAS_CPP_KERNEL = _ext.HAS_C and hasattr(_ext._C, "paged_attention")
"""True when nanolab._C is in use and has the paged-attention kernel."""

AUTO_CPP_MAX_PREFILL = 8
"""Longest query chunk that "auto" sends to the C++ kernel (see bench/bench_attention.py): on 2 cores the
kernel takes about 0.5x torch's time at 1 query row, 0.8x at 8 and 1.0x at 16. Speculative decoding's
checks of a few guessed tokens fall under it."""


def _is_int(t: torch.Tensor) -> bool:
    dtype = t.dtype
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache are (num_blocks, block_size, n_kv_heads, head_dim) twins."""
    shape = k_cache.shape
    if len(shape) != 4:
        raise ValueError(
            f"k_cache must be (num_blocks, block_size, n_kv_heads, head_dim), got shape {tuple(shape)}"
        )
    if v_cache.shape != shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
            f"{v_cache.dtype} must match in shape and dtype"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are addressed in the flattened view)")


def check_layout(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Shapes and dtypes of a paged-attention call (cheap: no tensor is read)."""
    check_cache(k_cache, v_cache)
    n_kv_heads, head_dim = k_cache.shape[2:]
    q_shape = q.shape
    if len(q_shape) != 3 or q_shape[2] != head_dim or q_shape[1] % n_kv_heads:
        raise ValueError(
            f"q must be (tokens, n_heads, head_dim) with head_dim {head_dim} and n_heads a multiple of "
            f"n_kv_heads {n_kv_heads} (the cache's), got shape {tuple(q.shape)}"
        )
    tables_shape = block_tables.shape
    if len(tables_shape) != 2 or not _is_int(block_tables):
        raise ValueError(
            f"block_tables must be an integer (B, max_blocks_per_seq) tensor, got "
            f"{block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )
    if context_lens.shape != tables_shape[:1] or not _is_int(context_lens):
        raise ValueError(
            f"context_lens must be an integer (B,) tensor with B = {block_tables.shape[0]} (the rows of "
            f"block_tables), got {context_lens.dtype} of shape {tuple(context_lens.shape)}"
        )


def check_values(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_lens: torch.Tensor,
    cache_shape: torch.Size,
    single: bool = False,
) -> None:
    """Every index the attention will use is valid (the C++ kernel checks the same, same messages).

    ``single`` words the messages for `paged_prefill_attention`'s one sequence.
    """
    num_blocks, block_size = cache_shape[:2]
    width = block_tables.shape[1]
    lens = context_lens.long()
    tables, lens_name = ("block_table", "context_len") if single else ("block_tables", "context_lens")

    def where(mask: torch.Tensor) -> list[int] | None:
        return mask.nonzero()[0].tolist() if bool(mask.any()) else None

    if (bad := where(lens > width * block_size)) is not None:
        (s,) = bad
        raise ValueError(
            f"{lens_name}{'' if single else f'[{s}]'} is {int(lens[s])} but {tables} holds {width} blocks of "
            f"{block_size} = {width * block_size} tokens{'' if single else ' per sequence'}; widen {tables}"
        )
    if (bad := where((lens < q_lens) | (lens < 1))) is not None:
        (s,) = bad
        who = (
            f"q has {int(q_lens[s])} tokens"
            if single
            else f"the sequence has {int(q_lens[s])} query token(s)"
        )
        raise ValueError(
            f"{lens_name}{'' if single else f'[{s}]'} is {int(lens[s])} but {who}, whose own keys must "
            "already be in the cache (write_kv first)"
        )
    # (B, width): the blocks that hold tokens
    used = torch.arange(width, device=lens.device) * block_size < lens[:, None]
    if (bad := where(used & ((block_tables < 0) | (block_tables >= num_blocks)))) is not None:
        s, j = bad
        raise ValueError(
            f"{tables}[{j if single else f'{s}, {j}'}] is {int(block_tables[s, j])}, which is not a block of "
            f"the cache (num_blocks = {num_blocks})"
        )


def resolve(
    backend: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefill_len: int = 1
) -> Literal["cpp", "torch"]:
    """The backend that runs this call. "auto" takes the C++ kernel when it applies.

    The kernel applies to CPU float32 tensors outside autograd. ``prefill_len`` (the longest query
    chunk) lets "auto" send prefill chunks longer than `AUTO_CPP_MAX_PREFILL` to torch: many query
    rows over the same keys make a matrix product, which PyTorch's fused kernel does faster than the
    C++ kernel's row-by-row loops. Decode, one row per sequence, is where the C++ kernel wins.
    """
    if backend == "torch":
        return "torch"
    if backend == "cpp":
        if not HAS_CPP_KERNEL:
            why = _ext.why_pure or "nanolab._C was built without it; reinstall with `pip install -e .`"
            raise RuntimeError(
                f"the C++ paged-attention kernel is not available ({why}); use backend='torch'"
            )
        return "cpp"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'cpp' or 'torch', got {backend!r}")
    fits = HAS_CPP_KERNEL and prefill_len <= AUTO_CPP_MAX_PREFILL and _cpu_float32(q, k_cache, v_cache)
    return "cpp" if fits and not (q.requires_grad and torch.is_grad_enabled()) else "torch"


def _cpu_float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu for t in tensors)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's keys (or values) copied out of the blocks: (context_len, n_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    return cache[block_table[: cdiv(context_len, block_size)].long()].flatten(0, 1)[:context_len]


def torch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batched decode: one gather for all B sequences, padded to the longest, then one SDPA call."""
    B, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    L = int(context_lens.max())
    n_blocks = cdiv(L, block_size)
    device = block_tables.device
    offsets = torch.arange(block_size, device=device)
    slots = (block_tables[:, :n_blocks].long()[:, :, None] * block_size + offsets).flatten(1)[:, :L]  # (B, L)
    valid = torch.arange(L, device=device) < context_lens[:, None]  # (B, L)
    # Padding positions read position 0's slot instead: an unwritten slot may hold anything, even NaN,
    # and a masked-out NaN still poisons the sum (0 * NaN = NaN).
    slots = torch.where(valid, slots, slots[:, :1])
    k = k_cache.view(-1, n_kv_heads, head_dim)[slots]  # (B, L, nkv, hs)
    v = v_cache.view(-1, n_kv_heads, head_dim)[slots]
    # The query heads that share a kv head play the role of query positions: (B, nkv, group, hs).
    group = n_heads // n_kv_heads
    out = F.scaled_dot_product_attention(
        q.reshape(B, n_kv_heads, group, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(B, n_heads, head_dim)


def torch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's newest q_len tokens over its gathered context, causally."""
    q_len = q.shape[0]
    k = gather_kv(k_cache, block_table, context_len)  # (ctx, nkv, hs)
    v = gather_kv(v_cache, block_table, context_len)
    first = context_len - q_len  # position of the first query token
    mask = None if first == 0 else chunk_mask(first, q_len, q.device)
    return sdpa(q, k, v, mask=mask, causal=first == 0, scale=scale)


def cpp_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Runs ``nanolab._C.paged_attention`` on zero-copy numpy views (None query_start_loc: decode).

    The caches are read in place, so a cache that is not contiguous float32 on the CPU is an error
    here rather than a silent copy of the whole pool. The small index tensors are cast to int32.
    """
    if not _cpu_float32(q, k_cache, v_cache):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not _cpu_float32(t):
                raise ValueError(
                    f"the C++ kernel needs float32 CPU tensors but {name} is {t.dtype} on {t.device}; "
                    "use backend='torch' for other dtypes and devices"
                )

    def ints(t: torch.Tensor):  # an int tensor never needs grad; a strided one is copied on the way in
        return (t if t.dtype is torch.int32 else t.to(torch.int32)).numpy()

    return run_kernel(
        q.detach().numpy(),
        k_cache.detach().numpy(),
        v_cache.detach().numpy(),
        ints(block_tables),
        ints(context_lens),
        None if query_start_loc is None else ints(query_start_loc),
        float(scale),
    )


def run_kernel(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start_loc: np.ndarray | None,
    scale: float,
) -> torch.Tensor:
    """``nanolab._C.paged_attention`` on arrays made ready: the caches float32 and contiguous, the index
    arrays int32. q may be a strided view, copied into one contiguous array on the way in.

    `cpp_attention` makes these arrays from tensors for each call; the paged KV cache makes its pools'
    views once and its index arrays once per step, then calls this in every layer. Each Python call
    made around the kernel costs several times its usual time here, because the kernel has just
    streamed the keys and values through the core's caches.
    """
    out = _ext._C.paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, torch.get_num_threads()
    )
    return torch.as_tensor(out, device=_CPU)  # zero-copy like from_numpy, and names its device
