"""The Grafana dashboard shipped for `nanolab serve` (deploy/grafana/nanolab-serve.json) reads only metrics the
server exports, and its Prometheus example scrapes where `nanolab serve` listens by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

from nanolab.cli import build_parser
from nanolab.serving.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "nanolab-serve.json").read_text())


def exported_samples() -> set[str]:
    m = ServerMetrics()
    m.ttft.observe(0.1)  # every series exists from the start; an observation changes nothing about names
    return {
        s.name for family in m.registry.collect() for s in family.samples if not s.name.endswith("_created")
    }


def test_every_series_the_dashboard_queries_is_exported_by_the_server() -> None:
    exported = exported_samples()
    used = set()
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bnanolab_[a-z0-9_]+", target["expr"]))
    assert used, "the dashboard queries nothing"
    assert used <= exported, f"queried but not exported: {sorted(used - exported)}"


def test_percentile_panels_read_histogram_buckets_of_every_latency() -> None:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    quantiles = [e for e in exprs if e.startswith("histogram_quantile(")]
    assert quantiles and all("_bucket{" in e and "by (le)" in e for e in quantiles)
    for histogram in (
        "nanolab_time_to_first_token_seconds",
        "nanolab_inter_token_latency_seconds",
        "nanolab_e2e_request_latency_seconds",
    ):
        assert any(f"{histogram}_bucket" in e for e in quantiles), histogram


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert max(x for x, _ in area) < 24, f"panel {p['title']!r} is wider than Grafana's 24 columns"
        assert not cells & area, f"panel {p['title']!r} overlaps another"
        cells |= area


def test_the_prometheus_example_scrapes_nanolab_serves_default_address() -> None:
    args = build_parser().parse_args(["serve"])
    text = (DEPLOY / "prometheus.yml").read_text()
    assert f'targets: ["{args.host}:{args.port}"]' in text
