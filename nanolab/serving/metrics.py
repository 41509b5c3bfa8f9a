"""Serving metrics in Prometheus' text exposition format, written out by hand.

Prometheus scrapes ``GET /metrics`` and reads plain text: for each metric a ``# HELP`` line, a ``# TYPE``
line, then one sample per line, ``name{label="value"} number``. A histogram is a set of cumulative
counters, one per bucket upper bound ``le`` ("less than or equal"), plus the sum and the count:

    # HELP nanolab_time_to_first_token_seconds Time from receiving a request to its first output token.
    # TYPE nanolab_time_to_first_token_seconds histogram
    nanolab_time_to_first_token_seconds_bucket{le="0.01"} 3
    nanolab_time_to_first_token_seconds_bucket{le="0.1"} 10
    nanolab_time_to_first_token_seconds_bucket{le="+Inf"} 12
    nanolab_time_to_first_token_seconds_sum 0.53
    nanolab_time_to_first_token_seconds_count 12

`Counter`, `Gauge` and `Histogram` are the three kinds nanolab needs; `Registry.render` writes them all.
`ServerMetrics` is the set the server exports. Every update takes the metric's lock: the engine thread
writes while HTTP handlers read.

Deliberately left out: summaries, timestamps, exemplars, the OpenMetrics variant of the format.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanolab.engine.request import RequestOutput
    from nanolab.engine.stats import EngineStats, StepRecord

Sample = tuple[str, dict[str, str], float]  # (name with suffix, labels, value)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def format_value(v: float) -> str:
    """A sample value as Prometheus writes it: ``+Inf``, ``-Inf``, ``NaN``, integers without a dot."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


class Metric:
    """One named metric; ``labelnames`` are the labels every sample carries (values given per update)."""

    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def samples(self) -> Iterator[Sample]:
        raise NotImplementedError

    def render(self) -> str:
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines = [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{name}{_labels(labels)} {format_value(v)}" for name, labels, v in self.samples()]
        return "\n".join(lines) + "\n"


class _Valued(Metric):
    """A counter or a gauge: one number per combination of label values."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def get(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> Iterator[Sample]:
        with self._lock:
            items = sorted(self._values.items())
        for key, v in items:
            yield self.name, dict(zip(self.labelnames, key)), v


class Counter(_Valued):
    """A number that only goes up (restarts from 0 with the process). Prometheus derives rates from it."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; got inc({amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Valued):
    """A number that goes up and down: a current state such as running requests or KV blocks in use."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(Metric):
    """Counts of observations per bucket (upper bounds ``buckets``, plus ``+Inf``), their sum and count.

    A bucket counts the observations <= its bound, so the rendered buckets are cumulative and the
    ``+Inf`` bucket equals ``_count``. Quantiles are estimated by Prometheus from the buckets.
    """

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or len(set(bounds)) != len(bounds) or any(math.isnan(b) for b in bounds):
            raise ValueError(f"histogram buckets must be distinct numbers, got {list(buckets)}")
        self.bounds = [b for b in bounds if b != math.inf]
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is (max, +Inf]
        self._sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def samples(self) -> Iterator[Sample]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        running = 0
        for bound, c in zip([*self.bounds, math.inf], counts):
            running += c
            yield f"{self.name}_bucket", {"le": format_value(bound)}, running
        yield f"{self.name}_sum", {}, total
        yield f"{self.name}_count", {}, running


class Registry:
    """The metrics one endpoint exports, rendered in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def register(self, metric: Metric) -> Metric:
        if metric.name in self._metrics:
            raise ValueError(f"a metric named {metric.name!r} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.register(Gauge(name, help, labelnames))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self.register(Histogram(name, help, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        """The whole exposition (content type ``text/plain; version=0.0.4``)."""
        return "".join(m.render() for m in self._metrics.values())


class ServerMetrics:
    """What `nanolab serve` exports on /metrics. The engine thread updates it; see `nanolab.serving.async_engine`."""

    def __init__(self, prefix: str = "nanolab") -> None:
        r = self.registry = Registry()
        p = prefix
        self.requests = r.counter(
            f"{p}_requests_total",
            "Requests by final status: a finish reason (stop, length, abort), error (the engine failed), "
            "or rejected (refused with HTTP 400). One per prompt; rejected counts HTTP requests.",
            ["status"],
        )
        self.prompt_tokens = r.counter(f"{p}_prompt_tokens_total", "Prompt tokens of accepted requests.")
        self.generation_tokens = r.counter(f"{p}_generation_tokens_total", "Output tokens generated.")
        self.ttft = r.histogram(
            f"{p}_time_to_first_token_seconds", "Time from receiving a request to its first output token."
        )
        self.itl = r.histogram(f"{p}_inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = r.histogram(
            f"{p}_e2e_request_latency_seconds", "Time from receiving a request to its end."
        )
        self.batch_size = r.histogram(f"{p}_batch_size", "Requests in each engine step.", BATCH_BUCKETS)
        self.steps = r.counter(f"{p}_engine_steps_total", "Engine steps run.")
        self.step_seconds = r.counter(
            f"{p}_engine_step_seconds_total",
            "Time spent inside engine steps (busy time; its rate is utilisation).",
        )
        self.step_errors = r.counter(
            f"{p}_engine_step_errors_total", "Engine steps that raised an exception."
        )
        self.mean_batch_size = r.gauge(f"{p}_mean_batch_size", "Mean requests per engine step since start.")
        self.running = r.gauge(f"{p}_requests_running", "Requests in the running batch (holding KV blocks).")
        self.waiting = r.gauge(f"{p}_requests_waiting", "Requests waiting to be admitted.")
        self.kv_total = r.gauge(f"{p}_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_free = r.gauge(f"{p}_kv_blocks_free", "KV cache blocks free in the allocator.")
        self.kv_cached = r.gauge(
            f"{p}_kv_blocks_cached",
            "KV cache blocks held by the prefix cache (evictable unless a running request shares them). "
            "With no request running, free + cached = total.",
        )
        self.kv_usage = r.gauge(f"{p}_kv_block_usage", "Fraction of KV blocks not free (0..1).")
        self.prefix_hit_rate = r.gauge(
            f"{p}_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / prompt tokens (0..1)."
        )

    def render(self) -> str:
        return self.registry.render()

    # -- updates, called by the engine thread --------------------------------------------------------

    def observe_output(
        self, out: RequestOutput, arrival: float, last_token_time: float | None, now: float
    ) -> None:
        """Account for one incremental output that arrived at ``now`` (request received at ``arrival``)."""
        n_new = len(out.outputs[0].delta_token_ids)
        if n_new:
            self.generation_tokens.inc(n_new)
            if last_token_time is None:
                self.ttft.observe(now - arrival)
            else:
                for _ in range(n_new):
                    self.itl.observe((now - last_token_time) / n_new)
        if out.finished:
            self.requests.inc(status=out.outputs[0].finish_reason or "abort")
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
