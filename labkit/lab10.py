from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401 - for your cells: F.linear, F.gelu, F.silu


class LocalGroup:
    """``size`` ranks as threads of one process, summing tensors through shared memory: a stand-in for a
    ``torch.distributed`` process group. It counts the all-reduces it did and the bytes each rank sent."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0  # all-reduces (one per sum, however many ranks took part)
        self.bytes = 0  # bytes one rank contributed, over all the all-reduces
        self._barrier = threading.Barrier(size)
        self._parts: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, rank: int, x: torch.Tensor) -> None:
        self._parts[rank] = x.detach().clone()
        self._barrier.wait()
        total = self._parts[0].clone()
        for part in self._parts[1:]:
            total += part
        if self._barrier.wait() == 0:  # one thread counts the sum
            self.calls += 1
            self.bytes += x.nbytes
        x.copy_(total)


class TP:
    """Rank ``rank`` of ``size`` ranks (nanolab's `TPShard`): ``all_reduce(x)`` sums ``x`` over the ranks, in
    place, and returns it. With one rank it returns ``x`` unchanged."""

    def __init__(self, rank: int = 0, size: int = 1, group: LocalGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.all_reduce(self.rank, x)
        return x


def run_ranks(size: int, fn: Callable[[TP], Any]) -> tuple[list[Any], LocalGroup]:
    """Call ``fn(tp)`` for every rank at once, each in a thread of its own, all joined by one `LocalGroup`.
    Returns the results in rank order and the group (its counts). The first exception raised is re-raised."""
    group = LocalGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(TP(rank, size, group))
        except BaseException as e:  # handed to the caller
            errors.append(e)
            group._barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results, group


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x (..., heads, head_dim) by its token's angles, cos and sin (..., 1, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one sequence: q (T, heads, hd), k and v (T, kv_heads, hd) -> (T, heads, hd).
    Query head h reads KV head h // (heads // kv_heads)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def run_mlp_ranks(
    mlp_forward: Callable, x: torch.Tensor, shards: Sequence[Sequence[Any]], act: str
) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``mlp_forward(x, up_weight, up_bias, down_weight, down_bias, act, tp)`` at once, rank r
    given ``shards[r]`` (its four tensors). Returns each rank's output and the number of all-reduces."""
    outs, group = run_ranks(len(shards), lambda tp: mlp_forward(x.clone(), *shards[tp.rank], act, tp))
    return outs, group.calls


def run_attention_ranks(
    attention_forward: Callable,
    x: torch.Tensor,
    shards: Sequence[Sequence[Any]],
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``attention_forward(x, qkv_weight, qkv_bias, out_weight, out_bias, n_heads, n_kv_heads,
    rope, causal_attend, tp)`` at once over one sequence x (T, d_model), rank r given ``shards[r]`` (its four
    tensors and its head counts). Returns each rank's output and the number of all-reduces."""

    def one(tp: TP) -> torch.Tensor:
        return attention_forward(x.clone(), *shards[tp.rank], rope, causal_attend, tp)

    outs, group = run_ranks(len(shards), one)
    return outs, group.calls
