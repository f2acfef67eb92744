"""The router against misbehaving engines and hostile clients (issue 13): timeouts that mean
something, outlier ejection, bounded and decoded bodies, input errors as 4xx, prompt limits without
head-of-line blocking, slow clients, and the metrics that show each.

Engines here are stand-ins on 127.0.0.1 because each fault must happen on demand (a wedged process,
a stall mid-stream, a 5xx burst); tests/vllm/test_router_engines.py shows the wedge on real vLLM."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_router_proxy import (  # fixtures and stand-ins shared with the failover tests
    MODEL,
    PROMPT,
    Fake,
    Harness,
    RouterFactory,
    completion,
    fakes,
    free_port,
    make_router,
)

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.incremental import IncrementalEncoder, PromptEncoder
from kvstrata.router.incremental_native import NativeIncrementalEncoder
from kvstrata.router.loadscrape import LoadScraper
from kvstrata.router.outcomes import FailureKind
from kvstrata.router.outlier import AllEjected, OutlierDetector
from kvstrata.router.patience import last_try_patience
from kvstrata.router.pool import Endpoint, EndpointPool, EndpointSpec
from kvstrata.router.prompts import LocalTokenizer
from kvstrata.router.scoring import rendezvous
from kvstrata.router.workpool import PoolBusy, WorkPools, tokenize_on_calling_threads

__all__ = ["fakes", "make_router"]  # fixtures, used by name

FAST = {"firstByteTimeoutSeconds": 0.5, "streamIdleTimeoutSeconds": 0.5, "policy": "prefix-hash"}


class Wedged:
    """Accepts connections and reads requests, never answers (a hung engine process)."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.url = ""
        self.requests = 0

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    async def start(self) -> Wedged:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def wedged() -> AsyncIterator[Callable[[], Any]]:
    made: list[Wedged] = []

    async def make() -> Wedged:
        w = await Wedged().start()
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


class Misbehaving(Fake):
    """More faults: slow first byte, long stream, a stall mid-stream, a huge answer, and a busy engine
    (its first byte past the first-byte timeout, its /metrics answered at once)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.mode not in ("slow-first-byte", "long-stream", "stall", "huge", "busy", "delay"):
            return await super().handle(request)
        if request.path == "/metrics":
            return web.Response(text="")
        if self.mode == "delay":  # an answer that takes a while: requests stay in flight
            await asyncio.sleep(0.5)
            return await super().handle(request)
        self.bodies.append(await request.read())
        if self.mode == "busy":
            await asyncio.sleep(1.5)  # three first-byte timeouts of FAST
        if self.mode == "huge":
            return web.Response(body=b"x" * 2_000_000, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "slow-first-byte":
            await asyncio.sleep(0.3)  # under the 0.5 s first-byte timeout
        chunks = 12 if self.mode == "long-stream" else 1
        for i in range(chunks):
            await resp.write(f'data: {{"i":{i}}}\n\n'.encode())
            await asyncio.sleep(0.1)  # the whole stream outlasts the first-byte timeout
        if self.mode == "stall":
            await asyncio.sleep(30)
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def misbehaving(*modes: str) -> list[Misbehaving]:
    return [await Misbehaving(mode).start() for mode in modes]  # type: ignore[misc]


def routed_to(h: Harness, url: str, stem: str = PROMPT) -> str:
    """A prompt that the prefix-hash policy sends to ``url`` first."""
    router = h.svc.router
    assert router is not None
    urls = [ep.url for ep in router.pool.all()]
    for i in range(1000):
        prompt = f"{i} {stem}"
        key = prompt[: router.chunk_chars].encode()
        if max(urls, key=lambda u: rendezvous(key, u)) == url:
            return prompt
    raise AssertionError("no prompt found")


async def metrics(h: Harness) -> str:
    async with h.client.get(h.base + "/metrics") as resp:
        return await resp.text()


async def state(h: Harness) -> dict[str, Any]:
    async with h.client.get(h.base + "/kvstrata/state") as resp:
        return await resp.json()  # type: ignore[no-any-return]


def error_of(raw: bytes) -> dict[str, Any]:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err  # type: ignore[no-any-return]


# --- a wedged engine: first-byte timeout, ejection, fast 503 ------------------------------------------
async def test_wedged_engine_is_ejected_and_waits_on_it_are_cut(
    make_router: RouterFactory, fakes: Callable[..., Any], wedged: Callable[[], Any]
) -> None:
    w = await wedged()
    (good,) = await fakes("stream")
    h = await make_router(
        [w.url, good.url], upstreamTimeoutSeconds=60, ejectionConsecutiveFailures=1, maxRetries=1, **FAST
    )
    to_wedged, to_good = routed_to(h, w.url), routed_to(h, good.url)
    # A non-streamed request waits on the wedged engine (its deadline is the whole 60 s)...
    t0 = time.monotonic()
    waiting = asyncio.create_task(h.post("/v1/completions", completion(prompt=to_wedged)))
    while w.requests < 1:
        await asyncio.sleep(0.01)
    # ...while a request to the healthy engine is answered.
    status, headers, _ = await h.post("/v1/completions", completion(prompt=to_good))
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)
    assert not waiting.done()
    # A streamed request there misses its first byte: retried on the healthy one, and the wedged one
    # is ejected, which cuts the first request's wait: it is retried too.
    status, headers, body = await h.post("/v1/completions", completion(prompt=to_wedged, stream=True))
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url) and body.endswith(b"[DONE]\n\n")
    status, headers, _ = await asyncio.wait_for(waiting, 5)
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)
    assert time.monotonic() - t0 < 5
    # Out of rotation: the next request for its prompt goes straight to the healthy engine.
    before = w.requests
    status, headers, _ = await h.post("/v1/completions", completion(prompt=to_wedged))
    assert (status, headers["x-kvstrata-endpoint"], w.requests) == (200, good.url, before)
    m = await metrics(h)
    assert f'kvstrata_router_ejections_total{{endpoint="{w.url}",reason="first_byte_timeout"}} 1.0' in m
    assert f'kvstrata_router_requests_total{{endpoint="{w.url}",outcome="ejected"}} 1.0' in m
    assert f'kvstrata_router_requests_total{{endpoint="{w.url}",outcome="first_byte_timeout"}} 1.0' in m
    assert 'kvstrata_router_retries_total{reason="first_byte_timeout"} 1.0' in m
    assert f'kvstrata_router_ejected{{endpoint="{w.url}"}} 1.0' in m
    assert 'kvstrata_router_endpoints{state="ejected"} 1.0' in m
    ep = (await state(h))["endpoints"][w.url]
    assert ep["ejected"] and ep["ejectionReason"] == "first_byte_timeout" and ep["ejections"] == 1
    assert 0 < ep["ejectedForSeconds"] <= 10
    async with h.client.get(h.base + "/ready") as resp:
        ready = await resp.json()
    assert resp.status == 200 and ready["ejected"] == [w.url] and ready["healthy_endpoints"] == 1


async def test_a_streams_last_try_waits_on_a_busy_engine_but_not_on_a_wedged_one(
    make_router: RouterFactory, wedged: Callable[[], Any]
) -> None:
    """Past the first-byte timeout the last try keeps waiting while its engine answers scrapes:
    busy is not lost; so does a try after which only a silent engine is left. A wedged engine answers
    no scrape, so a last try there ends at the timeout."""
    w = await wedged()
    (busy,) = await misbehaving("busy")
    # Scrapes of the wedged engine hang for 5 s; the busy one's are answered every 0.1 s regardless.
    h = await make_router(
        [w.url, busy.url],
        scrape=True,
        scrapeIntervalSeconds=0.1,
        scrapeTimeoutSeconds=5,
        maxRetries=1,
        **FAST,
    )
    while not h.svc.router.pool.get(busy.url).answered_at:  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
    t0 = time.monotonic()
    status, headers, body = await h.post(
        "/v1/completions", completion(prompt=routed_to(h, w.url), stream=True)
    )
    waited = time.monotonic() - t0
    assert (status, headers["x-kvstrata-endpoint"], headers["x-kvstrata-attempts"]) == (200, busy.url, "2")
    assert body.endswith(b"data: [DONE]\n\n") and 0.5 + 1.5 <= waited < 0.5 + 1.5 + 1
    # The busy engine's own time is reported; the rest of the wait was the wedged engine's timeout.
    upstream = int(headers["x-kvstrata-upstream-ms"]) / 1000
    assert upstream >= 1.5 and 0.5 <= waited - upstream < 0.5 + 0.5
    # The other way round: a try remains, but only on the wedged engine, which is silent (its scrapes
    # hang): moving on could only reach it, so the busy engine is waited for too.
    status, headers, body = await h.post(
        "/v1/completions", completion(prompt=routed_to(h, busy.url), stream=True)
    )
    assert (status, headers["x-kvstrata-endpoint"], headers["x-kvstrata-attempts"]) == (200, busy.url, "1")
    m = await metrics(h)
    assert f'kvstrata_router_requests_total{{endpoint="{busy.url}",outcome="stream_ok"}} 2.0' in m
    assert f'endpoint="{busy.url}",outcome="first_byte_timeout"' not in m
    # A wedged engine as the only try: let go at its first-byte timeout.
    h1 = await make_router([w.url, busy.url], scrape=True, scrapeTimeoutSeconds=5, maxRetries=0, **FAST)
    t0 = time.monotonic()
    status, _, raw = await h1.post("/v1/completions", completion(prompt=routed_to(h1, w.url), stream=True))
    assert status == 502 and error_of(raw)["code"] == "upstream_failed"
    assert "first_byte_timeout" in error_of(raw)["message"]
    assert time.monotonic() - t0 < 0.5 + 0.5


async def test_requests_cut_from_an_ejected_engine_are_spread_over_the_others(
    make_router: RouterFactory, wedged: Callable[[], Any]
) -> None:
    """A retry ranks the engines left on their load now: the requests cut from one engine do not all
    follow the first ranking's runner-up."""
    w = await wedged()
    a, b = await misbehaving("delay", "delay")
    h = await make_router([w.url, a.url, b.url], upstreamTimeoutSeconds=60)
    h.prefer(w.url)
    sent = [asyncio.create_task(h.post("/v1/completions", completion())) for _ in range(4)]
    while w.requests < 4:
        await asyncio.sleep(0.01)
    router = h.svc.router
    assert router is not None
    victim = router.pool.get(w.url)
    assert victim is not None
    router.outlier.eject(victim, FailureKind.SCRAPE_TIMEOUT)  # as its failed scrapes would
    answers = await asyncio.wait_for(asyncio.gather(*sent), 5)
    assert all(status == 200 and headers["x-kvstrata-attempts"] == "2" for status, headers, _ in answers)
    served = sorted(headers["x-kvstrata-endpoint"] for _, headers, _ in answers)
    assert served == sorted([a.url, a.url, b.url, b.url])


async def test_every_engine_wedged_fails_fast_with_503(
    make_router: RouterFactory, wedged: Callable[[], Any]
) -> None:
    ws = [await wedged() for _ in range(3)]
    # Every engine may be ejected (the default keeps half in rotation: see the next test).
    h = await make_router([w.url for w in ws], ejectionConsecutiveFailures=1, maxEjectionPercent=100, **FAST)
    # The first request pays one first-byte timeout per engine it tries (not 3 × 600 s)...
    t0 = time.monotonic()
    status, _, raw = await h.post("/v1/completions", completion(stream=True))
    assert status == 502 and error_of(raw)["code"] == "upstream_failed"
    assert "first_byte_timeout" in error_of(raw)["message"]
    assert time.monotonic() - t0 < 3 * 0.5 + 1
    # ...then every engine is out, and the answer is an immediate 503 with when to come back.
    t0 = time.monotonic()
    status, headers, raw = await h.post("/v1/completions", completion())
    assert time.monotonic() - t0 < 0.3
    err = error_of(raw)
    assert status == 503 and err["code"] == "all_endpoints_ejected" and err["type"] == "server_error"
    assert 1 <= int(headers["Retry-After"]) <= 10
    async with h.client.get(h.base + "/v1/models") as resp:
        assert resp.status == 503
    async with h.client.get(h.base + "/ready") as resp:
        assert resp.status == 503 and (await resp.json())["reason"] == "every engine endpoint is ejected"


def test_ejection_backs_off_probes_back_and_decays() -> None:
    """Envoy's rules: n-th ejection in a row lasts n × base (capped); back on probation after it,
    where one failure ejects again and one success clears; the count decays with time back in."""
    now = [0.0]
    settings = RouterSettings(
        model=MODEL, ejection_consecutive_failures=3, ejection_base_seconds=10, ejection_max_seconds=25
    )
    kinds: list[FailureKind] = []
    det = OutlierDetector(settings, lambda ep, kind: kinds.append(kind), lambda: 2, clock=lambda: now[0])
    ep, other = Endpoint(EndpointSpec("http://a")), Endpoint(EndpointSpec("http://b"))
    det.failure(ep, FailureKind.UPSTREAM_5XX)
    det.failure(ep, FailureKind.UPSTREAM_5XX)
    det.success(ep)  # consecutive, so this resets the run
    det.failure(ep, FailureKind.UPSTREAM_5XX)
    det.failure(ep, FailureKind.UPSTREAM_5XX)
    assert not det.ejected(ep)
    det.failure(ep, FailureKind.CONNECT_ERROR)
    assert det.ejected(ep) and det.remaining(ep) == 10 and kinds == [FailureKind.CONNECT_ERROR]
    assert det.available([ep, other]) == [other]
    now[0] = 10.0
    assert not det.ejected(ep) and det.state(ep).probation
    det.failure(ep, FailureKind.FIRST_BYTE_TIMEOUT)  # on probation: one failure is enough
    assert det.ejected(ep) and det.remaining(ep) == 20
    now[0] = 30.0
    assert not det.ejected(ep)
    det.failure(ep, FailureKind.FIRST_BYTE_TIMEOUT)
    assert det.remaining(ep) == 25  # 3 × 10, capped at 25
    now[0] = 55.0
    assert not det.ejected(ep)
    det.success(ep)
    assert not det.state(ep).probation
    # 40 s back in rotation = 4 base periods: the multiplier decays from 3 to 0, next is 1 × base.
    now[0] = 95.0
    for _ in range(3):
        det.failure(ep, FailureKind.UPSTREAM_5XX)
    assert det.remaining(ep) == 10
    with pytest.raises(AllEjected) as exc:
        det.available([ep])
    assert exc.value.retry_after == 10
    # An endpoint the scraper still cannot reach stays out for another, longer round.
    now[0] = 105.0
    ep.failures = 3
    assert det.ejected(ep) and det.remaining(ep) == 20


def test_an_ejection_whose_time_is_up_keeps_its_room_until_it_is_readmitted() -> None:
    """Between the end of an ejection and the check that re-admits or re-ejects the engine, a healthy
    engine's slow answer must not take the room (seen in CI: both ended up out at once)."""
    now = [100.0]
    det = OutlierDetector(
        RouterSettings(model=MODEL, ejection_consecutive_failures=1, ejection_base_seconds=5),
        pool_size=lambda: 3,
        clock=lambda: now[0],
    )
    wedged, slow = Endpoint(EndpointSpec("http://w")), Endpoint(EndpointSpec("http://s"))
    det.failure(wedged, FailureKind.FIRST_BYTE_TIMEOUT)
    now[0] = 106.0  # its 5 s are up; nobody has looked at it yet
    det.failure(slow, FailureKind.FIRST_BYTE_TIMEOUT)
    assert not det.ejected(slow)
    assert not det.ejected(wedged)  # now re-admitted (on probation): the room is free again
    det.failure(slow, FailureKind.FIRST_BYTE_TIMEOUT)
    assert det.ejected(slow)


def test_by_default_half_stay_in_rotation_but_one_can_always_go() -> None:
    """Envoy's rule: a cap on the share ejected, yet at least one engine ejectable."""
    for n, most in ((1, 1), (2, 1), (3, 1), (4, 2), (7, 3)):
        det = OutlierDetector(
            RouterSettings(model=MODEL, ejection_consecutive_failures=1), pool_size=lambda n=n: n
        )
        eps = [Endpoint(EndpointSpec(f"http://e{i}")) for i in range(n)]
        for e in eps:
            det.failure(e, FailureKind.CONNECT_ERROR)
        assert sum(det.ejected(e) for e in eps) == most, n


def test_max_ejection_percent_keeps_some_in_rotation() -> None:
    settings = RouterSettings(model=MODEL, ejection_consecutive_failures=1, max_ejection_percent=50)
    det = OutlierDetector(settings, pool_size=lambda: 2)
    a, b = Endpoint(EndpointSpec("http://a")), Endpoint(EndpointSpec("http://b"))
    det.failure(a, FailureKind.CONNECT_ERROR)
    det.failure(b, FailureKind.CONNECT_ERROR)
    assert det.ejected(a) and not det.ejected(b)


async def test_scrape_timeouts_eject_a_wedged_engine_but_keep_its_cache(wedged: Callable[[], Any]) -> None:
    """A wedged engine's /metrics times out: counted (it used to be ignored), the engine ejected, its
    health and index left alone (a stopped engine keeps its cache)."""
    w = await wedged()
    pool = EndpointPool()
    pool.replace([EndpointSpec(w.url)])
    (ep,) = pool.all()
    det = OutlierDetector(RouterSettings(model=MODEL), pool_size=lambda: 1)
    downs: list[Endpoint] = []
    async with aiohttp.ClientSession() as session:
        scraper = LoadScraper(pool, session, timeout=0.2, outlier=det, fail_after=3)
        scraper.on_down = downs.append
        for _ in range(3):
            await scraper.scrape_all()
        assert not det.ejected(ep)  # it never answered: booting, not wedged
        ep.scraped = True  # it had answered before it wedged
        ep.failures = 0
        for _ in range(2):
            await scraper.scrape_all()
        assert not det.ejected(ep)
        await scraper.scrape_all()
    assert det.ejected(ep) and det.state(ep).reason is FailureKind.SCRAPE_TIMEOUT
    assert ep.healthy and downs == []


async def test_scrape_timeouts_of_an_engine_that_streams_do_not_eject_it(wedged: Callable[[], Any]) -> None:
    """An API server too slow for the scrape deadline on a loaded machine, while its engine streams
    tokens, is busy: ejecting it would spend the room max_ejection_percent keeps for a wedged one."""
    w = await wedged()  # its /metrics never answers, as a starved API server's would not in time
    pool = EndpointPool()
    pool.replace([EndpointSpec(w.url)])
    (ep,) = pool.all()
    ep.scraped = True
    det = OutlierDetector(RouterSettings(model=MODEL), pool_size=lambda: 1)
    async with aiohttp.ClientSession() as session:
        scraper = LoadScraper(pool, session, interval=0.1, timeout=0.2, outlier=det, fail_after=2)
        for _ in range(3):
            ep.streamed_at = time.monotonic()  # a request's stream moved just now
            await scraper.scrape_all()
        assert not det.ejected(ep) and ep.failures == 3
        ep.streamed_at = time.monotonic() - 1  # the streams stopped too: wedged
        await scraper.scrape_all()
    assert det.ejected(ep) and det.state(ep).reason is FailureKind.SCRAPE_TIMEOUT


async def test_the_last_try_is_patient_while_its_engine_streams_or_answers_scrapes() -> None:
    """Either sign of life keeps the last try waiting past its first-byte period; silence ends it."""
    ep = Endpoint(EndpointSpec("http://e"))
    period = 0.2

    async def wait_with(sign: Callable[[], None] | None) -> bool:
        """Whether a 1 s wait outlived the patience (True) or was cut at a period (False)."""

        async def beat() -> None:
            while sign is not None:
                sign()
                await asyncio.sleep(period / 4)

        beating = asyncio.create_task(beat())
        try:
            async with asyncio.timeout(None) as limit:
                with last_try_patience(limit, ep, period, budget=5):
                    await asyncio.sleep(1)
            return True
        except TimeoutError:
            return False
        finally:
            beating.cancel()

    def streamed() -> None:
        ep.streamed_at = time.monotonic()

    def answered() -> None:
        ep.answered_at = time.monotonic()

    t0 = time.monotonic()
    assert not await wait_with(None) and time.monotonic() - t0 < 2 * period
    assert await wait_with(streamed)
    ep.streamed_at = 0.0
    assert await wait_with(answered)


async def test_5xx_burst_ejects_the_engine(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    bad, good = await fakes("500", "ok")
    h = await make_router([bad.url, good.url], ejectionConsecutiveFailures=3, maxRetries=1, **FAST)
    prompt = routed_to(h, bad.url)
    for _ in range(5):
        status, headers, _ = await h.post("/v1/completions", completion(prompt=prompt))
        assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)
    assert len(bad.bodies) == 3  # ejected after the third 5xx in a row
    m = await metrics(h)
    assert f'kvstrata_router_ejections_total{{endpoint="{bad.url}",reason="upstream_5xx"}} 1.0' in m


# --- streams: slow first byte, long streams, stalls, breaks, client cancel -----------------------------
async def test_slow_first_byte_and_long_stream_within_the_timeouts_pass(make_router: RouterFactory) -> None:
    slow, long = await misbehaving("slow-first-byte", "long-stream")
    h = await make_router([slow.url, long.url], **FAST)
    for fake, chunks in ((slow, 1), (long, 12)):
        t0 = time.monotonic()
        status, headers, body = await h.post(
            "/v1/completions", completion(prompt=routed_to(h, fake.url), stream=True)
        )
        assert (status, headers["x-kvstrata-endpoint"]) == (200, fake.url)
        assert body.count(b'data: {"i"') == chunks and body.endswith(b"data: [DONE]\n\n")
    assert time.monotonic() - t0 > 1.0  # the long stream outlasted the first-byte timeout, whole
    assert "ejections_total{" not in await metrics(h)


async def test_stream_stalled_after_it_started_ends_with_an_idle_timeout_event(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (stall,) = await misbehaving("stall")
    (probe,) = await fakes("ok")
    h = await make_router([stall.url, probe.url], **FAST)
    task = asyncio.create_task(
        h.post("/v1/completions", completion(prompt=routed_to(h, stall.url), stream=True))
    )
    await asyncio.sleep(0.2)
    status, _, _ = await h.post("/v1/completions", completion(prompt=routed_to(h, probe.url)))
    assert status == 200 and not task.done()  # the healthy engine answers during the stall
    status, _, body = await asyncio.wait_for(task, 5)
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[0] == 'data: {"i":0}'
    assert error_of(events[-1].removeprefix("data: ").encode())["code"] == "upstream_idle_timeout"
    m = await metrics(h)
    assert f'kvstrata_router_requests_total{{endpoint="{stall.url}",outcome="stream_idle_timeout"}} 1.0' in m


async def test_mid_stream_close_and_client_cancel_are_told_apart(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    dying, slow = await fakes("stream-die", "stream-slow")
    h = await make_router([dying.url, slow.url], **{**FAST, "streamIdleTimeoutSeconds": 60})
    status, _, body = await h.post("/v1/completions", completion(prompt=routed_to(h, dying.url), stream=True))
    assert (
        status == 200
        and error_of(body.split(b"\n\n")[-2].removeprefix(b"data: "))["code"] == "upstream_failed"
    )
    # Clients that read the first event and hang up: their own doing, not the engine's.
    for i in range(5):
        async with h.client.post(
            h.base + "/v1/completions", json=completion(prompt=routed_to(h, slow.url, str(i)), stream=True)
        ) as resp:
            assert (await resp.content.readline()).startswith(b"data: ")
    for _ in range(100):
        if slow.cancelled == 5:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    m = await metrics(h)
    assert f'kvstrata_router_requests_total{{endpoint="{dying.url}",outcome="stream_aborted"}} 1.0' in m
    assert f'kvstrata_router_requests_total{{endpoint="{slow.url}",outcome="client_disconnect"}} 5.0' in m
    assert f'endpoint="{slow.url}",outcome="stream_aborted"' not in m
    assert h.svc.router is not None
    assert h.svc.router.outlier.state(h.svc.router.pool.get(slow.url)).consecutive == 0  # type: ignore[arg-type]


async def test_in_flight_gauge(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (slow,) = await fakes("slow")
    h = await make_router([slow.url])
    task = asyncio.create_task(h.post("/v1/completions", completion()))
    await asyncio.sleep(0.2)
    assert f'kvstrata_router_in_flight{{endpoint="{slow.url}"}} 1.0' in await metrics(h)
    task.cancel()


async def test_non_streamed_answers_are_bounded(make_router: RouterFactory) -> None:
    (huge,) = await misbehaving("huge")
    h = await make_router([huge.url], maxResponseBytes=1_000_000)
    status, _, raw = await h.post("/v1/completions", completion())
    assert status == 502 and error_of(raw)["code"] == "upstream_response_too_large"


# --- bodies: compression, bombs, bounds ---------------------------------------------------------------
async def test_compressed_bodies_are_decoded_and_forwarded_plain(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (ok,) = await fakes("ok")
    seen: list[dict[str, str]] = []
    h = await make_router([ok.url])
    plain = json.dumps(completion()).encode()
    orig = ok.handle

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        return await orig(request)

    ok.handle = record  # type: ignore[method-assign]
    for enc, data in (("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain))):
        status, _, _ = await h.post(
            "/v1/completions", data, headers={"Content-Encoding": enc, "Accept-Encoding": "gzip, br"}
        )
        assert status == 200
    assert ok.bodies == [plain, plain]
    for headers in seen:
        assert "Content-Encoding" not in headers and headers["Accept-Encoding"] == "identity"


@pytest.mark.parametrize(
    "encoding,body,status,code",
    [
        ("gzip", gzip.compress(b"\0" * 20_000_000), 413, "body_too_large"),  # 20 MB from ~20 KB
        ("gzip", b"this is not gzip", 400, "invalid_content_encoding"),
        ("gzip", gzip.compress(b'{"model": "tiny"}')[:-6], 400, "invalid_content_encoding"),
        ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
    ],
)
async def test_bad_compressed_bodies_are_refused(
    make_router: RouterFactory, fakes: Callable[..., Any], encoding: str, body: bytes, status: int, code: str
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], maxBodyBytes=1_000_000)
    got, _, raw = await h.post("/v1/completions", body, headers={"Content-Encoding": encoding})
    assert got == status and error_of(raw)["code"] == code
    assert ok.bodies == []
    assert f'kvstrata_router_bad_requests_total{{reason="{code}"}} 1.0' in await metrics(h)


async def test_gzip_bombs_do_not_stall_the_router(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url])  # the default 64 MiB bound
    bomb = gzip.compress(b"\0" * 200_000_000)  # ~200 KB that inflate to 200 MB
    bombs = [
        asyncio.create_task(h.post("/v1/completions", bomb, headers={"Content-Encoding": "gzip"}))
        for _ in range(3)
    ]
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    async with h.client.get(h.base + "/health") as resp:
        assert resp.status == 200
    assert time.monotonic() - t0 < 0.5
    for b in bombs:
        status, _, raw = await b
        assert status == 413 and error_of(raw)["code"] == "body_too_large"


# --- input errors are 4xx ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,status,code",
    [
        (b'{"model": "tiny", "prompt": "caf\xe9 \xff"}', 400, "invalid_utf8"),
        (b'{"model": "tiny", "prompt": "\\udc80"}', 400, "invalid_json"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "json_too_deep"),
        (json.dumps({"model": MODEL, "prompt": "x" * 1001}).encode(), 413, "prompt_too_large"),
        (json.dumps({"model": MODEL, "prompt": ["x" * 600, "y" * 600]}).encode(), 413, "prompt_too_large"),
        (json.dumps({"model": MODEL, "prompt": list(range(300))}).encode(), 413, "prompt_too_large"),
    ],
)
async def test_parse_failures_are_4xx(
    make_router: RouterFactory, fakes: Callable[..., Any], raw: bytes, status: int, code: str
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], maxPromptChars=1000)
    got, _, body = await h.post("/v1/completions", raw)
    assert got == status and error_of(body)["code"] == code
    assert ok.bodies == []


async def test_long_chat_prompt_is_413(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], maxPromptChars=1000)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x" * 1001}]}]
    status, _, raw = await h.post("/v1/chat/completions", {"model": MODEL, "messages": msgs})
    err = error_of(raw)
    assert status == 413 and err["code"] == "prompt_too_large" and err["param"] == "messages"


async def _raw_http(port: int, data: bytes, wait: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), wait)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "data,error",
    [
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            "BadHttpMessage",
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", "LineTooLong"),
    ],
)
async def test_malformed_http_is_400_without_a_traceback(
    make_router: RouterFactory, caplog: pytest.LogCaptureFixture, data: bytes, error: str
) -> None:
    h = await make_router([])
    port = int(h.base.rsplit(":", 1)[1])
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        answer = await _raw_http(port, data)
    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.exc_info]
    assert f'kvstrata_router_malformed_http_total{{error="{error}"}} 1.0' in await metrics(h)


# --- slow clients -------------------------------------------------------------------------------------
async def test_slow_loris_headers_are_cut_off(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], headerReadTimeoutSeconds=0.5)
    port = int(h.base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    closed_at = None
    for _ in range(30):  # one header line every 0.1 s, never the blank line that ends the head
        await asyncio.sleep(0.1)
        if reader.at_eof() or writer.is_closing():
            break
        try:
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
        except ConnectionError:
            break
        if time.monotonic() - t0 > 0.3:
            status, _, _ = await h.post("/v1/completions", completion())  # others are served meanwhile
            assert status == 200
    data = await asyncio.wait_for(reader.read(), 2)
    closed_at = time.monotonic() - t0
    writer.close()
    assert data == b"" and closed_at < 2.0


async def test_slow_body_is_408(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], bodyReadTimeoutSeconds=0.3)
    port = int(h.base.rsplit(":", 1)[1])
    answer = await _raw_http(
        port, b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model"', wait=3
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and error_of(body)["code"] == "body_timeout"


# --- head-of-line blocking in tokenization ------------------------------------------------------------
class SlowOnBigPrompts:
    """A tokenizer stand-in whose cost grows with the prompt, like the real one (4 MB ≈ 6 s)."""

    def encode_completion(self, prompt: str) -> list[int]:
        if len(prompt) > 10_000:
            time.sleep(1.0)
        return list(range(len(prompt) // 4))


async def test_big_prompts_do_not_hold_up_short_ones(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url], largePromptChars=10_000, largePromptQueue=1)
    assert h.svc.router is not None
    h.svc.router.tokenizer = SlowOnBigPrompts()  # type: ignore[assignment]
    big = [
        asyncio.create_task(h.post("/v1/completions", completion(prompt=f"{i}" + "z" * 50_000)))
        for i in range(2)
    ]
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    for i in range(5):  # over the inline limit: these go through the (small) pool
        status, _, _ = await h.post("/v1/completions", completion(prompt=f"{i} " + "s" * 2000))
        assert status == 200
    assert time.monotonic() - t0 < 0.8  # not behind the big ones' 1 s each
    for b in big:
        assert (await b)[0] == 200
    # The second big prompt found the large-prompt queue full: character blocks instead.
    assert 'kvstrata_router_fallbacks_total{reason="large_prompt_busy"} 1.0' in await metrics(h)


async def test_work_pools_bound_the_large_queue() -> None:
    pools = WorkPools(threads=1, large_chars=100, large_queue=1)
    try:
        slow = asyncio.create_task(pools.run(1000, time.sleep, 0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(PoolBusy):
            await pools.run(1000, len, "x")
        assert await pools.run(10, len, "abc") == 3  # small work is not queued behind it
        await slow
        assert await pools.run(1000, len, "abcd") == 4  # room again once it ended
    finally:
        pools.shutdown()


async def test_large_prompt_work_runs_at_the_lowest_cpu_priority() -> None:
    """A huge prompt's tokenizing yields the CPU to everything else; short prompts' work does not. Not
    the idle class: there a thread holding the GIL waits for whole ticks."""
    pools = WorkPools(threads=1, large_chars=100, large_queue=1)

    def nice() -> tuple[int, int]:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0)

    normal = (0, os.SCHED_OTHER)
    try:
        assert await pools.run(1000, nice) == (19, os.SCHED_OTHER)
        assert await pools.run(10, nice) == normal
        bg = pools.submit_background(nice)
        assert bg is not None and await asyncio.wrap_future(bg) == normal
        assert nice() == normal  # the event loop's thread is left alone
    finally:
        pools.shutdown()


def _share_of_process_cpu_on_calling_thread(enc: PromptEncoder[Any], text: str) -> float:
    """The calling thread's CPU time over the process's while ``enc`` tokenizes all of ``text`` (new to
    it), called from a fresh thread."""
    share: list[float] = []

    def encode() -> None:
        process, thread = time.process_time(), time.thread_time()
        enc.encode(text)
        share.append((time.thread_time() - thread) / (time.process_time() - process))

    worker = threading.Thread(target=encode)
    worker.start()
    worker.join()
    return share[0]


def test_a_prompt_is_tokenized_on_the_thread_the_router_gave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's pieces are encoded on the pool thread the router chose (at the priority it gave it),
    not on threads of the tokenizer library's at normal priority. The router's (native) encoder calls
    the tokenizer there whatever the library's setting; the Python encoder does once the library's pool
    is off (with it on, the same call runs almost wholly elsewhere)."""
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    lt = LocalTokenizer(ensure_tiny_model(default_tiny_model_dir()))
    routers = lt.incremental(True, 16, "sha256")
    assert isinstance(routers, NativeIncrementalEncoder)
    python = IncrementalEncoder(lt.tokenizer, add_special_tokens=True, block_size=16, algo="sha256")
    words = " ".join(f"word{i % 97} and some more text number {i}" for i in range(8000))  # ~320K chars
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert _share_of_process_cpu_on_calling_thread(python, "library pool: " + words) < 0.5
    assert _share_of_process_cpu_on_calling_thread(routers, "library pool: " + words) > 0.8
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    tokenize_on_calling_threads()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert _share_of_process_cpu_on_calling_thread(python, "calling thread: " + words) > 0.8
    assert _share_of_process_cpu_on_calling_thread(routers, "calling thread: " + words) > 0.8


# --- surface ------------------------------------------------------------------------------------------
async def test_state_on_the_admin_port_only(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (ok,) = await fakes("ok")
    admin = free_port()
    h = await make_router([ok.url], adminPort=admin)
    async with h.client.get(h.base + "/kvstrata/state") as resp:
        assert resp.status == 404 and error_of(await resp.read())["code"] == "admin_only"
    async with h.client.get(f"http://127.0.0.1:{admin}/kvstrata/state") as resp:
        assert resp.status == 200 and ok.url in (await resp.json())["endpoints"]
    async with h.client.get(f"http://127.0.0.1:{admin}/metrics") as resp:
        assert resp.status == 200
    assert ok.bodies == []
