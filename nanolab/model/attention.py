"""Causal attention as the model's layers see it: the dense reference, and one way into PyTorch's kernel.

Every attention call in nanolab takes tokens as (T, n_heads, head_dim) queries and (L, n_kv_heads,
head_dim) keys and values. `dense_causal_attention` writes the arithmetic out in full (what Lab 2 has a
learner build, and what every faster path is tested against). `sdpa` runs the same computation through
PyTorch's fused ``scaled_dot_product_attention``, which wants (batch, heads, length, head_dim) instead;
the layout change lives here once.

GQA: query head h reads key/value head ``h // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention over one sequence, written out in full: the reference every backend matches.

    q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim) -> (T, n_heads, head_dim). Token i
    attends to tokens 0..i.
    """
    T, n_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != head_dim or n_heads % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    group = n_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (T, nh, hs): head h uses kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def chunk_mask(start: int, num_new: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Which keys each query of a chunk may look at, when the chunk's ``num_new`` tokens come after
    ``start`` tokens already in the KV cache (chunked prefill, a cached prefix, a decode step).

    Returns a (num_new, start + num_new) bool tensor, True where query i may look: query i sits at
    position ``start + i`` and sees positions ``0 .. start + i``, the whole cached prefix and the chunk up
    to itself. ``start = 0`` gives the square causal mask; ``num_new = 1`` a row of True.

    Example:
        >>> chunk_mask(2, 3).int()
        tensor([[1, 1, 1, 0, 0],
                [1, 1, 1, 1, 0],
                [1, 1, 1, 1, 1]], dtype=torch.int32)
    """
    if start < 0 or num_new < 0:
        raise ValueError(f"start and num_new must be >= 0, got start={start}, num_new={num_new}")
    rows = torch.arange(start, start + num_new, device=device)[:, None]  # (num_new, 1): each query's position
    return torch.arange(start + num_new, device=device)[None, :] <= rows


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch's fused attention in nanolab's token-major layout.

    q: (T, n_heads, head_dim), k and v: (L, n_kv_heads, head_dim) -> (T, n_heads, head_dim); or the
    same with a leading batch dimension, (B, T, n_heads, head_dim) and (B, L, n_kv_heads, head_dim).
    ``mask`` (T, L) is True where a query may look; ``causal`` is the square causal mask (T == L).
    The scale defaults to 1/sqrt(head_dim).
    """
    batched = q.dim() == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    # 4-D inputs on purpose: with 3-D ones and enable_gqa, PyTorch's CPU kernel takes a much slower path.
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (B, nh, T, hs)
        k.transpose(1, 2),  # (B, nkv, L, hs)
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # (B, nh, T, hs)
    y = y.transpose(1, 2)  # (B, T, nh, hs)
    return y if batched else y[0]
