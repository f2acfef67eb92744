"""Live cache figures in the InferenceCluster status: a per-cluster timer that scrapes /metrics.

Every `interval` seconds (`OperatorConfig.cache_status`: env `KVSTRATA_CACHE_STATUS_INTERVAL`, default 15) the timer lists the cluster's
engine and router pods, scrapes each *ready* one concurrently (aiohttp, `timeout` each), folds the engine
counters into the cluster's `CacheTracker` (`hitrate`) and writes `status.cache`, `status.router` and the
`MetricsAvailable` condition with one merge patch of the status subresource.

- Writes are skipped when nothing but `lastScrapeTime` would change, except once per `heartbeat`
  (default 300 s) so a reader can tell a live idle cluster from a dead scraper.
- The condition list is the live one from the watched body with only `MetricsAvailable` replaced, so
  the reconciler's conditions are carried over; the response is handed to the reconciler's store so its
  next write carries ours. A status write never changes the spec, so it never triggers a reconcile.
- Counter samples live in this process only: after an operator restart the window starts anew
  (rates are None until the second scrape), while `hitRateTotal` still covers the pods' whole lives
  (their counters count since each engine process started).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import Counter, Gauge

from kvstrata.api.models import API_VERSION, KIND, CacheStatus, PodCache, RouterStatus
from kvstrata.api.router_config import LABEL_COMPONENT, LABEL_INSTANCE
from kvstrata.controller.hitrate import CacheTracker, percent
from kvstrata.controller.metrics import REGISTRY
from kvstrata.controller.promtext import (
    EngineSample,
    MetricsParseError,
    RouterSample,
    parse_engine,
    parse_router,
    sum_routers,
)
from kvstrata.controller.settings import CacheStatusSettings
from kvstrata.controller.status import Cond, merge_conditions
from kvstrata.controller.statussync import utc_now

log = logging.getLogger("kvstrata.cache_status")

Obj = dict[str, Any]
INSTANCE = LABEL_INSTANCE
COMPONENT = LABEL_COMPONENT
CONDITION = "MetricsAvailable"
MAX_POD_ROWS = 64
MANAGER = "kvstrata-cache-status"

SCRAPES = Counter(
    "kvstrata_operator_cache_scrapes_total",
    "Scrapes of engine and router /metrics by the status timer, by target and outcome",
    ["target", "outcome"],
    registry=REGISTRY,
)
HIT_RATE = Gauge(
    "kvstrata_inferencecluster_cache_hit_ratio",
    "Prefix-cache hit ratio over the status window, by tier (all = every tier)",
    ["namespace", "inferencecluster", "tier"],
    registry=REGISTRY,
)
KV_USAGE = Gauge(
    "kvstrata_inferencecluster_kv_usage_ratio",
    "Mean KV-cache usage of the ready engines",
    ["namespace", "inferencecluster"],
    registry=REGISTRY,
)


# ------------------------------------------------------------------------------------------ pods
@dataclass(frozen=True)
class Target:
    pod: str
    uid: str
    url: str | None  # None: not ready or no IP, so not scraped
    ready: bool


def _ready(pod: Obj) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _port(pod: Obj, default: int) -> int:
    for c in pod.get("spec", {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                return int(p["containerPort"])
    return default


def targets(pods: list[Obj], default_port: int) -> list[Target]:
    """Scrape targets of one component: ready, running pods with an IP; others listed unscraped."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        ip = status.get("podIP")
        ready = _ready(pod) and status.get("phase") == "Running" and bool(ip)
        host = f"[{ip}]" if ip and ":" in ip else ip
        url = f"http://{host}:{_port(pod, default_port)}/metrics" if ready else None
        out.append(Target(meta["name"], meta.get("uid", meta["name"]), url, ready))
    return out


# ------------------------------------------------------------------------------------ the status
@dataclass
class ClusterMemory:
    tracker: CacheTracker
    pods: dict[str, CacheTracker] = field(default_factory=dict)
    last_write: float = -1e18


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def cache_status(
    memory: ClusterMemory,
    engines: list[Target],
    samples: Mapping[str, EngineSample],
    now: float,
    scrape_time: str,
) -> Obj:
    """Fold one scrape into the cluster's memory and return `status.cache` (wire form). Pure but for
    the memory it updates."""
    counters = {uid: s.counters for uid, s in samples.items()}
    alive = {t.uid for t in engines}
    starts = {uid: s.start_time for uid, s in samples.items()}
    memory.tracker.observe(now, counters, alive=alive, start_times=starts)
    for uid in [u for u in memory.pods if u not in alive]:
        del memory.pods[uid]
    rows = []
    for t in engines:
        s = samples.get(t.uid)
        rate = None
        if s is not None:
            pod_tracker = memory.pods.setdefault(
                t.uid, CacheTracker(window_seconds=memory.tracker.window_seconds)
            )
            pod_tracker.observe(now, {t.uid: s.counters}, start_times={t.uid: s.start_time})
            rate = pod_tracker.window_rates().hit_rate
        rows.append(
            PodCache(
                pod=t.pod,
                ready=t.ready,
                hit_rate=_round(rate),
                kv_usage=_round(s.kv_usage) if s else None,
                running=s.running if s else None,
                waiting=s.waiting if s else None,
            )
        )
    window = memory.tracker.window_rates()
    total = memory.tracker.total_rates()
    usages = [s.kv_usage for s in samples.values() if s.kv_usage is not None]
    kv_usage = sum(usages) / len(usages) if usages else None
    status = CacheStatus(
        hit_rate=_round(window.hit_rate),
        hit_rate_total=_round(total.hit_rate),
        hit_rate_percent=percent(window.hit_rate),
        gpu_hit_rate=_round(window.gpu_hit_rate),
        external_hit_rate=_round(window.external_hit_rate),
        cpu_hit_rate=_round(window.tier_hit_rates.get("cpu")),
        nvme_hit_rate=_round(window.tier_hit_rates.get("nvme")),
        gpu_hit_rate_percent=percent(window.gpu_hit_rate),
        cpu_hit_rate_percent=percent(window.tier_hit_rates.get("cpu")),
        nvme_hit_rate_percent=percent(window.tier_hit_rates.get("nvme")),
        kv_usage=_round(kv_usage),
        kv_usage_percent=percent(kv_usage),
        tokens_from_cache=total.tokens_from_cache,
        queried_tokens=total.queried_tokens,
        pods=rows[:MAX_POD_ROWS],
        last_scrape_time=scrape_time,
    )
    return status.wire()


def router_status(sample: RouterSample | None) -> Obj | None:
    if sample is None:
        return None
    share = sample.affinity_decisions / sample.decisions if sample.decisions else None
    # One routing decision per client request; requests_total counts upstream attempts (retries too).
    return RouterStatus(
        requests=sample.decisions, affinity_share=_round(share), fallbacks=sample.fallbacks
    ).wire()


def metrics_condition(
    engines: list[Target], failed: list[str], routers_failed: list[str]
) -> tuple[str, str, str]:
    """(status, reason, message) of MetricsAvailable."""
    ready = [t for t in engines if t.ready]
    if failed or routers_failed:
        names = ", ".join([*failed, *routers_failed][:8])
        return "False", "ScrapeFailed", f"no /metrics from {names}"
    if not ready:
        return "False", "NoReadyEngines", "no ready engine pod to scrape"
    return "True", "Scraped", f"{len(ready)}/{len(engines)} engine pods scraped"


def merged_conditions(
    current: list[Obj], cond: tuple[str, str, str], generation: int | None, now: str
) -> list[Obj] | None:
    """The live condition list with ours set; None when ours is already as wanted."""
    status, reason, message = cond
    old = next((c for c in current if c.get("type") == CONDITION), None)
    if old and (old.get("status"), old.get("reason"), old.get("message")) == cond:
        return None
    return merge_conditions(
        [Cond(CONDITION, status, reason, message)], current, generation, now, ours_last=True
    )


def _without_time(cache: Obj | None) -> Obj:
    return {k: v for k, v in (cache or {}).items() if k != "lastScrapeTime"}


def status_patch(
    previous: Obj, cache: Obj, router: Obj | None, conditions: list[Obj] | None, heartbeat_due: bool
) -> Obj | None:
    """The status merge patch, or None when only the scrape time would change (and no heartbeat is due)."""
    patch: Obj = {}
    if _without_time(cache) != _without_time(previous.get("cache")) or heartbeat_due:
        # The pod table is a list: a merge patch replaces it whole, which is what we want.
        patch["cache"] = cache
    if router is not None and router != previous.get("router"):
        patch["router"] = router
    if conditions is not None:
        patch["conditions"] = conditions
    if patch and "cache" not in patch:
        patch["cache"] = cache  # any write carries the fresh scrape time
    return patch or None


# -------------------------------------------------------------------------------------- the timer
async def _fetch(http: aiohttp.ClientSession, url: str, timeout: float) -> str:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(
                resp.request_info, (), status=resp.status, message=resp.reason or ""
            )
        return await resp.text()


class CacheStatusScraper:
    """One per operator process; `tick(body)` is the timer's body for one InferenceCluster."""

    def __init__(
        self,
        kube: Any,
        settings: CacheStatusSettings | None = None,
        *,
        on_written: Callable[[tuple[str, str], Obj], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings or CacheStatusSettings()
        self.on_written = on_written
        self.clock = clock
        self.memory: dict[str, ClusterMemory] = {}

    def forget(self, uid: str) -> None:
        self.memory.pop(uid, None)

    async def _scrape(
        self, http: aiohttp.ClientSession, t: Target, parse: Callable[[str], Any], kind: str
    ) -> Any:
        assert t.url is not None
        try:
            result = parse(await _fetch(http, t.url, self.settings.timeout))
        except (aiohttp.ClientError, TimeoutError, MetricsParseError, OSError) as err:
            SCRAPES.labels(kind, "error").inc()
            log.info("scrape of %s (%s) failed: %s", t.pod, t.url, err or type(err).__name__)
            return None
        SCRAPES.labels(kind, "ok").inc()
        return result

    async def tick(self, body: Obj) -> Obj | None:
        """Scrape one cluster and write its status if it changed; returns the patch sent (or None)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", meta["name"])
        if meta.get("deletionTimestamp"):
            self.forget(uid)
            return None
        pods = await asyncio.to_thread(self.kube.list, "v1", "Pod", namespace, f"{INSTANCE}={name}")
        by_component: dict[str, list[Obj]] = {"engine": [], "router": []}
        for p in pods:
            comp = (p["metadata"].get("labels") or {}).get(COMPONENT)
            if comp in by_component:
                by_component[comp].append(p)
        engines = targets(by_component["engine"], int((spec.get("engine") or {}).get("port", 8000)))
        routers = targets(by_component["router"], int((spec.get("router") or {}).get("port", 8080)))
        async with aiohttp.ClientSession() as http:
            eng_results, rtr_results = await asyncio.gather(
                asyncio.gather(*(self._scrape(http, t, parse_engine, "engine") for t in engines if t.url)),
                asyncio.gather(*(self._scrape(http, t, parse_router, "router") for t in routers if t.url)),
            )
        scraped_engines = [t for t in engines if t.url]
        scraped_routers = [t for t in routers if t.url]
        samples = {t.uid: r for t, r in zip(scraped_engines, eng_results, strict=True) if r is not None}
        failed = [t.pod for t, r in zip(scraped_engines, eng_results, strict=True) if r is None]
        router_samples = [r for r in rtr_results if r is not None]
        routers_failed = [t.pod for t, r in zip(scraped_routers, rtr_results, strict=True) if r is None]

        memory = self.memory.get(uid)
        if memory is None:
            memory = self.memory[uid] = ClusterMemory(CacheTracker(window_seconds=self.settings.window))
        now, stamp = self.clock(), utc_now()
        cache = cache_status(memory, engines, samples, now, stamp)
        router = router_status(sum_routers(router_samples))
        self._export(namespace, name, memory, cache)

        previous = body.get("status") or {}
        conditions = merged_conditions(
            previous.get("conditions") or [],
            metrics_condition(engines, failed, routers_failed),
            meta.get("generation"),
            stamp,
        )
        patch = status_patch(
            previous, cache, router, conditions, now - memory.last_write >= self.settings.heartbeat
        )
        if patch is None:
            return None
        resp = await asyncio.to_thread(
            self.kube.merge_patch, API_VERSION, KIND, namespace, name, {"status": patch}, "status", MANAGER
        )
        memory.last_write = now
        if self.on_written is not None:
            self.on_written((namespace, name), resp)
        return patch

    @staticmethod
    def _export(namespace: str, name: str, memory: ClusterMemory, cache: Obj) -> None:
        rates = memory.tracker.window_rates()
        for tier, value in (("all", rates.hit_rate), *rates.tier_hit_rates.items()):
            if value is not None:
                HIT_RATE.labels(namespace, name, tier).set(value)
        if cache.get("kvUsage") is not None:
            KV_USAGE.labels(namespace, name).set(cache["kvUsage"])

    def prune(self, keep: set[str]) -> None:
        """Forget clusters that no longer exist (their timers stopped)."""
        for uid in [u for u in self.memory if u not in keep]:
            del self.memory[uid]


async def run_loop(
    scraper: CacheStatusScraper,
    keys: Callable[[], list[tuple[str, str]]],
    concurrency: int = 4,
) -> None:
    """Every `interval`: tick each InferenceCluster the reconciler knows (`keys()`), a few at a time.

    One loop rather than kopf timers: kopf puts a finalizer on every resource with a timer, and the
    operator deliberately has none (a cluster stays deletable with the operator down)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key: tuple[str, str]) -> str | None:
        async with gate:
            try:
                body = await asyncio.to_thread(scraper.kube.get, API_VERSION, KIND, key[0], key[1])
                if body is None:
                    return None
                await scraper.tick(body)
                return str(body["metadata"].get("uid", key[1]))
            except Exception as err:  # one cluster's trouble must not stop the others' status
                log.warning("cache status of %s/%s not updated: %s", key[0], key[1], err)
                return None

    while True:
        started = time.monotonic()
        seen = await asyncio.gather(*(one(k) for k in keys()))
        scraper.prune({uid for uid in seen if uid})
        await asyncio.sleep(max(0.5, scraper.settings.interval - (time.monotonic() - started)))


def register(registry: Any, rt: Any) -> None:
    """Start the cache-status loop with the operator (kopf startup/cleanup hooks on `registry`).

    `rt` is the operator's `handlers.Runtime`: its Kube client, and its store, which lists the clusters
    and receives our status writes so that the reconciler's next write carries them."""
    import kopf

    scraper = CacheStatusScraper(
        rt.kube, rt.config.cache_status, on_written=lambda key, resp: _remember(rt.store, key, resp)
    )
    tasks: list[asyncio.Task[None]] = []

    @kopf.on.startup(registry=registry)
    async def start_cache_status(**_: Any) -> None:
        tasks.append(asyncio.create_task(run_loop(scraper, rt.store.keys), name="kvstrata-cache-status"))

    @kopf.on.cleanup(registry=registry)
    async def stop_cache_status(**_: Any) -> None:
        for task in tasks:
            task.cancel()


def _remember(store: Any, key: tuple[str, str], resp: Obj) -> None:
    store.set_status(key, resp.get("status") or {}, (resp.get("metadata") or {}).get("resourceVersion"))
