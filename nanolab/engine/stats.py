"""What the engine lets others see: a record of every step, and a snapshot of its state.

Observers (the server's metrics, a benchmark) never read the engine's internals. They are given to the
engine when it is built (``Engine(..., listeners=[...])``) and called with a `StepRecord` at the end of
every step; at any time `Engine.stats` returns an `EngineStats` snapshot. Both are values: holding one
keeps nothing of the engine alive or locked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class StepRecord(NamedTuple):  # a NamedTuple: one is built every step
    """One engine step."""

    num_seqs: int  # requests in the batch
    num_tokens: int  # prompt + decode tokens computed
    num_generated: int  # tokens sampled (one per request whose prompt was fully computed)
    forward_seconds: float  # model forward and logits
    step_seconds: float  # the whole step


StepListener = Callable[[StepRecord], None]


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters since it was built, and its state now."""

    steps: int
    generated_tokens: int
    batched_tokens: int  # prompt + decode tokens computed
    finished_requests: int
    busy_seconds: float  # time inside step()
    forward_seconds: float  # of which in the model forward and logits
    mean_batch_size: float  # requests per step
    peak_kv_block_usage: float
    preemptions: int
    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests waiting to be admitted (new or preempted)
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int  # held by the prefix cache (evictable unless a running request shares them)
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / prompt tokens
    prefix_cached_tokens: int

    @property
    def kv_block_usage(self) -> float:
        """Fraction of KV blocks not free."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def throughput(self) -> float:
        """Generated tokens per second of busy time."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def forward_fraction(self) -> float:
        """Share of the step time spent in the model forward."""
        return self.forward_seconds / self.busy_seconds if self.busy_seconds else 0.0
