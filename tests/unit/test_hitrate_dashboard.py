"""The dashboard and alert rules only name metrics that really exist: in a recorded vLLM 0.32 scrape, the
router's registry or the operator's registry (a renamed metric must break this test, not a dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

import kvstrata.controller.cache_status  # noqa: F401  (registers the status timer's metrics)
from kvstrata.controller.metrics import REGISTRY
from kvstrata.engine import fsjanitor
from kvstrata.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvstrata"
FIXTURE = ROOT / "fixtures" / "status-vllm-0.32.0-metrics-sample.txt"
METRIC = re.compile(r"\b(vllm:[a-z_:]+|kvstrata_[a-z_]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _registry_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def known_metrics() -> set[str]:
    names = set(re.findall(r"^(vllm:[a-z_:]+)", FIXTURE.read_text(), flags=re.M))
    janitor = {fsjanitor.METRIC_USED, fsjanitor.METRIC_BUDGET}
    janitor |= {f"{fsjanitor.METRIC_EVICTED_BYTES}_total", f"{fsjanitor.METRIC_EVICTED_FILES}_total"}
    return names | _registry_names(RouterMetrics().registry) | _registry_names(REGISTRY) | janitor


def test_dashboard_is_valid_and_names_real_metrics() -> None:
    dash = json.loads((CHART / "dashboards" / "kvstrata-cache.json").read_text())
    known = known_metrics()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used - known == set()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "hit rate by tier",
        "kv-cache usage",
        "time to first token",
        "routing decisions",
        "nvme tier",
    ):
        assert topic in titles


def test_alert_rules_name_real_metrics() -> None:
    text = (CHART / "templates" / "prometheusrule.yaml").read_text()
    used = set(METRIC.findall(text))
    assert {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"} <= used
    assert used - known_metrics() == set()


def test_values_expose_the_switches() -> None:
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["prometheusRule"]["enabled"] is False
    assert values["metrics"]["dashboard"]["enabled"] is False
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]["metrics"]["properties"]
    assert set(values["metrics"]["prometheusRule"]) <= set(props["prometheusRule"]["properties"])
    assert set(values["metrics"]["dashboard"]) <= set(props["dashboard"]["properties"])
