from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class OutOfBlocksError(RuntimeError):
    """More KV blocks were asked for than are free (nanolab's own error has the same name)."""


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated stream (section 1). Unpacks like a tuple: ``arrival, length, lifetime = r``."""

    arrival: float  # when it arrives; a stream is in arrival order
    length: int  # tokens of KV it holds (prompt + output), at least 1
    lifetime: float  # how long it holds them (math.inf: it never leaves)

    def __iter__(self):
        return iter((self.arrival, self.length, self.lifetime))


class SimResult(NamedTuple):
    """The pool when a simulation stopped: at the first request that could not be placed, or after the last."""

    owner: list[int | None]  # index of the request holding each slot; None for a free slot
    live: int  # requests holding memory: how many fit at once
    used: int  # slots holding a token's KV (the live requests' lengths added up)
    allocated: int  # slots held by live requests, used or not (used + internal waste)
    external_waste: int  # free slots that failed the first unplaced request although enough were free
    first_failure: int | None  # index of the first request that could not be placed; None if all were

    @property
    def internal_waste(self) -> int:
        """Slots held but empty."""
        return self.allocated - self.used

    @property
    def utilization(self) -> float:
        """Used / allocated (1.0 when nothing is allocated)."""
        return self.used / self.allocated if self.allocated else 1.0


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a transformer that its KV cache depends on (`nanolab.ModelConfig` has them too)."""

    n_layers: int  # transformer blocks, each with its own keys and values
    n_heads: int  # query heads per layer
    n_kv_heads: int  # key/value heads per layer (grouped-query attention); divides n_heads
    d_model: int  # width of the residual stream: n_heads * head_dim
    max_seq_len: int = 2048  # longest sequence the model accepts

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class PagedSequence:
    """What a block manager reads and writes on a sequence: the fields of nanolab's `PagedSequence` used here."""

    block_table: list[int] = field(default_factory=list)  # its KV blocks, in token order
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's new tokens in a forward (nanolab's engine builds one per running request per step).
    Unpacks like a tuple: ``block_table, start_pos, num_new = s``."""

    block_table: list[int]  # the sequence's blocks, with room for the new tokens
    start_pos: int  # position of its first new token (= tokens already cached)
    num_new: int  # new tokens in this forward

    def __iter__(self):
        return iter((self.block_table, self.start_pos, self.num_new))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Lab 2's causal attention: q (T, n_heads, head_dim) are the last T of L >= T tokens whose keys and
    values are k, v (L, n_kv_heads, head_dim) -> (T, n_heads, head_dim). Query head h reads kv head
    h // (n_heads // n_kv_heads); scale defaults to 1 / sqrt(head_dim)."""
    T, n_heads, head_dim = q.shape
    L, n_kv_heads, _ = k.shape
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # (L, nh, hs)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.einsum("thd,lhd->htl", q, k) * scale  # (nh, T, L)
    future = torch.arange(L, device=q.device)[None, :] > torch.arange(L - T, L, device=q.device)[:, None]
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", weights, v)  # (T, nh, hs)


def replay(allocator, ops: list[tuple[str, object]], record_state: bool = True) -> list[tuple]:
    """Apply (method, argument) calls to a block allocator in order, e.g. [("allocate", 2), ("free", [0])].

    One record per call: ("ok", result) or ("error", exception type name, message), followed, with
    ``record_state``, by the allocator's state after the call: (num_free, free_list(), every ref count).
    The checks and the grader compare allocators this way: one call runs a whole sequence.
    """
    records = []
    for name, arg in ops:
        try:
            record = ("ok", getattr(allocator, name)(arg))
        except Exception as e:  # the error is part of the behaviour being compared
            record = ("error", type(e).__name__, str(e))
        if record_state:
            refs = [allocator.ref_count(b) for b in range(allocator.num_total)]
            record += (allocator.num_free, allocator.free_list(), refs)
        records.append(record)
    return records
