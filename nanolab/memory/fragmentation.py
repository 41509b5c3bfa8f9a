"""What paging buys, measured: one stream of requests placed in one KV pool in three ways.

A pool of ``num_slots`` token slots serves a stream of requests, each holding ``length`` tokens of KV
from its arrival until ``arrival + lifetime``. The three strategies differ only in how a request's
slots are chosen:

- ``"reserve-max"``: one contiguous region of ``max_len`` slots, the most any request may need (what a
  server must do when it cannot know how long a request will grow). The unused part is reserved waste.
- ``"exact"``: one contiguous region of exactly ``length`` slots, first fit (the lowest address with
  room). No reserved waste, but departures leave holes, and a request that needs more than the largest
  hole cannot be placed even when the free slots add up to enough: external fragmentation.
- ``"paged"``: ``ceil(length / block_size)`` blocks of ``block_size`` slots anywhere in the pool, the
  lowest-numbered free blocks first. At most ``block_size - 1`` slots of a request's last block are
  empty, and any free block serves any request, so there is no external fragmentation.

The stream is served in arrival order until the first request that cannot be placed (a real server
would make it wait; here it marks where memory ran out). `simulate` reports the pool at that moment,
or after the last request when every one was placed. Lab 3 has a learner write the same function.

Deliberately left out: growth during decode (each request holds its final length for its whole life),
queueing and preemption (Lab 4), and KV bytes (a slot is one token of KV, whatever the model).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from nanolab.memory.paging import cdiv

STRATEGIES = ("reserve-max", "exact", "paged")


class SimRequest(NamedTuple):
    """One request of the stream."""

    arrival: float  # when it arrives; the stream is in arrival order
    length: int  # tokens of KV it holds (prompt + output), at least 1
    lifetime: float  # how long it holds them (math.inf: it never leaves)


class SimResult(NamedTuple):
    """The pool when the simulation stopped: at the first request that could not be placed, or after
    the last request."""

    owner: list[int | None]  # index of the request holding each slot; None for a free slot
    live: int  # requests holding memory: how many fit at once
    used: int  # slots holding a token's KV (the live requests' lengths added up)
    allocated: int  # slots held by live requests, used or not (used + internal waste)
    external_waste: int  # free slots that failed the first unplaced request although enough were free
    first_failure: int | None  # index of the first request that could not be placed; None if all were

    @property
    def internal_waste(self) -> int:
        """Slots held but empty: the unused part of reserved regions or of last blocks."""
        return self.allocated - self.used

    @property
    def utilization(self) -> float:
        """Used / allocated (1.0 when nothing is allocated)."""
        return self.used / self.allocated if self.allocated else 1.0


def simulate(
    requests: Sequence[SimRequest],
    num_slots: int,
    strategy: str,
    block_size: int = 16,
    max_len: int = 2048,
) -> SimResult:
    """Serve ``requests`` in order from a pool of ``num_slots`` slots with ``strategy`` (see the module).

    Before request i is placed, every live request whose ``arrival + lifetime <= requests[i].arrival``
    leaves. ``external_waste`` is the number of free slots at the first failure when they add up to
    what the request needed (``max_len``, ``length`` or whole blocks) but no hole could take it; else 0.

    Raises ValueError for an unknown strategy, a request longer than ``max_len`` or shorter than 1, a
    stream out of arrival order, or (paged) a pool that is not a whole number of blocks.

    Example:
        >>> stream = [SimRequest(0, 5, 10), SimRequest(1, 3, 1), SimRequest(2, 4, 10)]
        >>> r = simulate(stream, 12, "exact", max_len=8)
        >>> r.owner
        [0, 0, 0, 0, 0, 2, 2, 2, 2, None, None, None]
        >>> r.live, r.used, r.allocated, r.first_failure
        (2, 9, 9, None)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    if strategy == "paged" and (block_size < 1 or num_slots % block_size):
        raise ValueError(
            f"a paged pool is whole blocks: num_slots {num_slots} is not a multiple of block_size {block_size}"
        )
    for i, r in enumerate(requests):
        if not 1 <= r.length <= max_len:
            raise ValueError(f"request {i} has length {r.length}; lengths must be in [1, max_len={max_len}]")
        if i and r.arrival < requests[i - 1].arrival:
            raise ValueError(f"request {i} arrives before request {i - 1}; sort the stream by arrival")

    regions: dict[int, list[tuple[int, int]]] = {}  # live request -> its (start, size) pieces
    leaving: list[tuple[float, int]] = []  # (end, request) of the live requests, a heap
    free_blocks = list(range(num_slots // block_size)) if strategy == "paged" else []  # a heap
    allocated = used = 0
    failure: int | None = None
    external = 0
    for i, r in enumerate(requests):
        while leaving and leaving[0][0] <= r.arrival:
            _, j = heapq.heappop(leaving)
            for start, size in regions.pop(j):
                allocated -= size
                if strategy == "paged":
                    heapq.heappush(free_blocks, start // block_size)
            used -= requests[j].length
        if strategy == "paged":
            n = cdiv(r.length, block_size)
            need = n * block_size
            if n <= len(free_blocks):
                blocks = [heapq.heappop(free_blocks) for _ in range(n)]
                pieces = [(b * block_size, block_size) for b in blocks]
            else:
                pieces = None
        else:
            need = max_len if strategy == "reserve-max" else r.length
            start = _first_fit(sorted(p for ps in regions.values() for p in ps), need, num_slots)
            pieces = None if start is None else [(start, need)]
        if pieces is None:
            failure = i
            external = num_slots - allocated if num_slots - allocated >= need else 0
            break
        regions[i] = pieces
        heapq.heappush(leaving, (r.arrival + r.lifetime, i))
        allocated += need
        used += r.length

    owner: list[int | None] = [None] * num_slots
    for j, pieces in regions.items():
        for start, size in pieces:
            owner[start : start + size] = [j] * size
    return SimResult(owner, len(regions), used, allocated, external, failure)


def _first_fit(taken: list[tuple[int, int]], need: int, num_slots: int) -> int | None:
    """Lowest start of ``need`` free slots, given the taken (start, size) regions sorted by start."""
    at = 0
    for start, size in taken:
        if start - at >= need:
            return at
        at = start + size
    return at if num_slots - at >= need else None
