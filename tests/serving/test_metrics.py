"""Tests of the server's metrics (`nanolab.serving.metrics`): prometheus_client metrics in a registry of
their own, read back through prometheus_client's parser."""

from __future__ import annotations

import math
from types import SimpleNamespace

import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import parser

from nanolab.serving.metrics import CONTENT_TYPE, LATENCY_BUCKETS, ServerMetrics, histogram_quantile

# Every family /metrics exports: (name as the parser names it, type, label names of its main samples).
FAMILIES = {
    "nanolab_requests": ("counter", ("status",)),
    "nanolab_prompt_tokens": ("counter", ()),
    "nanolab_generation_tokens": ("counter", ()),
    "nanolab_time_to_first_token_seconds": ("histogram", ()),
    "nanolab_inter_token_latency_seconds": ("histogram", ()),
    "nanolab_e2e_request_latency_seconds": ("histogram", ()),
    "nanolab_batch_size": ("histogram", ()),
    "nanolab_engine_steps": ("counter", ()),
    "nanolab_engine_step_seconds": ("counter", ()),
    "nanolab_engine_step_errors": ("counter", ()),
    "nanolab_mean_batch_size": ("gauge", ()),
    "nanolab_requests_running": ("gauge", ()),
    "nanolab_requests_waiting": ("gauge", ()),
    "nanolab_requests_waiting_max": ("gauge", ()),
    "nanolab_kv_blocks_total": ("gauge", ()),
    "nanolab_kv_blocks_free": ("gauge", ()),
    "nanolab_kv_blocks_cached": ("gauge", ()),
    "nanolab_kv_block_usage": ("gauge", ()),
    "nanolab_prefix_cache_hit_rate": ("gauge", ()),
    "nanolab_spec_decode_num_drafts": ("counter", ()),
    "nanolab_spec_decode_num_draft_tokens": ("counter", ()),
    "nanolab_spec_decode_num_accepted_tokens": ("counter", ()),
    "nanolab_spec_decode_acceptance_rate": ("gauge", ()),
    "nanolab_forwards_per_output_token": ("gauge", ()),
}


def parse(m: ServerMetrics) -> dict:
    text = m.render().decode()
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def output(n_new: int, finish_reason: str | None = None) -> SimpleNamespace:
    """What `observe_output` reads of a `RequestOutput`."""
    choice = SimpleNamespace(delta_token_ids=[7] * n_new, finish_reason=finish_reason)
    return SimpleNamespace(outputs=[choice], finished=finish_reason is not None)


def requests_by_status(m: ServerMetrics) -> dict[str, float]:
    family = parse(m)["nanolab_requests"]
    return {
        s.labels["status"]: s.value for s in family.samples if s.name == "nanolab_requests_total" and s.value
    }


def test_every_request_status_is_exported_from_the_start_at_zero() -> None:
    family = parse(ServerMetrics())["nanolab_requests"]
    statuses = {s.labels["status"]: s.value for s in family.samples if s.name == "nanolab_requests_total"}
    want = {"stop", "length", "abort", "timeout", "error", "rejected", "overloaded"}
    assert statuses == dict.fromkeys(want, 0.0)


def test_every_family_has_its_name_type_help_and_labels_and_no_created_series() -> None:
    m = ServerMetrics()
    m.requests.labels(status="stop").inc()
    m.ttft.observe(0.2)
    m.batch_size.observe(3)
    text = m.render().decode()
    families = parse(m)
    assert set(families) == set(FAMILIES)
    for name, (kind, labelnames) in FAMILIES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.documentation, name
        main = [s for s in family.samples if not s.name.endswith(("_bucket", "_sum", "_count"))]
        assert all(tuple(s.labels) == labelnames for s in main), name
    assert "_created" not in text
    assert "# TYPE nanolab_requests_total counter" in text  # counters keep their _total name in the text
    assert CONTENT_TYPE == m.content_type and CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_created_series_are_left_out_without_changing_other_exporters_in_the_process() -> None:
    """`disable_created_metrics()` is global; nanolab filters its own output instead."""
    ServerMetrics().render()
    other = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("other_total", "Another exporter's counter.", registry=other).inc()
    assert b"other_created" in prometheus_client.generate_latest(other)


def test_each_server_metrics_has_its_own_registry_and_the_global_one_is_untouched() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.requests.labels(status="stop").inc(3)
    assert requests_by_status(a) == {"stop": 3} and requests_by_status(b) == {}
    assert prometheus_client.REGISTRY.get_sample_value("nanolab_prompt_tokens_total") is None


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative_counts_of_observations_at_most_their_bound(
    values: list[float],
) -> None:
    m = ServerMetrics()
    for v in values:
        m.ttft.observe(v)
    family = parse(m)["nanolab_time_to_first_token_seconds"]
    samples = family.samples
    buckets = [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")]
    assert [float(le) for le, _ in buckets] == [*LATENCY_BUCKETS, math.inf]
    for le, count in buckets:
        assert count == sum(v <= float(le) for v in values)
    counts = [c for _, c in buckets]
    assert counts == sorted(counts) and counts[-1] == len(values)
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    count = next(s.value for s in samples if s.name.endswith("_count"))
    assert count == len(values) and math.isclose(total, sum(values), rel_tol=1e-9, abs_tol=1e-9)


def test_an_observation_on_a_bound_falls_in_that_bucket() -> None:
    m = ServerMetrics()
    m.batch_size.observe(2)
    family = parse(m)["nanolab_batch_size"]
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert (buckets["1.0"], buckets["2.0"], buckets["4.0"], buckets["+Inf"]) == (0, 1, 1, 1)


def test_outputs_count_tokens_latencies_and_requests_by_finish_reason() -> None:
    m = ServerMetrics()
    m.observe_output(output(1), arrival=0.0, last_token_time=None, now=0.5)  # first token: ttft 0.5
    m.observe_output(output(2), arrival=0.0, last_token_time=0.5, now=0.7)  # two tokens: itl 0.1 each
    m.observe_output(output(1, "timeout"), arrival=0.0, last_token_time=0.7, now=1.0)  # its deadline
    m.observe_output(output(0, "stop"), arrival=0.0, last_token_time=None, now=2.0)
    m.requests.labels(status="overloaded").inc()
    families = parse(m)

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("nanolab_generation_tokens", "nanolab_generation_tokens_total") == 4
    assert value("nanolab_time_to_first_token_seconds", "nanolab_time_to_first_token_seconds_count") == 1
    assert value("nanolab_inter_token_latency_seconds", "nanolab_inter_token_latency_seconds_count") == 3
    assert value("nanolab_e2e_request_latency_seconds", "nanolab_e2e_request_latency_seconds_sum") == 3.0
    assert requests_by_status(m) == {"timeout": 1, "stop": 1, "overloaded": 1}


def test_inter_token_latency_is_per_sample_when_a_request_has_several() -> None:
    # n = 3 samples, one new token each after 0.3 s: each sample waited 0.3 s for its token (the samples
    # run side by side), so three latencies of 0.3, not of 0.1; a sample with two tokens splits its gap
    m = ServerMetrics()
    three = SimpleNamespace(
        outputs=[SimpleNamespace(delta_token_ids=[7], finish_reason=None) for _ in range(3)], finished=False
    )
    m.observe_output(three, arrival=0.0, last_token_time=1.0, now=1.3)
    uneven = SimpleNamespace(
        outputs=[
            SimpleNamespace(delta_token_ids=[7, 8], finish_reason=None),
            SimpleNamespace(delta_token_ids=[], finish_reason="stop"),
        ],
        finished=False,
    )
    m.observe_output(uneven, arrival=0.0, last_token_time=1.3, now=1.5)
    family = parse(m)["nanolab_inter_token_latency_seconds"]
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    assert count == 5
    assert math.isclose(total, 3 * 0.3 + 2 * 0.1, rel_tol=1e-9)


def test_engine_stats_land_in_the_gauges_and_max_waiting_is_inf_without_a_limit() -> None:
    m = ServerMetrics()
    stats = SimpleNamespace(
        mean_batch_size=2.5,
        num_running=3,
        num_waiting=4,
        kv_blocks_total=100,
        kv_blocks_free=60,
        kv_blocks_cached=10,
        kv_block_usage=0.4,
        prefix_hit_rate=0.25,
        spec_acceptance_rate=0.75,
        forwards_per_token=0.5,
    )
    m.observe_stats(stats)
    m.observe_step(SimpleNamespace(num_seqs=3, step_seconds=0.01))
    families = parse(m)
    gauges = {
        name: families[name].samples[0].value for name, (kind, _) in FAMILIES.items() if kind == "gauge"
    }
    assert gauges == {
        "nanolab_mean_batch_size": 2.5,
        "nanolab_requests_running": 3,
        "nanolab_requests_waiting": 4,
        "nanolab_requests_waiting_max": math.inf,
        "nanolab_kv_blocks_total": 100,
        "nanolab_kv_blocks_free": 60,
        "nanolab_kv_blocks_cached": 10,
        "nanolab_kv_block_usage": 0.4,
        "nanolab_prefix_cache_hit_rate": 0.25,
        "nanolab_spec_decode_acceptance_rate": 0.75,
        "nanolab_forwards_per_output_token": 0.5,
    }
    assert families["nanolab_engine_steps"].samples[0].value == 1


def test_labels_are_checked_and_counters_only_go_up() -> None:
    m = ServerMetrics()
    with pytest.raises(ValueError):
        m.requests.labels(reason="stop")
    with pytest.raises(ValueError):
        m.prompt_tokens.inc(-1)


# ---- percentiles from buckets ----------------------------------------------------------------------


def test_histogram_quantile_interpolates_inside_the_bucket_that_holds_the_rank() -> None:
    buckets = [(0.1, 2.0), (0.2, 6.0), (math.inf, 6.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.125)  # rank 3: first of 4 in (0.1, 0.2]
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.075)  # rank 1.5 of 2 in (0, 0.1]
    # a rank beyond the last finite bound can only be said to be beyond it
    assert histogram_quantile(0.99, [(0.1, 2.0), (0.2, 6.0), (math.inf, 10.0)]) == 0.2
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))
    # the +Inf bucket alone counts observations but bounds none (Prometheus answers NaN too)
    assert math.isnan(histogram_quantile(0.5, [(math.inf, 4.0)]))


@pytest.mark.parametrize(
    "q, buckets",
    [(1.5, [(math.inf, 1.0)]), (-0.1, [(math.inf, 1.0)]), (0.5, [(0.1, 1.0)]), (0.5, [])],
    ids=["q above 1", "q below 0", "no +Inf bucket", "no buckets"],
)
def test_histogram_quantile_refuses_a_bad_q_or_buckets(q, buckets) -> None:
    with pytest.raises(ValueError):
        histogram_quantile(q, buckets)


@given(
    st.lists(st.floats(min_value=0.0005, max_value=20.0), min_size=1, max_size=200),
    st.sampled_from([0.5, 0.9, 0.99]),
)
def test_a_bucket_percentile_lies_in_the_bucket_of_the_true_one(values: list[float], q: float) -> None:
    """The estimate is only as precise as the buckets: it lands in the bucket that holds the true
    quantile (the observation of rank ceil(q * n)), anywhere between that bucket's bounds."""
    m = ServerMetrics()
    for v in values:
        m.ttft.observe(v)
    estimate = m.quantile("nanolab_time_to_first_token_seconds", q)
    true = sorted(values)[max(0, math.ceil(q * len(values)) - 1)]
    bounds = [0.0, *LATENCY_BUCKETS]
    upper = next(b for b in LATENCY_BUCKETS if true <= b)
    lower = bounds[bounds.index(upper) - 1]
    assert lower <= estimate <= upper, (true, estimate, (lower, upper))


def test_quantile_names_an_unknown_histogram() -> None:
    with pytest.raises(KeyError, match="nanolab_nothing"):
        ServerMetrics().quantile("nanolab_nothing", 0.5)


def test_speculation_counters_follow_the_engine_and_never_count_twice() -> None:
    """Each snapshot adds what changed since the last; the gauges say how well the guesses did."""
    from helpers.engine_utils import tiny_model

    from nanolab.engine.llm import LLM
    from nanolab.model.sampling import SamplingParams

    llm = LLM(tiny_model(vocab_size=32), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    m = ServerMetrics()
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for _ in range(2):
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, sp, use_tqdm=False)
        stats = llm.stats()
        m.observe_stats(stats)
        m.observe_stats(stats)  # the same snapshot again adds nothing
    families = parse(m)

    def value(name: str) -> float:
        return families[name].samples[0].value

    assert stats.spec_draft_tokens > 0
    assert value("nanolab_spec_decode_num_drafts") == stats.spec_verifications
    assert value("nanolab_spec_decode_num_draft_tokens") == stats.spec_draft_tokens
    assert value("nanolab_spec_decode_num_accepted_tokens") == stats.spec_accepted_tokens
    assert value("nanolab_spec_decode_acceptance_rate") == pytest.approx(stats.spec_acceptance_rate)
    assert value("nanolab_forwards_per_output_token") == pytest.approx(stats.forwards_per_token)
    assert stats.forwards_per_token < 1
