"""Static and continuous batching on a clock of model steps: who runs when, before any model runs.

Lab 4 builds this first, to measure what iteration-level scheduling (Orca, OSDI 2022) buys before the
scheduler that does it is written. The model is the simplest that keeps the difference:

- time is counted in steps ``0, 1, 2, ...``; at each step, every request in the batch makes one token
  (its prompt's forward pass makes the first, so a request of ``output_len`` tokens needs that many steps);
- a request can join a batch at any step from its ``arrival`` on; waiting requests join in arrival order;
- at most ``max_batch_size`` requests share a step.

*Static* batching forms a batch when none is running and runs it until its longest request is done; a
request that is done earlier keeps its row (the forward still computes it, as padding) and is returned
with the whole batch, as ``model.generate`` returns a padded batch. *Continuous* batching decides at
every step: a request leaves the step after its last token, and a waiting request takes its seat at once.

Prompt lengths, the token budget and memory are left out here; the scheduler (`nanolab.engine.scheduler`)
has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

BATCHING_MODES = ("static", "continuous")


class BatchRequest(NamedTuple):
    """One request of a simulated trace."""

    arrival: int  # first step at which it may run; a trace is in arrival order
    output_len: int  # tokens it generates (= steps it runs), at least 1


@dataclass
class BatchingResult:
    """A simulated trace: per request, the step it joined and the step its output was returned at."""

    start: list[int]  # step at which request i joined a batch
    finish: list[int]  # step at the end of which request i was returned
    batch_sizes: list[int]  # rows the forward computed at each step 0 .. last (0: idle)

    @property
    def num_steps(self) -> int:
        return len(self.batch_sizes)

    def latency(self, requests: Sequence[BatchRequest]) -> list[int]:
        """Steps from each request's arrival to its return, both counted (a request alone: output_len)."""
        return [f - r.arrival + 1 for f, r in zip(self.finish, requests)]


def simulate_batching(requests: Sequence[BatchRequest], max_batch_size: int, mode: str) -> BatchingResult:
    """Run ``requests`` through static or continuous batching (see the module) and time every request.

    Raises ValueError for an unknown ``mode``, ``max_batch_size < 1``, an ``output_len < 1``, a negative
    arrival, or a trace out of arrival order.

    Example:
        >>> trace = [BatchRequest(0, 5), BatchRequest(0, 1), BatchRequest(1, 2)]
        >>> s = simulate_batching(trace, 2, "static")
        >>> s.start, s.finish, s.batch_sizes
        ([0, 0, 5], [4, 4, 6], [2, 2, 2, 2, 2, 1, 1])
        >>> c = simulate_batching(trace, 2, "continuous")
        >>> c.start, c.finish, c.batch_sizes
        ([0, 0, 1], [4, 0, 2], [2, 2, 2, 1, 1])
    """
    if mode not in BATCHING_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, BATCHING_MODES))}, got {mode!r}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    for i, r in enumerate(requests):
        if r.output_len < 1:
            raise ValueError(f"request {i} has output_len {r.output_len}; every request makes a token")
        if r.arrival < 0 or (i and r.arrival < requests[i - 1].arrival):
            raise ValueError(f"request {i} arrives at {r.arrival}: arrivals must be >= 0 and in order")

    n = len(requests)
    start, finish = [0] * n, [0] * n
    batch_sizes: list[int] = []
    nxt = 0  # the first request that has not joined yet
    running: list[int] = []  # requests holding a row
    batch_end = -1  # static: last step of the running batch
    t = 0
    while nxt < n or running:
        if mode == "continuous":
            running = [i for i in running if start[i] + requests[i].output_len > t]
        elif t > batch_end:
            running = []
        if not running or mode == "continuous":
            while nxt < n and requests[nxt].arrival <= t and len(running) < max_batch_size:
                start[nxt] = t
                running.append(nxt)
                nxt += 1
            if mode == "static" and running:
                batch_end = t + max(requests[i].output_len for i in running) - 1
                for i in running:
                    finish[i] = batch_end
        if mode == "continuous":
            for i in running:
                finish[i] = start[i] + requests[i].output_len - 1
        if nxt >= n and not running:
            break
        batch_sizes.append(len(running))
        t += 1
    return BatchingResult(start, finish, batch_sizes)
