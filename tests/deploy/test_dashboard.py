"""The Grafana dashboard in the chart (``dashboards/specops.json``): a valid dashboard whose every
query names metrics the code exports, and its optional ConfigMap for Grafana's dashboard sidecar."""

from __future__ import annotations

import functools
import importlib
import json
import re

import pytest
from prometheus_client import REGISTRY

from tests.deploy import helm_support as hs

DASHBOARD = hs.CHART_DIR / "dashboards" / "specops.json"
DEFAULT = hs.CI_DIR / "default-values.yaml"
GPU = hs.CI_DIR / "gpu-keda-strimzi-values.yaml"
PACKAGES = ("core", "registry", "streams", "serving", "trainer", "specops")
"""Top-level folders of the ``specops`` namespace (``serving/metrics.py`` is ``specops.serving.metrics``)."""
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its query variables."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return out


@functools.cache
def exported() -> frozenset[str]:
    """Every sample name the code can export: each module that defines Prometheus metrics is imported
    (found by its ``prometheus_client`` import), then the names are read from the default registry."""
    for package in PACKAGES:
        for path in sorted((hs.REPO / package).rglob("*.py")):
            if "from prometheus_client import" in path.read_text():
                parts = path.relative_to(hs.REPO).with_suffix("").parts
                importlib.import_module(".".join(parts if parts[0] == "specops" else ("specops", *parts)))
    names = set()
    for family in REGISTRY.collect():
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return frozenset(names)


def test_the_dashboard_is_a_grafana_dashboard_with_every_view_operators_asked_for():
    dash = dashboard()
    assert dash["uid"] and dash["title"] == "specops" and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "panel ids are unique"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}

    def panel(title_part: str) -> str:
        found = [e for t, e in exprs.items() if title_part in t]
        assert len(found) == 1, f"one panel titled ...{title_part}..., got {len(found)}"
        return found[0]

    # OSD's per-token alpha and the accepted/drafted ratio are two panels, each named for what it shows
    alpha = panel("α per token")
    assert "specops_rejected_steps_total" in alpha and "specops_accepted_tokens_total" in alpha
    assert "sum by (cluster, method, version)" in alpha and "specops_drafted_tokens_total" not in alpha
    ratio = panel("accepted / drafted")
    assert "specops_drafted_tokens_total" in ratio and "specops_rejected_steps_total" not in ratio
    assert "rate(specops_generated_tokens_total" in panel("Tokens per second")
    assert "histogram_quantile(0.95" in panel("Time to first token")
    assert "specops_inter_token_latency_seconds_bucket" in panel("Inter-token latency")
    assert "specops_admission_queue_depth" in panel("Queue depth")
    promotions = panel("Promotions and rollbacks")
    assert 'decision="promoted"' in promotions and "specops_hotswap_auto_rollbacks_total" in promotions
    assert "specops_trainer_lag_seconds" in panel("Trainer lag")


def test_every_metric_the_dashboard_names_is_exported_by_the_code():
    names = {m for q in queries(dashboard()) for m in re.findall(r"\b(specops_[a-z0-9_]+)", q)}
    assert len(names) >= 15
    missing = sorted(names - exported())
    assert missing == [], f"the dashboard names metrics no module exports: {missing}"
    assert "specops_tokens_per_second" not in exported(), "a rate is PromQL's job, not a gauge"
    assert not [n for n in exported() if n.startswith("specops_") and n.endswith("_ms")], "durations are in seconds"


def test_the_dashboard_configmap_is_off_by_default_and_carries_the_file_for_the_sidecar():
    assert [o for o in hs.render(DEFAULT) if o["kind"] == "ConfigMap" and hs.component(o) == "dashboard"] == []
    objects = hs.render(GPU)
    cm = hs.one(objects, "ConfigMap", "dashboard")
    assert hs.validate_object(cm) == "builtin"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "specops"}
    assert cm["metadata"]["namespace"] == hs.NAMESPACE
    assert json.loads(cm["data"]["specops.json"]) == dashboard()

    # another sidecar label (null drops the default one, as Helm merges maps), in Grafana's namespace
    labels = {"grafana_dashboard": None, "dashboards": "ml"}
    other = hs.render(
        DEFAULT, {"grafana": {"dashboard": {"enabled": True, "labels": labels, "namespace": "monitoring"}}}
    )
    cm = hs.one(other, "ConfigMap", "dashboard")
    assert cm["metadata"]["labels"]["dashboards"] == "ml" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring" and "annotations" not in cm["metadata"]


def test_the_schema_refuses_unknown_dashboard_settings():
    with pytest.raises(hs.RenderError):
        hs.render(DEFAULT, {"grafana": {"dashboard": {"enable": True}}})
