"""The server's metrics, exported on ``GET /metrics`` with `prometheus_client`.

Prometheus scrapes ``GET /metrics`` and reads plain text: for each metric a ``# HELP`` line, a ``# TYPE``
line, then one sample per line, ``name{label="value"} number``. A histogram is a set of cumulative
counters, one per bucket upper bound ``le`` ("less than or equal"), plus the sum and the count:

    # HELP nanolab_time_to_first_token_seconds Time from receiving a request to its first output token.
    # TYPE nanolab_time_to_first_token_seconds histogram
    nanolab_time_to_first_token_seconds_bucket{le="0.01"} 3.0
    nanolab_time_to_first_token_seconds_bucket{le="0.1"} 10.0
    nanolab_time_to_first_token_seconds_bucket{le="+Inf"} 12.0
    nanolab_time_to_first_token_seconds_count 12.0
    nanolab_time_to_first_token_seconds_sum 0.53

`ServerMetrics` is the set the server exports. Its metrics are `prometheus_client` counters, gauges and
histograms (thread-safe: the thread that receives the engine's outputs writes while HTTP handlers read) registered in a
`CollectorRegistry` of its own, never in prometheus_client's global one: several servers (or tests)
can live in one process, each with its own numbers.

`_created` series: prometheus_client adds one per counter and histogram (the time it was created).
`ServerMetrics.render` leaves them out by filtering its own samples (`WithoutCreated`), rather than by
calling ``prometheus_client.disable_created_metrics()``: that switch is global to the process, so it
would also change what any other exporter in the same process (an embedding application's) writes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nanolab.engine.outputs import RequestOutput
    from nanolab.engine.stats import EngineStats, StepRecord

__all__ = [
    "BATCH_BUCKETS",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "ServerMetrics",
    "WithoutCreated",
    "histogram_quantile",
]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# What `generate_latest` writes: Prometheus' text format 0.0.4, the content type prometheus_client's own
# exporters send with it (its CONTENT_TYPE_LATEST names version 1.0.0, which adds quoted UTF-8 metric
# names that nanolab does not use).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The ``q``-quantile (0 <= q <= 1) of a histogram, estimated from its buckets as Prometheus'
    ``histogram_quantile`` does.

    ``buckets``: ``(upper bound, cumulative count)`` pairs in increasing order of bound, the last one
    ``+Inf`` (what ``_bucket`` samples hold). The estimate finds the bucket that holds the rank
    ``q * count`` and interpolates linearly inside it, taking the observations as spread evenly between
    its bounds (the first bucket's lower bound is 0). A rank that falls in the +Inf bucket gets the
    largest finite bound. NaN when the histogram is empty, or has no finite bound (the +Inf bucket
    alone: it says how many, not how long).

    The error is up to the width of the bucket: with bounds 0.1 and 0.25, every p99 between them reads
    as somewhere in that range, whatever the real latencies were.

    Example: ``histogram_quantile(0.5, [(0.1, 2), (0.2, 6), (inf, 6)])`` is 0.125: rank 3 is the
    first of the 4 observations in (0.1, 0.2].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if not buckets or buckets[-1][0] != math.inf:
        raise ValueError("the last bucket must be +Inf (the histogram's count)")
    total = buckets[-1][1]
    if total == 0 or len(buckets) < 2:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > below:
            if bound == math.inf:
                return lower  # beyond the last finite bound: the best the buckets can say
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class WithoutCreated(Collector):
    """What ``source`` collects, less the ``<name>_created`` samples of its counters and histograms."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            created = family.name + "_created"
            if any(s.name == created for s in family.samples):
                family = copy.copy(family)
                family.samples = [s for s in family.samples if s.name != created]
            yield family


class ServerMetrics:
    """What `nanolab serve` exports on /metrics, updated from the engine's rounds; see `nanolab.serving.async_engine`.

    ``registry`` holds the metrics (a `CollectorRegistry` of this object's own); `render` writes them,
    to be served with ``content_type``.
    """

    content_type = CONTENT_TYPE

    def __init__(self, prefix: str = "nanolab") -> None:
        r = self.registry = CollectorRegistry()
        p = prefix
        self.requests = Counter(
            f"{p}_requests_total",
            "Requests by final status: a finish reason (stop, length, abort, timeout: its deadline "
            "passed), error (the engine failed), rejected (refused with HTTP 400) or overloaded (refused "
            "with HTTP 503 because too many requests were waiting). One per prompt; rejected and "
            "overloaded count HTTP requests.",
            ["status"],
            registry=r,
        )
        for status in ("stop", "length", "abort", "timeout", "error", "rejected", "overloaded"):
            self.requests.labels(status=status)  # every status shows from the start, at 0
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens_total", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter(
            f"{p}_generation_tokens_total", "Output tokens generated.", registry=r
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time from receiving a request to its first output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds",
            "Time from receiving a request to its end.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{p}_batch_size", "Requests in each engine step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.steps = Counter(f"{p}_engine_steps_total", "Engine steps run.", registry=r)
        self.step_seconds = Counter(
            f"{p}_engine_step_seconds_total",
            "Time spent inside engine steps (busy time; its rate is utilisation).",
            registry=r,
        )
        self.step_errors = Counter(
            f"{p}_engine_step_errors_total", "Engine steps that raised an exception.", registry=r
        )
        self.mean_batch_size = Gauge(
            f"{p}_mean_batch_size", "Mean requests per engine step since start.", registry=r
        )
        self.running = Gauge(
            f"{p}_requests_running", "Requests in the running batch (holding KV blocks).", registry=r
        )
        self.waiting = Gauge(f"{p}_requests_waiting", "Requests waiting to be admitted.", registry=r)
        self.max_waiting = Gauge(
            f"{p}_requests_waiting_max",
            "The server's limit on waiting requests (--max-waiting): beyond it new requests are refused "
            "with HTTP 503. +Inf when there is no limit.",
            registry=r,
        )
        self.max_waiting.set(math.inf)
        self.kv_total = Gauge(f"{p}_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_free = Gauge(f"{p}_kv_blocks_free", "KV cache blocks free in the allocator.", registry=r)
        self.kv_cached = Gauge(
            f"{p}_kv_blocks_cached",
            "KV cache blocks held by the prefix cache (evictable unless a running request shares them). "
            "With no request running, free + cached = total.",
            registry=r,
        )
        self.kv_usage = Gauge(f"{p}_kv_block_usage", "Fraction of KV blocks not free (0..1).", registry=r)
        self.prefix_hit_rate = Gauge(
            f"{p}_prefix_cache_hit_rate",
            "Prompt tokens served by the prefix cache / prompt tokens (0..1).",
            registry=r,
        )
        # speculative decoding (vLLM's spec_decode_* names; all stay 0 without it)
        self.spec_drafts = Counter(
            f"{p}_spec_decode_num_drafts_total", "Request-steps that checked guessed tokens.", registry=r
        )
        self.spec_draft_tokens = Counter(
            f"{p}_spec_decode_num_draft_tokens_total", "Guessed tokens checked by the model.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            f"{p}_spec_decode_num_accepted_tokens_total", "Guessed tokens the model kept.", registry=r
        )
        self.spec_acceptance_rate = Gauge(
            f"{p}_spec_decode_acceptance_rate",
            "Guessed tokens kept / guessed tokens checked (0..1).",
            registry=r,
        )
        self.forwards_per_token = Gauge(
            f"{p}_forwards_per_output_token",
            "Model forwards a request goes through per token it generates (1 without speculation).",
            registry=r,
        )
        self._spec_seen = (0, 0, 0)  # the engine's totals at the last snapshot: counters grow by the change

    def quantile(self, name: str, q: float) -> float:
        """The ``q``-quantile of one of this object's histograms (``name`` without ``_bucket``), estimated
        from its buckets (see `histogram_quantile`)."""
        buckets = [
            (float(s.labels["le"]), s.value)
            for family in self.registry.collect()
            for s in family.samples
            if s.name == f"{name}_bucket"
        ]
        if not buckets:
            raise KeyError(f"no histogram named {name!r}")
        return histogram_quantile(q, buckets)

    def render(self) -> bytes:
        """The exposition in Prometheus' text format (content type `CONTENT_TYPE`), without ``_created``."""
        return generate_latest(WithoutCreated(self.registry))

    # -- updates, from the engine's rounds (and, for refusals, from the HTTP handlers) --------------

    def observe_output(
        self, out: RequestOutput, arrival: float, last_token_time: float | None, now: float
    ) -> None:
        """Account for one incremental output that arrived at ``now`` (request received at ``arrival``;
        ``last_token_time``: when its previous output with tokens arrived, None before its first).

        Inter-token latency is per sample: the samples of a request (``n > 1``) run side by side, so each
        sample's new tokens took the whole gap; a sample with ``k`` new tokens in one output (several
        tokens per step) counts ``k`` latencies of ``gap / k``."""
        n_new = sum(len(c.delta_token_ids) for c in out.outputs)  # every sample's, when n > 1
        if n_new:
            self.generation_tokens.inc(n_new)
            if last_token_time is None:
                self.ttft.observe(now - arrival)
            else:
                for c in out.outputs:
                    for _ in c.delta_token_ids:
                        self.itl.observe((now - last_token_time) / len(c.delta_token_ids))
        if out.finished:
            self.requests.labels(status=out.outputs[0].finish_reason or "abort").inc()
            self.e2e.observe(now - arrival)

    def observe_step(self, record: StepRecord) -> None:
        """A step listener (see `nanolab.engine.stats`): account for one engine step."""
        self.batch_size.observe(record.num_seqs)
        self.step_seconds.inc(record.step_seconds)
        self.steps.inc()

    def observe_stats(self, stats: EngineStats) -> None:
        """Copy an engine snapshot into the gauges."""
        self.mean_batch_size.set(stats.mean_batch_size)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_free.set(stats.kv_blocks_free)
        self.kv_cached.set(stats.kv_blocks_cached)
        self.kv_usage.set(stats.kv_block_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        # (a snapshot from an engine without speculation may lack its fields)
        now = tuple(
            getattr(stats, f"spec_{n}", 0) for n in ("verifications", "draft_tokens", "accepted_tokens")
        )
        for counter, new, old in zip(
            (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens), now, self._spec_seen
        ):
            if new > old:
                counter.inc(new - old)
        self._spec_seen = now
        self.spec_acceptance_rate.set(getattr(stats, "spec_acceptance_rate", 0.0))
        self.forwards_per_token.set(getattr(stats, "forwards_per_token", 0.0))
