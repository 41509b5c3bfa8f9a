"""What the engine lets others see: a record of every step, and a snapshot of its state.

Observers (the server's metrics, a benchmark) never read the engine's internals. They are given to the
engine when it is built (``Engine(..., listeners=[...])``) and called with a `StepRecord` at the end of
every step; at any time `Engine.stats` returns an `EngineStats` snapshot. Both are values: holding one
keeps nothing of the engine alive or locked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


class StepRecord(NamedTuple):  # a NamedTuple: one is built every step
    """One engine step."""

    num_seqs: int  # requests in the batch
    num_tokens: int  # prompt + decode tokens computed
    num_generated: (
        int  # tokens generated (one per request whose tokens were all computed; more with speculation)
    )
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
    # speculative decoding (all 0 without it)
    spec_verifications: int = 0  # request-steps that checked guesses
    spec_draft_tokens: int = 0  # guesses checked
    spec_accepted_tokens: int = 0  # guesses kept
    decode_rows: int = 0  # request-steps that generated tokens (one target forward row each, guesses aside)

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of the guesses checked that were kept."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Guesses kept per verification (each verification also adds one token of the model's own)."""
        return self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else 0.0

    @property
    def forwards_per_token(self) -> float:
        """Target forwards a request goes through per token it generates: 1.0 without speculation,
        1 / (1 + mean accepted) with it."""
        return self.decode_rows / self.generated_tokens if self.generated_tokens else 0.0

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


@dataclass
class StepCounters:
    """The engine's running totals behind `EngineStats` (the engine adds to them, observers read snapshots)."""

    steps: int = 0
    scheduled_seqs: int = 0
    batched_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    busy_seconds: float = 0.0
    forward_seconds: float = 0.0
    peak_kv_usage: float = 0.0
    sampled_rows: int = 0  # request-steps that generated tokens

    def add(self, record: StepRecord, kv_usage: float) -> None:
        self.steps += 1
        self.scheduled_seqs += record.num_seqs
        self.batched_tokens += record.num_tokens
        self.generated_tokens += record.num_generated
        self.forward_seconds += record.forward_seconds
        self.busy_seconds += record.step_seconds
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)

    def snapshot(
        self, num_running: int, num_waiting: int, preemptions: int, block_manager: Any, spec: Any = None
    ) -> EngineStats:
        """These totals with the engine's state now: an `EngineStats`; ``spec``: the speculator's counters."""
        allocator, cache = block_manager.allocator, block_manager.prefix_cache
        prefix = cache.stats() if cache is not None else None
        return EngineStats(
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            batched_tokens=self.batched_tokens,
            finished_requests=self.finished_requests,
            busy_seconds=self.busy_seconds,
            forward_seconds=self.forward_seconds,
            mean_batch_size=self.scheduled_seqs / self.steps if self.steps else 0.0,
            peak_kv_block_usage=self.peak_kv_usage,
            preemptions=preemptions,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_blocks_total=allocator.num_total,
            kv_blocks_free=allocator.num_free,
            kv_blocks_cached=cache.total_size // block_manager.block_size if cache is not None else 0,
            prefix_hit_rate=prefix.hit_rate if prefix is not None else 0.0,
            prefix_cached_tokens=prefix.cached_tokens if prefix is not None else 0,
            spec_verifications=spec.verifications if spec is not None else 0,
            spec_draft_tokens=spec.draft_tokens if spec is not None else 0,
            spec_accepted_tokens=spec.accepted_tokens if spec is not None else 0,
            decode_rows=self.sampled_rows,
        )
