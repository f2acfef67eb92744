"""The status timer's body against real HTTP /metrics servers (a recorded vLLM scrape, the real router
registry) and an in-memory stand-in for the API server's list and merge-patch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import serve
from prometheus_client import generate_latest

from kvstrata.api.models import CacheStatus
from kvstrata.controller.cache_status import (
    CacheStatusScraper,
    CacheStatusSettings,
    merged_conditions,
    metrics_condition,
    status_patch,
    targets,
)
from kvstrata.router.metrics import RouterMetrics

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "status-vllm-0.32.0-metrics-sample.txt"


def engine_text(queries: float, hits: float, usage: float = 0.25, start: float = 1000.0) -> str:
    """The recorded scrape with its prefix-cache counters, KV usage and start time replaced."""
    out = []
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("vllm:prefix_cache_queries_total{"):
            line = line.rsplit(" ", 1)[0] + f" {queries}"
        elif line.startswith("vllm:prefix_cache_hits_total{"):
            line = line.rsplit(" ", 1)[0] + f" {hits}"
        elif line.startswith("vllm:kv_cache_usage_perc{"):
            line = line.rsplit(" ", 1)[0] + f" {usage}"
        elif line.startswith("process_start_time_seconds "):
            line = f"process_start_time_seconds {start}"
        out.append(line)
    return "\n".join(out) + "\n"


def pod(name: str, component: str, port: int, ready: bool = True, uid: str | None = None) -> dict:
    return {
        "metadata": {
            "name": name,
            "uid": uid or f"uid-{name}",
            "labels": {"app.kubernetes.io/instance": "tiny", "app.kubernetes.io/component": component},
        },
        "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKube:
    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.patches: list[dict] = []

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        assert (api_version, kind, selector) == ("v1", "Pod", "app.kubernetes.io/instance=tiny")
        return self.pods

    def merge_patch(
        self, api_version: str, kind: str, ns: str, name: str, patch: dict, sub: str, mgr: str
    ) -> dict:
        assert sub == "status"
        self.patches.append(patch)
        return {"status": patch["status"], "metadata": {"resourceVersion": str(len(self.patches))}}


class MetricsServers:
    def __init__(self) -> None:
        self.texts: dict[int, str] = {}
        self.runners: list[web.AppRunner] = []

    async def add(self, text: str) -> int:
        app = web.Application()
        key = len(self.runners)

        async def handler(_: web.Request) -> web.Response:
            return web.Response(text=self.texts[port], content_type="text/plain")

        app.router.add_get("/metrics", handler)
        runner, port = await serve(app)
        self.texts[port] = text
        self.runners.append(runner)
        assert key == len(self.runners) - 1
        return port

    async def close(self) -> None:
        for r in self.runners:
            await r.cleanup()


@pytest.fixture
async def servers():
    s = MetricsServers()
    yield s
    await s.close()


def body(status: dict | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "ic-1", "generation": 2},
        "spec": {"engine": {"port": 8000}, "router": {"port": 8080}},
        "status": status or {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}]},
    }


async def test_tick_writes_window_rates_router_figures_and_condition(servers: MetricsServers) -> None:
    e0 = await servers.add(engine_text(1000, 500))
    e1 = await servers.add(engine_text(1000, 100))
    metrics = RouterMetrics()
    r0 = await servers.add(generate_latest(metrics.registry).decode())
    kube = FakeKube(
        [
            pod("tiny-engine-0", "engine", e0),
            pod("tiny-engine-1", "engine", e1),
            pod("tiny-router-x", "router", r0),
        ]
    )
    clock = iter([0.0, 15.0, 30.0])
    scraper = CacheStatusScraper(kube, CacheStatusSettings(heartbeat=1e9), clock=lambda: next(clock))

    first = await scraper.tick(body())
    assert first is not None
    assert first["cache"].get("hitRate") is None  # first scrape is a baseline: no window yet
    assert first["cache"]["hitRateTotal"] == pytest.approx(0.3)
    cond = {c["type"]: c for c in first["conditions"]}
    assert cond["MetricsAvailable"]["status"] == "True"
    assert cond["Ready"]["reason"] == "Ready"  # the reconciler's condition is carried over

    servers.texts[e0] = engine_text(1200, 680)
    servers.texts[e1] = engine_text(1100, 190, usage=0.75)
    metrics.requests.labels("http://e0", "ok").inc(6)  # 6 attempts (2 retries) for 4 client requests
    for reason in ("prefix", "prefix", "prefix", "least-load"):
        metrics.decided(reason)
    servers.texts[r0] = generate_latest(metrics.registry).decode()
    second = await scraper.tick(body({**first}))
    assert second is not None
    cache = CacheStatus.model_validate(second["cache"])
    assert cache.hit_rate == pytest.approx(270 / 300)
    assert cache.hit_rate_percent == 90
    assert cache.gpu_hit_rate == pytest.approx(270 / 300)
    assert cache.external_hit_rate == 0
    assert cache.cpu_hit_rate == 0 and cache.nvme_hit_rate == 0  # no connector tiers on these engines
    assert (cache.gpu_hit_rate_percent, cache.cpu_hit_rate_percent, cache.nvme_hit_rate_percent) == (90, 0, 0)
    assert cache.kv_usage == pytest.approx(0.5)
    assert cache.kv_usage_percent == 50
    assert [p.pod for p in cache.pods] == ["tiny-engine-0", "tiny-engine-1"]
    assert cache.pods[0].hit_rate == pytest.approx(180 / 200)
    assert second["router"] == {"requests": 4, "affinityShare": 0.75, "fallbacks": 0}
    assert "conditions" not in second  # unchanged condition is not rewritten

    # Nothing moved: no write at all.
    merged = {**first, **second}
    assert await scraper.tick(body(merged)) is None


async def test_failed_scrape_names_the_pod_and_not_ready_pods_are_listed_unscraped(
    servers: MetricsServers,
) -> None:
    e0 = await servers.add(engine_text(10, 5))
    dead_port = await servers.add("")
    await servers.runners[-1].cleanup()
    servers.runners.pop()
    kube = FakeKube(
        [
            pod("tiny-engine-0", "engine", e0),
            pod("tiny-engine-1", "engine", dead_port),
            pod("tiny-engine-2", "engine", e0, ready=False),
        ]
    )
    scraper = CacheStatusScraper(kube, CacheStatusSettings(timeout=2))
    patch = await scraper.tick(body())
    assert patch is not None
    cond = next(c for c in patch["conditions"] if c["type"] == "MetricsAvailable")
    assert (cond["status"], cond["reason"]) == ("False", "ScrapeFailed")
    assert "tiny-engine-1" in cond["message"] and "tiny-engine-2" not in cond["message"]
    rows = {p["pod"]: p for p in patch["cache"]["pods"]}
    assert rows["tiny-engine-2"]["ready"] is False and "kvUsage" not in rows["tiny-engine-2"]


def test_targets_skip_deleting_pods_and_scrape_only_ready() -> None:
    gone = pod("a", "engine", 1)
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ts = targets([gone, pod("b", "engine", 8000), pod("c", "engine", 8000, ready=False)], 8000)
    assert [(t.pod, t.url is not None) for t in ts] == [("b", True), ("c", False)]


def test_condition_reasons() -> None:
    ready = targets([pod("b", "engine", 8000)], 8000)
    assert metrics_condition(ready, [], [])[:2] == ("True", "Scraped")
    assert metrics_condition([], [], [])[:2] == ("False", "NoReadyEngines")
    assert metrics_condition(ready, [], ["tiny-router-x"])[1] == "ScrapeFailed"


def test_condition_keeps_transition_time_and_others() -> None:
    others = [{"type": "Ready", "status": "True"}]
    first = merged_conditions(others, ("True", "Scraped", "1/1"), 3, "t1")
    assert first is not None and first[0] == others[0]
    assert merged_conditions(first, ("True", "Scraped", "1/1"), 3, "t2") is None
    changed = merged_conditions(first, ("True", "Scraped", "2/2"), 3, "t3")
    assert changed is not None and changed[-1]["lastTransitionTime"] == "t1"
    flipped = merged_conditions(first, ("False", "ScrapeFailed", "x"), 3, "t4")
    assert flipped is not None and flipped[-1]["lastTransitionTime"] == "t4"


def test_patch_skips_scrape_time_only_changes_until_heartbeat() -> None:
    prev = {"cache": {"hitRate": 0.5, "lastScrapeTime": "t1"}}
    cache = {"hitRate": 0.5, "lastScrapeTime": "t2"}
    assert status_patch(prev, cache, None, None, heartbeat_due=False) is None
    assert status_patch(prev, cache, None, None, heartbeat_due=True) == {"cache": cache}
    assert status_patch(prev, {"hitRate": 0.6, "lastScrapeTime": "t2"}, None, None, False) is not None
