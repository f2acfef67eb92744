"""Engine load and health from each engine's Prometheus ``/metrics``, scraped in the background.

Only three gauges matter for routing; kvstrata.vllm_metrics reads them (shared with the controller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from kvstrata.router.outcomes import FailureKind
from kvstrata.router.outlier import OutlierDetector
from kvstrata.router.pool import Endpoint, EndpointPool
from kvstrata.vllm_metrics import scan_load_gauges

log = logging.getLogger("kvstrata.router.scrape")

# An endpoint is marked unhealthy (its index entries dropped: it lost or will lose its cache) after
# this many failed scrapes in a row: refused/reset connections or 5xx, never timeouts (a stopped or
# busy engine keeps its cache); one success marks it healthy again. Separately, ``fail_after``
# failures in a row, timeouts included, eject it from rotation (router/outlier.py).
UNHEALTHY_AFTER = 2


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_blocks: int = 0  # the KV pool's size in blocks (0: not reported)


def parse_load(text: str) -> EngineLoad:
    """Sum each gauge over its label sets (one per engine core / DP rank); KV usage is the max."""
    g = scan_load_gauges(text)
    return EngineLoad(sum(g.running), sum(g.waiting), max(g.kv_usage, default=0.0), sum(g.kv_blocks))


class LoadScraper:
    """Scrapes every endpoint every ``interval`` seconds and updates it in place.

    Each endpoint on its own cadence: a wedged engine's scrape, hanging until its timeout, must not
    hold up the others' (their load, and the liveness a stream's last try waits on, patience.py)."""

    def __init__(
        self,
        pool: EndpointPool,
        session: aiohttp.ClientSession,
        interval: float = 1.0,
        timeout: float = 5.0,
        outlier: OutlierDetector | None = None,
        fail_after: int = 3,
    ) -> None:
        self.outlier = outlier
        self.fail_after = fail_after
        self.pool = pool
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._window = timeout + interval  # one scrape's span: streaming within it means alive
        self._task: asyncio.Task[None] | None = None
        self._scrapes: dict[str, asyncio.Task[None]] = {}
        # Called when an endpoint turns unhealthy (the router drops its index entries).
        self.on_down: Callable[[Endpoint], None] | None = None
        # Run after each scrape of an endpoint, on the same cadence (the fs-janitor's evictions).
        self.after_scrape: Callable[[Endpoint], Awaitable[None]] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-scraper")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._scrapes.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._scrapes.clear()

    async def scrape_all(self) -> None:
        eps = self.pool.all()
        if eps:
            await asyncio.gather(*(self.scrape(ep) for ep in eps))

    async def _run(self) -> None:
        while True:
            eps = {ep.url: ep for ep in self.pool.all()}
            for url in [u for u, t in self._scrapes.items() if t.done() and u not in eps]:
                del self._scrapes[url]
            for url, ep in eps.items():
                running = self._scrapes.get(url)
                if running is None or running.done():
                    self._scrapes[url] = asyncio.create_task(self.scrape(ep), name=f"scrape {url}")
            await asyncio.sleep(self.interval)

    async def scrape(self, ep: Endpoint) -> None:
        await self._scrape_load(ep)
        if self.after_scrape is not None:
            await self.after_scrape(ep)

    async def _scrape_load(self, ep: Endpoint) -> None:
        try:
            async with self.session.get(ep.url + "/metrics", timeout=self.timeout) as resp:
                text = await resp.text() if resp.status == 200 else ""
                reachable = resp.status < 500
        except TimeoutError:
            # Slow is not dead (its cache is intact), but an engine whose API server cannot answer
            # /metrics in time is wedged for routing purposes: it counts toward ejection.
            log.debug("scrape %s timed out", ep.url)
            self._failed(ep, FailureKind.SCRAPE_TIMEOUT)
            return
        except (aiohttp.ClientError, UnicodeDecodeError) as exc:
            log.debug("scrape %s failed: %s", ep.url, exc)
            reachable, text = False, ""
        if not reachable:
            self._failed(ep, FailureKind.SCRAPE_FAILED)
            if ep.failures >= UNHEALTHY_AFTER and ep.healthy:
                log.warning("endpoint %s unhealthy (%d failed scrapes)", ep.url, ep.failures)
                ep.healthy = False
                if self.on_down is not None:
                    self.on_down(ep)
            return
        if not ep.healthy:
            log.info("endpoint %s healthy again", ep.url)
        ep.answered_at = time.monotonic()
        ep.failures = 0
        ep.healthy = True
        if text:
            load = parse_load(text)
            ep.running, ep.waiting, ep.kv_usage, ep.scraped = load.running, load.waiting, load.kv_usage, True
            ep.kv_blocks = load.kv_blocks

    def _failed(self, ep: Endpoint, kind: FailureKind) -> None:
        ep.failures += 1
        # An engine that has never answered is booting, not an outlier: ejecting it would grow its
        # ejection (n × base) through its whole boot, and keep it out for up to a minute after it is
        # ready. Until its first answer it is only unhealthy (refused connections), which routing skips.
        # An engine whose streams move is busy, not wedged, whatever its API server's scrape latency:
        # ejecting it on a loaded machine would also use up the room max_ejection_percent leaves for
        # the engine that is wedged (seen in CI: 1 s scrape deadlines, 2 cores, 3 engines).
        busy = kind is FailureKind.SCRAPE_TIMEOUT and ep.streamed_at >= time.monotonic() - self._window
        if self.outlier is not None and ep.failures >= self.fail_after and ep.scraped and not busy:
            self.outlier.eject(ep, kind)
