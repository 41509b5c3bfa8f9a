"""Tests of the hand-written Prometheus exposition (`nanolab.serving.metrics`), against prometheus_client's parser."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanolab.serving.metrics import Counter, Gauge, Histogram, Registry, ServerMetrics, format_value

parser = pytest.importorskip("prometheus_client.parser")

BOUNDS = (0.01, 0.1, 1.0, 10.0)


def parse(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative_counts_of_observations_at_most_their_bound(
    values: list[float],
) -> None:
    h = Histogram("lat_seconds", "Latency.", BOUNDS)
    for v in values:
        h.observe(v)
    family = parse(h.render())["lat_seconds"]
    assert family.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "lat_seconds_bucket"}
    for bound in BOUNDS:
        assert buckets[format_value(bound)] == sum(v <= bound for v in values)
    assert buckets["+Inf"] == len(values)
    total = next(s.value for s in family.samples if s.name == "lat_seconds_sum")
    count = next(s.value for s in family.samples if s.name == "lat_seconds_count")
    assert count == len(values) and math.isclose(total, sum(values), rel_tol=1e-9, abs_tol=1e-9)


def test_an_observation_on_a_bound_falls_in_that_bucket() -> None:
    h = Histogram("x", "X.", (1, 2))
    h.observe(1.0)
    lines = h.render().splitlines()
    assert (
        'x_bucket{le="1"} 1' in lines and 'x_bucket{le="2"} 1' in lines and 'x_bucket{le="+Inf"} 1' in lines
    )


def test_labelled_counter_renders_one_sample_per_label_value_with_help_and_type() -> None:
    c = Counter("requests_total", 'Requests "by" status.\nSecond line.', ["status"])
    c.inc(status="stop")
    c.inc(2, status="length")
    c.inc(status='odd "value"\\')
    text = c.render()
    assert text.startswith("# HELP requests_total ") and "\n# TYPE requests_total counter\n" in text
    family = parse(text)["requests"]  # the parser drops the _total suffix of counters
    values = {s.labels["status"]: s.value for s in family.samples if s.name == "requests_total"}
    assert values == {"stop": 1, "length": 2, 'odd "value"\\': 1}
    assert family.documentation == 'Requests "by" status.\nSecond line.'


def test_counters_only_go_up_and_labels_must_match() -> None:
    c = Counter("c_total", "C.", ["status"])
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, status="x")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(1, reason="x")


def test_gauge_keeps_the_last_value_and_values_format_like_prometheus() -> None:
    g = Gauge("g", "G.")
    g.set(3)
    g.set(0.25)
    assert "g 0.25\n" in g.render()
    assert [format_value(v) for v in (1.0, 2.5, math.inf, -math.inf, math.nan)] == [
        "1",
        "2.5",
        "+Inf",
        "-Inf",
        "NaN",
    ]


def test_registry_refuses_duplicate_names_and_server_metrics_parse() -> None:
    r = Registry()
    r.counter("a_total", "A.")
    with pytest.raises(ValueError, match="already registered"):
        r.gauge("a_total", "A again.")
    m = ServerMetrics()
    m.ttft.observe(0.2)
    m.requests.inc(status="stop")
    families = parse(m.render())
    assert families["nanolab_time_to_first_token_seconds"].type == "histogram"
    assert families["nanolab_kv_blocks_free"].type == "gauge"
    assert all(f.documentation for f in families.values())
