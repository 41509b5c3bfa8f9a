"""Paged attention: each sequence's queries attend over keys and values read through its block table.

The paged layout (one pair of tensors per layer, shared by every running sequence):

- ``k_cache``, ``v_cache``: (num_blocks, block_size, n_kv_heads, head_dim), float32, contiguous.
  Slot ``s = block_id * block_size + offset`` is ``k_cache.view(-1, n_kv_heads, head_dim)[s]``.
- ``block_tables``: int32 (B, max_blocks_per_seq); row b lists sequence b's blocks in token order, so
  the token at position ``pos`` sits in slot ``block_tables[b, pos // block_size] * block_size +
  pos % block_size``. Entries past a sequence's context are padding and never read.
- ``context_lens``: int32 (B,), tokens in the cache for each sequence, the new ones included.
- ``slot_mapping``: int64 (T,), where each new token's k/v is written (see `write_kv`).

GQA: query head h reads kv head ``h // (n_heads // n_kv_heads)``. The scale defaults to
``1 / sqrt(head_dim)``.

Backends: ``"torch"`` gathers each sequence's blocks into a contiguous tensor and runs PyTorch's
scaled-dot-product attention; ``"cpp"`` is the kernel in ``nanolab._C`` (csrc/paged_attention.cpp),
which reads the blocks in place, fp32 only; ``"auto"`` takes the C++ kernel when it is built, the
tensors are CPU float32 and the query chunks are short (decode), else torch. Both backends agree
with `nanolab.model.attention.dense_causal_attention` within 1e-5 (absolute and relative, fp32 against a float64 reference).

Deliberately left out: autograd through the paged paths (they serve inference), sliding windows,
ALiBi/soft-capping, and quantised caches.
"""

from __future__ import annotations

import math

import torch

from nanolab.memory import attention_backends as _backends
from nanolab.memory.attention_backends import HAS_CPP_KERNEL, Backend, gather_kv

__all__ = [
    "HAS_CPP_KERNEL",
    "Backend",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]


def _default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new tokens' keys and values: token i goes to slot ``slot_mapping[i]`` (in place).

    k, v: (T, n_kv_heads, head_dim), cast to the cache's dtype. Slots must be distinct; a slot out of
    range raises `ValueError` before anything is written.
    """
    _backends.check_cache(k_cache, v_cache)
    _, block_size, n_kv_heads, head_dim = k_cache.shape
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D (T,), got shape {tuple(slot_mapping.shape)}")
    T = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.shape != (T, n_kv_heads, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected (T, n_kv_heads, head_dim) = "
                f"({T}, {n_kv_heads}, {head_dim}) to match slot_mapping {tuple(slot_mapping.shape)} and the cache"
            )
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must hold integers, got {slot_mapping.dtype}")
    if T == 0:
        return
    num_slots = k_cache.shape[0] * block_size
    lo, hi = torch.aminmax(slot_mapping)
    if lo < 0 or hi >= num_slots:
        bad = int(lo) if lo < 0 else int(hi)
        raise ValueError(
            f"slot_mapping holds slot {bad}, but the cache has {num_slots} slots "
            f"({k_cache.shape[0]} blocks of {block_size}); slot = block_id * block_size + offset"
        )
    slots = slot_mapping.long()
    k_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """One new token per sequence attends to its whole cached context (its own k/v included).

    q: (B, n_heads, head_dim) -> (B, n_heads, head_dim). Sequence b's token sits at position
    ``context_lens[b] - 1`` and sees positions ``0 .. context_lens[b] - 1``. Call `write_kv` first.
    Every decode sequence goes through one call (one kernel launch per layer, whatever B is).
    """
    _backends.check_layout(q, k_cache, v_cache, block_tables, context_lens)
    B, _, head_dim = q.shape
    if B != block_tables.shape[0]:
        raise ValueError(
            f"decode takes one query token per sequence: q has {B} tokens but block_tables "
            f"has {block_tables.shape[0]} rows"
        )
    scale = _default_scale(head_dim, scale)
    if B == 0:
        return q.new_empty(q.shape)
    # Every call costs a Python call or two per tensor; after a kernel that streamed the caches they are
    # slow ones, so this path makes as few as it can (see `attention_backends.run_kernel`).
    if _backends.resolve(backend, q, k_cache, v_cache) == "cpp":
        return _backends.cpp_attention(q, k_cache, v_cache, block_tables, context_lens, None, scale)
    _backends.check_values(block_tables, context_lens, torch.ones_like(context_lens), k_cache.shape)
    return _backends.torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The newest q_len tokens of one sequence attend causally over its whole cached context.

    q: (q_len, n_heads, head_dim) -> same shape. The query tokens sit at positions
    ``[context_len - q_len, context_len)``; row i sees positions ``0 .. context_len - q_len + i``.
    Their own k/v must already be in the cache (`write_kv` first). This is what chunked prefill and
    prefix caching need: the cached prefix is read from the blocks, not recomputed.
    """
    context_len = int(context_len)
    if block_table.dim() != 1:
        raise ValueError(
            f"block_table must be 1-D (max_blocks,) for one sequence, got {tuple(block_table.shape)}"
        )
    device = block_table.device
    tables, lens = block_table.reshape(1, -1), torch.tensor([context_len], dtype=torch.int32, device=device)
    _backends.check_layout(q, k_cache, v_cache, tables, lens)
    q_len = q.shape[0]
    if q_len == 0:
        return q.new_empty(q.shape)
    _backends.check_values(tables, lens, torch.tensor([q_len], device=device), k_cache.shape, single=True)
    scale = _default_scale(q.shape[2], scale)
    if _backends.resolve(backend, q, k_cache, v_cache, prefill_len=q_len) == "cpp":
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        return _backends.cpp_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    return _backends.torch_prefill(q, k_cache, v_cache, block_table, context_len, scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """A mixed batch in one call: decodes and prefill chunks of many sequences, flattened.

    q: (T, n_heads, head_dim) -> same shape. Sequence s owns query rows
    ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` (int32, (B + 1,), starts at 0, ends at T),
    its newest tokens; each behaves as in `paged_prefill_attention` (a decode is a chunk of one).
    """
    _backends.check_layout(q, k_cache, v_cache, block_tables, context_lens)
    B = block_tables.shape[0]
    if query_start_loc.shape != (B + 1,):
        raise ValueError(
            f"query_start_loc has shape {tuple(query_start_loc.shape)}, expected (B + 1,) = ({B + 1},)"
        )
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_start_loc[0] != 0 or query_start_loc[-1] != q.shape[0] or bool((q_lens < 0).any()):
        raise ValueError(
            f"query_start_loc must rise from 0 to the number of query tokens ({q.shape[0]}), "
            f"got {query_start_loc.tolist()}"
        )
    scale = _default_scale(q.shape[2], scale)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if _backends.resolve(backend, q, k_cache, v_cache, prefill_len=int(q_lens.max())) == "cpp":
        return _backends.cpp_attention(
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale
        )
    # Split: all decodes in one call, each longer chunk on its own (each call picks its backend).
    _backends.check_values(block_tables, context_lens, q_lens, k_cache.shape)
    out = torch.empty_like(q)
    decodes = (q_lens == 1).nonzero().flatten()
    if decodes.numel():
        rows = query_start_loc[decodes].long()
        dec_tables, dec_lens = block_tables[decodes], context_lens[decodes]
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, dec_tables, dec_lens, scale, backend)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for s in (q_lens > 1).nonzero().flatten().tolist():
        a, b = starts[s], starts[s + 1]
        out[a:b] = paged_prefill_attention(q[a:b], k_cache, v_cache, block_tables[s], lens[s], scale, backend)
    return out
