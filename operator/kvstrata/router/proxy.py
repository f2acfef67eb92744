"""HTTP in, HTTP out: the OpenAI endpoints, failover, and the router's own /health, /ready, /metrics.

Failover rules:
- connect error, timeout, dropped connection, or a 5xx *before anything was sent to the client* →
  the next-best endpoint (at most ``max_retries`` more); a non-streaming response is read whole
  before it is sent, so a failure while reading it is still "before the first byte";
- once a stream has started, never replay: the client gets an SSE error event and the stream ends;
- a client that disconnects cancels the handler (``handler_cancellation``), which closes the
  upstream connection, which makes vLLM abort the request.
The client's request bytes are forwarded as received (parsed once for routing, never re-serialised).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.router.core import Decision, NoEndpoints, Router
from kvstrata.router.pool import Endpoint, PrefillTicket
from kvstrata.router.reasons import Reason
from kvstrata.router.requests import BadRequest, Kind, parse_request

log = logging.getLogger("kvstrata.router.proxy")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)
SESSION_KEY: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The upstream session does not decompress, so content-encoding travels with the untouched body.
_RESP_DROP = _HOP_BY_HOP | {"date", "server"}


def json_error(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def _request_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}


def _response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _RESP_DROP}


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _cached_tokens(body: bytes) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, parsed only when the bytes mention it."""
    if b"cached_tokens" not in body:
        return None
    try:
        usage = json.loads(body).get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


class Proxy:
    def __init__(self, router: Router, session: aiohttp.ClientSession) -> None:
        self.router = router
        self.session = session
        s = router.settings
        self.timeout = aiohttp.ClientTimeout(
            total=s.upstream_timeout_seconds, sock_connect=s.connect_timeout_seconds
        )
        self.metrics = router.metrics
        self.block_size = s.block_size

    # --- OpenAI generation endpoints ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        raw = await request.read()
        try:
            parsed = parse_request(raw, kind, self.router.settings.model)
        except BadRequest as exc:
            self.metrics.bad_requests.labels(exc.code or exc.param or "invalid").inc()
            return web.json_response(exc.body(), status=exc.status)
        header = self.router.settings.session_header
        session_id = request.headers.get(header) if header else None
        try:
            decision = await self.router.decide(parsed, session_id)
        except NoEndpoints as exc:
            return json_error(503, str(exc), code="no_endpoints")
        return await self._forward(request, raw, decision, stream=parsed.stream)

    # --- everything else an engine serves --------------------------------------------------------
    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        eps = self.router.candidates()
        if not eps:
            return json_error(503, "no engine endpoints are known to the router", code="no_endpoints")
        raw = await request.read()
        order = sorted(eps, key=lambda ep: ep.load)
        return await self._forward(
            request, raw, Decision(order, Reason.PASSTHROUGH, routed=False), stream=False
        )

    async def _forward(
        self, request: web.Request, raw: bytes, decision: Decision, *, stream: bool
    ) -> web.StreamResponse:
        attempts = decision.order[: self.router.settings.max_retries + 1]
        headers = _request_headers(request)
        path = (
            request.rel_url.raw_path_qs if hasattr(request.rel_url, "raw_path_qs") else str(request.rel_url)
        )
        last_error = "no endpoint tried"
        for i, ep in enumerate(attempts):
            if i:
                self.metrics.retries.labels(last_error.split(":", 1)[0]).inc()
            is_last = i == len(attempts) - 1
            result = await self._attempt(request, raw, path, headers, decision, ep, stream, is_last)
            if isinstance(result, web.StreamResponse):
                return result
            last_error = result
        return json_error(
            502, f"all {len(attempts)} endpoint(s) failed; last error: {last_error}", code="upstream_failed"
        )

    def _decision_headers(self, decision: Decision, ep: Endpoint) -> dict[str, str]:
        return {
            "x-kvstrata-endpoint": ep.url,
            "x-kvstrata-predicted-cached-tokens": str(decision.predicted_cached_tokens(ep, self.block_size)),
            "x-kvstrata-reason": decision.reason,
        }

    async def _attempt(
        self,
        request: web.Request,
        raw: bytes,
        path: str,
        headers: dict[str, str],
        decision: Decision,
        ep: Endpoint,
        stream: bool,
        is_last: bool,
    ) -> web.StreamResponse | str:
        """The response on success, else a short error string (and the caller tries the next one)."""
        self.router.commit(decision, ep)
        ep.in_flight += 1
        prefill = PrefillTicket(ep, decision.uncached_tokens(ep, self.block_size))
        t0 = time.perf_counter()
        outcome = "error"
        try:
            try:
                resp = await self.session.request(
                    request.method, ep.url + path, data=raw or None, headers=headers, timeout=self.timeout
                )
            except aiohttp.ClientConnectorError as exc:
                self.router.mark_down(ep)
                outcome = "connect_error"
                return f"connect_error: {ep.url}: {exc}"
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                outcome = "timeout" if isinstance(exc, TimeoutError) else "disconnected"
                return f"{outcome}: {ep.url}: {exc!r}"
            try:
                if resp.status >= 500 and not is_last:
                    outcome = "upstream_5xx"
                    return f"upstream_5xx: {ep.url} answered {resp.status}"
                if stream and resp.status == 200:
                    outcome, streamed = await self._stream(request, resp, decision, ep, t0, prefill)
                    return streamed
                try:
                    body = await resp.read()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    outcome = "disconnected"
                    return f"disconnected: {ep.url} while reading the response: {exc!r}"
                except TimeoutError:
                    # The engine answered but took longer than the whole budget: no time left to retry.
                    outcome = "timeout"
                    return json_error(
                        504, f"{ep.url} did not finish within {self.timeout.total}s", code="upstream_timeout"
                    )
                out = web.Response(status=resp.status, body=body, headers=_response_headers(resp))
                out.headers.update(self._decision_headers(decision, ep))
                outcome = "ok" if resp.status < 400 else f"http_{resp.status // 100}xx"
                if decision.hashes:
                    self._observe_cached(decision, ep, body)
                return out
            finally:
                resp.release()
        except asyncio.CancelledError:
            outcome = "client_disconnect"
            raise
        finally:
            ep.in_flight -= 1
            self._prefill_over(prefill, decision, ep)
            done = outcome in ("ok", "stream_ok")
            self.metrics.request_done(ep.url, outcome, time.perf_counter() - t0 if done else None)

    async def _stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        decision: Decision,
        ep: Endpoint,
        t0: float,
        prefill: PrefillTicket,
    ) -> tuple[str, web.StreamResponse | str]:
        """Relay an SSE stream. Nothing is sent to the client until the engine's first body bytes
        arrive (engines send headers at once), so a failure before that is still retryable: then the
        result is an error string instead of a response."""
        try:
            first = await resp.content.readany()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            return "disconnected", f"disconnected: {ep.url} before the first streamed byte: {exc!r}"
        self._prefill_over(prefill, decision, ep)  # the first token is out
        self.metrics.ttft.labels(ep.url).observe(time.perf_counter() - t0)
        out = web.StreamResponse(status=resp.status, headers=_response_headers(resp))
        out.headers.update(self._decision_headers(decision, ep))
        if decision.hashes:
            self.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens(ep, self.block_size))
        try:
            await out.prepare(request)
            if first:
                await out.write(first)
        except ConnectionError:
            return "client_disconnect", out
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("stream from %s broke after it started; not replaying: %r", ep.url, exc)
            try:
                await out.write(_sse_error(f"upstream {ep.url} failed mid-stream: {exc!r}"))
                await out.write_eof()
            except (ConnectionError, RuntimeError):
                pass
            return "stream_aborted", out
        except ConnectionError:
            return "client_disconnect", out
        await out.write_eof()
        return "stream_ok", out

    def _prefill_over(self, prefill: PrefillTicket, decision: Decision, ep: Endpoint) -> None:
        if prefill.done():
            self.router.settle(decision, ep)

    def _observe_cached(self, decision: Decision, ep: Endpoint, body: bytes) -> None:
        self.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens(ep, self.block_size))
        actual = _cached_tokens(body)
        if actual is not None:
            self.metrics.actual_cached_tokens.inc(actual)
            self.metrics.actual_cached_reports.inc()

    # --- the router's own endpoints --------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        healthy = len(self.router.pool.healthy())
        body: dict[str, Any] = {"healthy_endpoints": healthy, "endpoints": len(self.router.pool)}
        if healthy:
            return web.json_response({"status": "ready", **body})
        return web.json_response(
            {"status": "not ready", "reason": "no healthy engine endpoint", **body}, status=503
        )

    async def state(self, request: web.Request) -> web.Response:
        """What the router believes about each endpoint: health, load, indexed blocks (for debugging)."""
        router = self.router
        now = time.monotonic()
        endpoints = {
            ep.url: {
                "healthy": ep.healthy,
                "inFlight": ep.in_flight,
                "pendingPrefillTokens": ep.pending_prefill,
                "recentRequests": round(router.recent_requests(ep, now), 3),
                "running": ep.running,
                "waiting": ep.waiting,
                "kvUsage": ep.kv_usage,
                "indexedBlocks": router.index.blocks_of(ep.url),
                "approxBlocks": router.approx.blocks_of(ep.url),
                "kvEvents": ep.spec.kv_events,
                "kvReplay": ep.spec.kv_replay,
                **ep.extra,
            }
            for ep in router.pool.all()
        }
        # Entries of endpoints no longer in the pool would be a leak; show them if there are any.
        stale = [u for u in router.index.endpoints() if u not in router.pool and router.index.blocks_of(u)]
        body = {
            "policy": router.settings.policy,
            "indexBlocks": len(router.index),
            "indexEvictions": router.index.evictions,
            "endpoints": endpoints,
            "staleIndexEndpoints": stale,
        }
        return web.json_response(body)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors raised outside the handlers' own checks (body too large, bad method, a bug) still reach
    the client in the OpenAI error shape, never as a traceback or an HTML page."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason or "request failed", code=f"http_{exc.status}")
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return json_error(500, "internal router error (logged)", code="router_error")


def build_app(router: Router, session: aiohttp.ClientSession) -> web.Application:
    proxy = Proxy(router, session)
    app = web.Application(client_max_size=64 * 1024**2, middlewares=[openai_errors])
    app[ROUTER_KEY] = router
    app[SESSION_KEY] = session
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    app.router.add_get("/metrics", proxy.metrics_handler)
    app.router.add_get("/kvstrata/state", proxy.state)
    app.router.add_route("*", "/{tail:.*}", proxy.passthrough)
    return app
