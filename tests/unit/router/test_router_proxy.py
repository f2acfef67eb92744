"""Failover rules and bad-request handling, through the real router app over loopback HTTP.

The upstreams are tiny in-process aiohttp fakes (only here, for failover; real engines are used in
tests/vllm/test_router_engines.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import kvstrata.router
from kvstrata.api.router_config import RouterSettings
from kvstrata.router.hashing import char_block_hashes
from kvstrata.router.loop import shares_lock
from kvstrata.router.service import RouterService
from kvstrata_dev.testing.engines import free_port

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


@dataclass
class Fake:
    """A fake engine: ``mode`` decides how it answers; it records what it received."""

    mode: str = "ok"
    bodies: list[bytes] = field(default_factory=list)
    cookies: list[str | None] = field(default_factory=list)  # each request's Cookie header
    cancelled: int = 0
    runner: web.AppRunner | None = None
    url: str = ""
    release: asyncio.Event = field(default_factory=asyncio.Event)  # mode "wait": answers once set
    # Mode "stream-gated": the i-th request's first token once firsts[i] is set, its end once ends[i] is.
    firsts: list[asyncio.Event] = field(default_factory=list)
    ends: list[asyncio.Event] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        self.cookies.append(request.headers.get("Cookie"))
        if request.path == "/tokenize" and self.mode == "tokenize":
            return web.json_response({"tokens": list(range(100)), "count": 100})
        if self.mode == "500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "stream-gated":
            first, end = asyncio.Event(), asyncio.Event()
            self.firsts.append(first)
            self.ends.append(end)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)  # vLLM sends its headers at once, the first token after the prefill
            await first.wait()
            await resp.write(b'data: {"choices":[{"text":"a"}]}\n\n')
            await end.wait()
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if self.mode == "drop" or (self.mode == "drop-once" and len(self.bodies) == 1):
            # close the connection before answering
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
            return web.Response()
        if self.mode in ("stream", "stream-die", "stream-slow", "stream-headers-die"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if self.mode == "stream-headers-die":  # like vLLM: headers at once, then the engine dies
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(b'data: {"choices":[{"text":"a"}]}\n\n')
            if self.mode == "stream-die":
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.mode == "stream-slow":
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if self.mode == "wait":
            await self.release.wait()
        if self.mode == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 7}}
        resp = web.json_response({"choices": [{"text": "hi"}], "usage": usage, "from": self.url})
        if self.mode == "cookie":
            resp.set_cookie("engine_session", "secret")
        return resp

    async def start(self, sock: socket.socket | None = None) -> Fake:
        """Serve on a free port, or on ``sock`` (a listening socket made earlier)."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        if sock is None:
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        else:
            port = sock.getsockname()[1]
            await web.SockSite(self.runner, sock).start()
        self.url = f"http://127.0.0.1:{port}"
        return self


@dataclass
class Harness:
    svc: RouterService
    base: str
    client: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.base + path, data=data, **kw) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    def prefer(self, url: str, prompt: str = PROMPT) -> None:
        """Make ``url`` the router's first choice for ``prompt`` (it 'holds' the prompt's prefix)."""
        router = self.svc.router
        assert router is not None
        router.approx.predict(url, char_block_hashes(prompt, router.chunk_chars), ttl=600)


RouterFactory = Callable[..., Any]


@pytest.fixture
async def make_router() -> AsyncIterator[RouterFactory]:
    started: list[tuple[RouterService, aiohttp.ClientSession]] = []

    async def make(urls: list[str], scrape: bool = False, **overrides: Any) -> Harness:
        settings = RouterSettings.model_validate(
            {
                "model": MODEL,
                "blockSize": 32,
                "remoteTokenize": False,
                "discovery": {"static": [{"url": u} for u in urls]},
                # The plane the test's loop serves (tests/unit/router/conftest.py).
                "dataPlane": "native" if shares_lock(asyncio.get_running_loop()) else "python",
                **overrides,
            }
        )
        svc = RouterService(settings, scrape=scrape)
        await svc.start()
        # Port 0: the router binds what the kernel gives it, so no other socket can take it first.
        await svc.serve("127.0.0.1", 0)
        port = svc.port
        client = aiohttp.ClientSession()
        started.append((svc, client))
        return Harness(svc, f"http://127.0.0.1:{port}", client)

    yield make
    for svc, client in started:
        await client.close()
        await svc.stop()


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    made: list[Fake] = []

    async def make(*modes: str) -> list[Fake]:
        out = [await Fake(mode).start() for mode in modes]
        made.extend(out)
        return out

    yield make
    for f in made:
        assert f.runner is not None
        await f.runner.cleanup()


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}


async def test_connect_error_goes_to_next_best(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (good,) = await fakes("ok")
    dead = f"http://127.0.0.1:{free_port()}"
    h = await make_router([dead, good.url])
    h.prefer(dead)
    status, headers, body = await h.post("/v1/completions", completion())
    assert status == 200
    assert headers["x-kvstrata-endpoint"] == good.url
    assert json.loads(body)["from"] == good.url
    # The original bytes reach the engine unchanged.
    assert good.bodies == [json.dumps(completion()).encode()]
    assert h.svc.router is not None
    dead_ep = h.svc.router.pool.get(dead)
    assert dead_ep is not None and not dead_ep.healthy
    assert h.svc.router.approx.blocks_of(dead) == 0  # a dead engine leaves the index at once
    metrics = await (await h.client.get(h.base + "/metrics")).text()
    assert 'kvstrata_router_retries_total{reason="connect_error"} 1.0' in metrics


async def test_an_engines_cookie_goes_to_its_client_only(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """The router passes Set-Cookie on to the client that got it and keeps no jar of its own: a kept
    cookie would go to the engine with every other client's requests."""
    (f,) = await fakes("cookie")
    # By name: aiohttp's default jar ignores cookies from IP addresses, not from names.
    h = await make_router([f.url.replace("127.0.0.1", "localhost")])
    _, headers, _ = await h.post("/v1/completions", completion())
    assert "engine_session=secret" in headers.get("Set-Cookie", "")
    h.client.cookie_jar.clear()  # the next request is another client's, which holds no cookie
    await h.post("/v1/completions", completion())
    assert f.cookies == [None, None]


async def test_5xx_before_first_byte_is_retried(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    bad, good = await fakes("500", "ok")
    h = await make_router([bad.url, good.url])
    h.prefer(bad.url)
    status, headers, _ = await h.post("/v1/completions", completion())
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)
    assert len(bad.bodies) == 1 and len(good.bodies) == 1


async def test_last_5xx_is_forwarded_when_every_endpoint_fails(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    a, b = await fakes("500", "500")
    h = await make_router([a.url, b.url])
    status, _, body = await h.post("/v1/completions", completion())
    assert status == 500 and json.loads(body) == {"error": "boom"}
    assert len(a.bodies) + len(b.bodies) == 2


async def test_dropped_connection_before_response_is_retried(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    drop, good = await fakes("drop", "ok")
    h = await make_router([drop.url, good.url])
    h.prefer(drop.url)
    status, headers, _ = await h.post("/v1/completions", completion())
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)


async def test_retries_are_bounded(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    drops = await fakes("drop", "drop", "drop")
    h = await make_router([f.url for f in drops], maxRetries=1)
    status, _, body = await h.post("/v1/completions", completion())
    assert status == 502
    err = json.loads(body)["error"]
    assert err["code"] == "upstream_failed" and err["message"].startswith("2 tries on 2 endpoint(s) failed")
    assert sorted(len(f.bodies) for f in drops) == [0, 1, 1]  # the third engine never had it


async def test_refused_connections_are_not_counted_as_tries(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """The engine never had the request: with no retries allowed, a refused connection still moves it on."""
    (good,) = await fakes("ok")
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    h = await make_router([*dead, good.url], maxRetries=0)
    h.prefer(dead[0])
    status, headers, _ = await h.post("/v1/completions", completion())
    assert (status, headers["x-kvstrata-endpoint"]) == (200, good.url)
    assert int(headers["x-kvstrata-attempts"]) >= 2
    # Every engine refusing: each is tried once (a refusal marks it down), then a 502 at once.
    h2 = await make_router(dead, maxRetries=0)
    status, _, body = await h2.post("/v1/completions", completion())
    err = json.loads(body)["error"]
    assert status == 502 and err["message"].startswith("2 tries on 2 endpoint(s) failed"), err


async def test_every_engine_tried_with_tries_left_gets_another_round(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """The only engine dropped the request before answering: it is sent there again (one of its
    maxRetries), not answered 502."""
    (once,) = await fakes("drop-once")
    h = await make_router([once.url], maxRetries=1)
    status, headers, _ = await h.post("/v1/completions", completion())
    assert (status, headers["x-kvstrata-endpoint"], headers["x-kvstrata-attempts"]) == (200, once.url, "2")
    assert len(once.bodies) == 2
    # With no retries allowed it is not.
    (again,) = await fakes("drop-once")
    h0 = await make_router([again.url], maxRetries=0)
    status, _, body = await h0.post("/v1/completions", completion())
    assert status == 502 and json.loads(body)["error"]["message"].startswith("1 try on 1 endpoint(s) failed")
    assert len(again.bodies) == 1


async def test_connect_timeouts_everywhere_get_another_round(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """One engine dead, the other's accept queue full (its connect times out, as a swamped engine's
    does): the request is not answered 502 with that engine still in rotation; it gets another round
    and is served once the engine accepts again."""
    dead = f"http://127.0.0.1:{free_port()}"
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    filler = socket.create_connection(full.getsockname())  # the queue holds one: the next SYN is dropped
    full_url = f"http://127.0.0.1:{full.getsockname()[1]}"
    h = await make_router([dead, full_url], connectTimeoutSeconds=0.2, ejectionConsecutiveFailures=100)
    router = h.svc.router
    assert router is not None
    h.prefer(dead)
    sent = asyncio.create_task(h.post("/v1/completions", completion()))
    ep = router.pool.get(full_url)
    assert ep is not None
    while router.outlier.state(ep).consecutive < 1:  # its connect timed out once
        await asyncio.sleep(0.01)
    server = Fake("ok")
    await server.start(full)
    try:
        filler.close()
        status, headers, _ = await asyncio.wait_for(sent, 30)
        assert (status, headers["x-kvstrata-endpoint"]) == (200, full_url)
        assert int(headers["x-kvstrata-attempts"]) >= 3  # dead, full (timed out), full again
        assert len(server.bodies) == 1
    finally:
        assert server.runner is not None
        await server.runner.cleanup()


async def test_stream_that_started_is_never_replayed(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    dying, other = await fakes("stream-die", "stream")
    h = await make_router([dying.url, other.url])
    h.prefer(dying.url)
    status, headers, body = await h.post("/v1/completions", completion(stream=True))
    assert status == 200 and headers["x-kvstrata-endpoint"] == dying.url
    events = [line for line in body.decode().split("\n\n") if line]
    assert events[0] == 'data: {"choices":[{"text":"a"}]}'
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_failed"
    assert other.bodies == []  # not replayed elsewhere


async def test_stream_dying_before_its_first_byte_is_retried(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    dying, other = await fakes("stream-headers-die", "stream")
    h = await make_router([dying.url, other.url])
    h.prefer(dying.url)
    status, headers, body = await h.post("/v1/completions", completion(stream=True))
    assert (status, headers["x-kvstrata-endpoint"]) == (200, other.url)
    assert body.endswith(b"data: [DONE]\n\n") and b"error" not in body
    assert len(dying.bodies) == 1


async def test_stream_passes_through(make_router: RouterFactory, fakes: Callable[..., Any]) -> None:
    (s,) = await fakes("stream")
    h = await make_router([s.url])
    status, headers, body = await h.post("/v1/completions", completion(stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("mode,stream", [("slow", False), ("stream-slow", True)])
async def test_client_disconnect_cancels_upstream(
    make_router: RouterFactory, fakes: Callable[..., Any], mode: str, stream: bool
) -> None:
    (slow,) = await fakes(mode)
    h = await make_router([slow.url])
    with pytest.raises(asyncio.TimeoutError):
        await h.post("/v1/completions", completion(stream=stream), timeout=aiohttp.ClientTimeout(total=0.5))
    for _ in range(50):
        if slow.cancelled:
            break
        await asyncio.sleep(0.05)
    assert slow.cancelled == 1
    assert h.svc.router is not None
    assert sum(ep.in_flight for ep in h.svc.router.pool.all()) == 0


async def test_pending_prefill_lasts_until_the_first_token(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """The prefill scorer's queue: counted from send to the first streamed byte, not for the whole stream."""
    slow, streaming = await fakes("slow", "stream-slow")

    async def settled(e: Any, in_flight: int) -> None:
        for _ in range(100):
            if e.in_flight == in_flight:
                return
            await asyncio.sleep(0.02)

    # Before any answer: the prompt's uncached tokens are queued there (character-block fallback here:
    # each 128-character block stands in for 32 tokens).
    h = await make_router([slow.url])
    assert h.svc.router is not None
    (e,) = h.svc.router.pool.all()
    waiting = asyncio.create_task(
        h.post("/v1/completions", completion(), timeout=aiohttp.ClientTimeout(total=1))
    )
    await settled(e, 1)
    assert (e.in_flight, e.pending_prefill) == (1, len(PROMPT) // 128 * 32)
    with pytest.raises(asyncio.TimeoutError):
        await waiting
    await settled(e, 0)
    assert (e.in_flight, e.pending_prefill) == (0, 0)

    # Streaming: released at the first event while the stream goes on.
    h = await make_router([streaming.url])
    assert h.svc.router is not None
    (e,) = h.svc.router.pool.all()
    async with h.client.post(h.base + "/v1/completions", json=completion(stream=True)) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        assert (e.in_flight, e.pending_prefill) == (1, 0)
    await settled(e, 0)
    assert (e.in_flight, e.pending_prefill) == (0, 0)


@pytest.mark.parametrize(
    "path,body,status,param,message",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"", 400, None, "empty"),
        ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
        ("/v1/completions", {"prompt": "x"}, 400, "model", "'model' is required"),
        ("/v1/completions", {"model": 3, "prompt": "x"}, 400, "model", "must be a string"),
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt", "'prompt' is required"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "must be a string"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", "must be a string"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "'messages' is required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "non-empty"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages", "'role'"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 1}]},
            400,
            "messages",
            "content",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    make_router: RouterFactory,
    fakes: Callable[..., Any],
    path: str,
    body: Any,
    status: int,
    param: str | None,
    message: str,
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url])
    got, headers, raw = await h.post(path, body)
    assert got == status
    assert headers["Content-Type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and message in err["message"]
    assert ok.bodies == []  # never forwarded


async def test_no_endpoints_is_503_and_not_ready(make_router: RouterFactory) -> None:
    h = await make_router([])
    status, _, raw = await h.post("/v1/completions", completion())
    assert status == 503 and json.loads(raw)["error"]["code"] == "no_endpoints"
    async with h.client.get(h.base + "/ready") as resp:
        assert resp.status == 503 and (await resp.json())["reason"] == "no healthy engine endpoint"
    async with h.client.get(h.base + "/health") as resp:
        assert resp.status == 200


async def test_decision_headers_metrics_and_passthrough(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    a, b = await fakes("ok", "ok")
    h = await make_router([a.url, b.url])
    status, headers, _ = await h.post("/v1/completions", completion())
    first = headers["x-kvstrata-endpoint"]
    assert status == 200 and headers["x-kvstrata-reason"] == "tie-hash"
    # The same prompt again goes where the first one went (the router remembers its route).
    _, headers2, _ = await h.post("/v1/completions", completion())
    assert headers2["x-kvstrata-endpoint"] == first
    assert headers2["x-kvstrata-reason"] == "approx-prefix"
    assert headers2["x-kvstrata-predicted-cached-tokens"] == "0"  # approximate: no token count
    status, _, raw = await h.post("/tokenize", {"model": MODEL, "prompt": "x"})
    assert status == 200 and b"choices" in raw
    async with h.client.get(h.base + "/v1/models") as resp:
        assert resp.status == 200
    async with h.client.get(h.base + "/ready") as resp:
        assert resp.status == 200
    metrics = await (await h.client.get(h.base + "/metrics")).text()
    assert 'kvstrata_router_fallbacks_total{reason="no_tokenizer"} 2.0' in metrics
    assert 'kvstrata_router_decisions_total{reason="approx-prefix"} 1.0' in metrics
    assert "kvstrata_router_affinity_share 0.5" in metrics
    assert "kvstrata_router_actual_cached_tokens_total 14.0" in metrics
    async with h.client.get(h.base + "/kvstrata/state") as resp:
        state = (await resp.json())["endpoints"]
    # Both routed requests went to `first` (seconds ago): they count as recent traffic there only.
    assert 1.9 < state[first]["recentRequests"] <= 2.0
    assert state[b.url if first == a.url else a.url]["recentRequests"] == 0.0


async def test_remote_tokenize_gives_engine_hashes(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (eng,) = await fakes("tokenize")
    h = await make_router([eng.url], remoteTokenize=True)
    await h.post("/v1/completions", completion())
    status, headers, _ = await h.post("/v1/completions", completion())
    assert status == 200 and headers["x-kvstrata-reason"] == "prefix"
    assert headers["x-kvstrata-predicted-cached-tokens"] == "96"  # 3 full blocks of the 100 tokens
    assert b'"prompt"' in eng.bodies[0] and len(eng.bodies) == 4  # tokenize, complete, tokenize, complete


async def test_engine_without_tokenize_falls_back_once_then_stops_asking(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (eng,) = await fakes("ok")  # answers /tokenize with JSON that has no tokens
    h = await make_router([eng.url], remoteTokenize=True)
    for _ in range(3):
        status, _, _ = await h.post("/v1/completions", completion())
        assert status == 200
    assert len(eng.bodies) == 4  # one /tokenize, three completions
    metrics = await (await h.client.get(h.base + "/metrics")).text()
    assert 'kvstrata_router_fallbacks_total{reason="remote_tokenize_failed"} 1.0' in metrics
    assert 'kvstrata_router_fallbacks_total{reason="remote_tokenize_unavailable"} 2.0' in metrics


async def test_oversized_body_gets_an_openai_error(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (ok,) = await fakes("ok")
    h = await make_router([ok.url])
    status, headers, raw = await h.post("/v1/completions", b"x" * (64 * 1024**2 + 1))
    assert status == 413 and headers["Content-Type"].startswith("application/json")
    assert json.loads(raw)["error"]["code"] == "body_too_large"


async def _one_running_one_held(h: Harness) -> tuple[Any, Any, asyncio.Future[Any], asyncio.Future[Any]]:
    """Two 9-block requests to the one engine of a 10-block pool: the first runs, the second is held."""
    router = h.svc.router
    assert router is not None
    (ep,) = router.pool.all()
    ep.kv_blocks = 10  # as a scrape of vllm:cache_config_info would set it
    ids = [{"prompt": list(range(i * 1000, i * 1000 + 8 * 32)), "max_tokens": 4} for i in range(2)]
    first = asyncio.ensure_future(h.post("/v1/completions", completion(**ids[0])))
    await asyncio.sleep(0.2)
    second = asyncio.ensure_future(h.post("/v1/completions", completion(**ids[1])))
    await asyncio.sleep(0.2)
    return router, ep, first, second


async def test_a_request_without_kv_room_is_held_then_sent_with_its_claim_given_back(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (a,) = await fakes("wait")
    h = await make_router([a.url])
    router, ep, first, second = await _one_running_one_held(h)
    assert len(a.bodies) == 1 and router.gate.held() == 1  # 9 + 9 blocks do not fit in 10
    a.release.set()
    (s1, h1, _), (s2, h2, _) = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert (s1, h1["x-kvstrata-admission"]) == (200, "direct")
    assert (s2, h2["x-kvstrata-admission"]) == (200, "queued") and int(h2["x-kvstrata-held-ms"]) >= 150
    assert router.gate.in_flight_blocks(ep) == 0 and router.gate.held() == 0
    metrics = await (await h.client.get(h.base + "/metrics")).text()
    assert 'kvstrata_router_admissions_total{how="queued"} 1.0' in metrics


async def test_with_prefills_in_turn_the_next_prefill_starts_when_the_first_token_streams(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    """prefillInTurn through the router, either plane: a second streamed request of as many tokens
    reaches the engine when the first one's first token has streamed, while the first still runs."""
    (a,) = await fakes("stream-gated")
    h = await make_router([a.url], admission={"prefillInTurn": True})
    router = h.svc.router
    assert router is not None
    (ep,) = router.pool.all()
    ep.kv_blocks = 100  # room for both: only the turn holds the second
    ids = [list(range(i * 1000, i * 1000 + 8 * 32)) for i in range(2)]
    posts = [
        asyncio.ensure_future(h.post("/v1/completions", completion(prompt=p, max_tokens=4, stream=True)))
        for p in ids
    ]
    for _ in range(50):
        if router.gate.held() == 1:
            break
        await asyncio.sleep(0.02)
    assert len(a.bodies) == 1 and router.gate.held() == 1
    async with h.client.get(h.base + "/kvstrata/state") as resp:
        state = await resp.json()
    assert state["endpoints"][a.url]["prefillInTurnTokens"] == 8 * 32 and state["heldRequests"] == 1
    a.firsts[0].set()  # the first request's first token
    for _ in range(100):
        if len(a.bodies) == 2:
            break
        await asyncio.sleep(0.02)
    assert len(a.bodies) == 2 and router.gate.held() == 0 and not posts[0].done()
    for events in (a.firsts, a.ends):
        for e in events:
            e.set()
    (s1, h1, _), (s2, h2, _) = await asyncio.wait_for(asyncio.gather(*posts), 5)
    assert (s1, h1["x-kvstrata-admission"]) == (200, "direct")
    assert (s2, h2["x-kvstrata-admission"]) == (200, "queued")
    assert router.gate.in_flight_blocks(ep) == 0 and router.gate.held() == 0


async def test_a_client_that_leaves_while_held_gives_its_place_back(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    (a,) = await fakes("wait")
    h = await make_router([a.url])
    router, ep, first, second = await _one_running_one_held(h)
    assert router.gate.held() == 1
    second.cancel()  # the client goes away while its request is held
    for _ in range(50):
        if router.gate.held() == 0:
            break
        await asyncio.sleep(0.02)
    assert router.gate.held() == 0
    a.release.set()
    status, _, _ = await asyncio.wait_for(first, 5)
    await asyncio.sleep(0.2)
    assert status == 200 and len(a.bodies) == 1  # the left request never reached the engine
    assert router.gate.in_flight_blocks(ep) == 0 and ep.in_flight == 0


async def test_the_state_says_which_plane_made_each_try(
    make_router: RouterFactory, fakes: Callable[..., Any]
) -> None:
    bad, good = await fakes("500", "ok")
    h = await make_router([bad.url, good.url], maxRetries=1)
    h.prefer(good.url, "to the good one " * 8)
    status, headers, _ = await h.post("/v1/completions", completion(prompt="to the good one " * 8))
    assert (status, headers["x-kvstrata-endpoint"], headers["x-kvstrata-attempts"]) == (200, good.url, "1")
    h.prefer(bad.url, "to the bad one " * 8)
    status, headers, _ = await h.post("/v1/completions", completion(prompt="to the bad one " * 8))
    # The bad engine's 5xx is retried on the good one: by Python, after a native first try.
    assert (status, headers["x-kvstrata-endpoint"], headers["x-kvstrata-attempts"]) == (200, good.url, "2")
    assert len(bad.bodies) == 1
    async with h.client.get(h.base + "/kvstrata/state") as resp:
        plane = (await resp.json())["dataPlane"]
    assert plane.pop("compiled") == kvstrata.router.COMPILED.as_json()
    if h.svc.settings.data_plane == "native":
        assert plane == {"plane": "native", "nativeTries": 2, "resumedInPython": 1, "ranking": "native"}
    else:
        assert plane == {"plane": "python", "nativeTries": 0, "resumedInPython": 0, "ranking": "native"}
