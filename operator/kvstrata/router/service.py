"""Wires the router's parts together: HTTP session, pool, index, subscribers, scraper, discovery.

``RouterService`` is what ``kvstrata router`` runs and what tests embed:

    async with RouterService(settings) as svc:
        runner = await svc.serve("127.0.0.1", 8080)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Self

import aiohttp
import zmq.asyncio
from aiohttp import web

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.core import Router
from kvstrata.router.discovery import (
    EndpointSliceWatcher,
    in_cluster_namespace,
    load_api_access,
    static_specs,
)
from kvstrata.router.httplog import MalformedHttpFilter
from kvstrata.router.loadscrape import LoadScraper
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.native_http import NativeFront
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.prompts import LocalTokenizer
from kvstrata.router.proxy import PROXY_KEY, build_admin_app, build_app
from kvstrata.router.storage_evictions import StorageEvictions
from kvstrata.router.subscriber import KvEventSubscriber
from kvstrata.router.upstream import Upstream
from kvstrata.router.workpool import tokenize_on_calling_threads

log = logging.getLogger("kvstrata.router")


_GIL_SWITCH_SECONDS = 0.001


class RouterService:
    def __init__(
        self, settings: RouterSettings, *, tokenizer: LocalTokenizer | None = None, scrape: bool = True
    ) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self._tokenizer = tokenizer
        self._scrape = scrape
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self.session: aiohttp.ClientSession | None = None  # everything off the request path
        self.upstream: Upstream | None = None  # the request path (router/upstream.py)
        self.router: Router | None = None
        self.scraper: LoadScraper | None = None
        self.storage: StorageEvictions | None = None
        self.watcher: EndpointSliceWatcher | None = None
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self.front: NativeFront | None = None  # dataPlane: native
        self.port: int | None = None  # the port serve() bound (it may be asked for port 0)
        self._admin_runner: web.AppRunner | None = None
        self._http_filter = MalformedHttpFilter(self.metrics.malformed_http)
        self._stopping: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        # Tokenizer threads that run Python (hashing a huge prompt's blocks) hand the GIL back to the
        # event loop every millisecond instead of every 5 ms (CPython's default), so a request on the
        # loop waits at most about that long behind them.
        sys.setswitchinterval(_GIL_SWITCH_SECONDS)
        tokenize_on_calling_threads()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        s = self.settings
        connector = aiohttp.TCPConnector(
            limit=s.max_upstream_connections, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60
        )
        # No cookie jar: a proxy that kept an engine's Set-Cookie would send it with every later
        # client's request (and a jar is a filter pass per request).
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        self.router = Router(s, self.metrics, self.session, tokenizer=self._tokenizer)
        self._zmq = zmq.asyncio.Context()
        self.router.pool.subscribe(self._on_add, self._on_remove)
        self.scraper = LoadScraper(
            self.router.pool,
            self.session,
            interval=s.scrape_interval_seconds,
            timeout=s.scrape_timeout_seconds,
            outlier=self.router.outlier,
            fail_after=s.ejection_consecutive_failures,
        )
        self.scraper.on_down = self.router.mark_down
        self.storage = StorageEvictions(
            self.router.index, self.metrics, self.session, s.scrape_timeout_seconds
        )
        self.scraper.after_scrape = self.storage.poll
        disc = s.discovery
        if disc.service:
            namespace = (
                disc.namespace or os.environ.get("POD_NAMESPACE") or in_cluster_namespace() or "default"
            )
            self.watcher = EndpointSliceWatcher(disc, namespace, load_api_access(), self._replace)
            self.watcher.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.watcher.synced.wait(), timeout=10)
        else:
            self.router.pool.replace(static_specs(disc.static))
        if self._scrape:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.scraper.scrape_all(), timeout=3)
            self.scraper.start()
        await self._wait_index_synced(s.index_sync_timeout_seconds)
        # Connections as many as the session's (maxUpstreamConnections), kept idle as long (60 s).
        self.upstream = Upstream(
            connect_timeout=s.connect_timeout_seconds, limit=s.max_upstream_connections, keepalive_seconds=60
        )
        self.app = build_app(self.router, self.upstream)

    async def _wait_index_synced(self, timeout: float) -> None:
        """Serve only once the index holds what the engines already cached: routing on a half-replayed
        history sends prompts to engines that cleared or evicted them since (measured in `make
        bench-router`: a router started on engines with ten rounds of history replayed for ~1.4 s and
        misrouted its first requests). Past the timeout it serves anyway, on what it has."""
        pending = [sub.synced.wait() for sub in self.subscribers.values() if not sub.synced.is_set()]
        if not pending:
            return
        began = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout=timeout)
        except TimeoutError:
            late = [url for url, sub in self.subscribers.items() if not sub.synced.is_set()]
            log.warning("KV index not synced after %.1fs for %s; serving anyway", timeout, ", ".join(late))
        else:
            log.info("KV index synced from %d engines in %.2fs", len(pending), time.monotonic() - began)

    def _replace(self, specs: list[EndpointSpec]) -> None:
        assert self.router is not None
        self.router.pool.replace(specs)

    def _on_add(self, ep: Endpoint) -> None:
        log.info("endpoint added: %s (events %s, replay %s)", ep.url, ep.spec.kv_events, ep.spec.kv_replay)
        if self.router is not None:
            outlier = self.router.outlier
            self.metrics.track_endpoint(ep, lambda: float(outlier.ejected(ep)))
        if ep.spec.kv_events and self.router is not None and self._zmq is not None:
            sub = KvEventSubscriber(
                ep, self.router.index, self.metrics, self._zmq, topic=self.settings.kv_events_topic
            )
            self.subscribers[ep.url] = sub
            sub.start()

    def _on_remove(self, ep: Endpoint) -> None:
        log.info("endpoint removed: %s", ep.url)
        self.metrics.forget_endpoint(ep.url)
        if self.storage is not None:
            self.storage.forget(ep.url)
        sub = self.subscribers.pop(ep.url, None)
        if sub is not None:
            self._stopping.append(asyncio.create_task(sub.stop()))

    async def serve(self, host: str, port: int) -> web.AppRunner:
        assert self.app is not None
        # handler_cancellation: a client that goes away cancels its handler, which closes the upstream
        # request so the engine stops generating for nobody.
        # keepalive_timeout is also how long a new connection may take to send a complete request
        # head (aiohttp arms it at connect and closes a connection still waiting for one): the
        # header read timeout. Bodies stay raw (auto_decompress=False): router/bodies.py inflates
        # them off the event loop, bounded.
        s = self.settings
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=s.header_read_timeout_seconds,
            auto_decompress=False,
            logger=self._http_filter.logger(),
        )
        await self._runner.setup()
        if s.data_plane == "native":
            # The app answers on a loopback port what the native front hands it (router/native_http.py).
            site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
            await site.start()
            loopback = _bound_port(site)
            self.front = NativeFront(self.app, s, host, port, loopback)
            self.port = self.front.port
        else:
            site = web.TCPSite(self._runner, host, port, backlog=4096)
            await site.start()
            self.port = _bound_port(site)
        if s.admin_port is not None:
            self._admin_runner = web.AppRunner(
                build_admin_app(self.app[PROXY_KEY]),
                access_log=None,
                keepalive_timeout=s.header_read_timeout_seconds,
            )
            await self._admin_runner.setup()
            await web.TCPSite(self._admin_runner, host, s.admin_port).start()
        return self._runner

    async def stop(self) -> None:
        if self.front is not None:
            await self.front.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        for sub in list(self.subscribers.values()):
            await sub.stop()
        self.subscribers.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self.router is not None:
            self.router.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.session is not None:
            await self.session.close()
        if self._zmq is not None:
            self._zmq.term()


def _bound_port(site: web.TCPSite) -> int:
    """The port ``site`` listens on (the kernel's pick where it was asked for port 0)."""
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
