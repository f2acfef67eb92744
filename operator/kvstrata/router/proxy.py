"""HTTP in, HTTP out: the OpenAI endpoints, failover, and the router's own /health, /ready, /metrics.

Deadlines (see docs/router.md, "Timeouts and ejection"):
- connect: ``connectTimeoutSeconds``;
- streamed requests: the engine's first streamed byte within ``firstByteTimeoutSeconds``, then at
  most ``streamIdleTimeoutSeconds`` between chunks, however long the stream lasts;
- non-streamed requests: the whole answer within ``upstreamTimeoutSeconds`` (engines send nothing
  before the end), read into memory up to ``maxResponseBytes``.
A wait for the first byte also ends when its endpoint is ejected (another request's failures, or
failed scrapes, showed it wedged): the request is retried elsewhere. A stream's last try, or a try
after which only ejected or silent engines are left, is patient (router/patience.py): past the
first-byte timeout it keeps waiting while its engine is heard from (scrapes answered, streams moving).

Failover rules:
- a failure *before anything was sent to the client* (connect error or timeout, first-byte timeout,
  dropped connection, 5xx, ejection) → the next-best endpoint (at most ``max_retries`` more); a
  non-streaming response is read whole before it is sent, so a failure while reading it is still
  "before the first byte";
- a try that never reached its engine (connect refused or timed out) is not counted; when every
  endpoint was tried and tries are left, those in rotation and not known down get another round after
  a back-off, within ``upstreamTimeoutSeconds``;
- once a stream has started, never replay: the client gets an SSE error event and the stream ends;
- a client that disconnects cancels the handler (``handler_cancellation``), which closes the
  upstream connection, which makes vLLM abort the request.
Every engine fault feeds outlier ejection (router/outlier.py); a client's going away does not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.router import COMPILED
from kvstrata.router.admission import Claim, Grant
from kvstrata.router.bodies import body_timeout, read_body
from kvstrata.router.core import Decision, NoEndpoints, Router
from kvstrata.router.errors import json_error, openai_errors, sse_error
from kvstrata.router.outcomes import (
    ENGINE_FAULTS,
    UNSENT,
    Answered,
    AttemptResult,
    Failed,
    FailureKind,
    Outcome,
)
from kvstrata.router.outlier import AllEjected
from kvstrata.router.patience import last_try_patience
from kvstrata.router.pool import Endpoint, PrefillTicket
from kvstrata.router.reasons import Reason
from kvstrata.router.requests import BadRequest, Kind, parse_request
from kvstrata.router.scoring import NativePick
from kvstrata.router.upstream import ConnectFailed, ConnectTimedOut, Disconnected, Response, Upstream

log = logging.getLogger("kvstrata.router.proxy")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)

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
# The native front's token for a request whose tries Python goes on with (router/native_http.py).
RESUME_HEADER = "x-kvstrata-resume"
# The router reads response bodies (usage, SSE), so it asks engines for none it would have to decode.
_REQ_DROP = _HOP_BY_HOP | {"accept-encoding", RESUME_HEADER}
# The upstream client does not decompress, so content-encoding travels with the untouched body.
_RESP_DROP = _HOP_BY_HOP | {"date", "server"}
_RETRYABLE_STATUS = 500
# Between rounds over the engines once every one was tried: Envoy's retry back-off (25 ms base), doubled
# per round up to a second.
_ROUND_BACKOFF_S = 0.025
_ROUND_BACKOFF_MAX_S = 1.0
# Bodies up to this size are parsed on the event loop (msgspec: about 1 ms per MB, and it holds the GIL
# in a thread just the same); larger ones in a thread, so that checking a million token ids or sizing a
# long conversation (Python loops, which yield the GIL) does not hold other requests up.
_PARSE_INLINE_BYTES = 1 << 20


def _request_headers(request: web.Request, decoded: bool) -> dict[str, str]:
    out = {k: v for k, v in request.headers.items() if k.lower() not in _REQ_DROP}
    if decoded:  # the body travels decoded: its old encoding no longer applies
        out = {k: v for k, v in out.items() if k.lower() != "content-encoding"}
    out["Accept-Encoding"] = "identity"
    return out


def _response_headers(resp: Response) -> list[tuple[str, str]]:
    return [(k, v) for k, v in resp.headers if k.lower() not in _RESP_DROP]


def _cached_tokens(body: bytes) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, parsed only when the bytes mention it."""
    if b"cached_tokens" not in body:
        return None
    try:
        usage = json.loads(body).get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, int) else None


class _TooLarge(Exception):
    pass


@dataclass(slots=True)
class _Call:
    """One client request on its way to the engines, the same for every try."""

    request: web.Request | None  # None while the native front carries it
    raw: bytes
    path: str
    headers: dict[str, str]
    decision: Decision
    stream: bool
    grant: Grant
    claim: Claim | None = None  # the admission's claim, until the first try takes it over
    tries: int = 0  # sent so far (x-kvstrata-attempts, as Envoy's x-envoy-attempt-count)


@dataclass(slots=True)
class _TryState:
    """Where a request's tries stand, so that Python can go on after a try the native front made."""

    left: list[Endpoint]  # in the order they would be tried
    give_up: float  # monotonic: no new round of tries after this
    tried: set[str] = field(default_factory=set)
    last: Failed | None = None
    sent: int = 0  # tries the engines received (UNSENT ones are free)
    rounds: int = 0


@dataclass(slots=True)
class _Try:
    """One try on its way: what its end gives back."""

    ep: Endpoint
    claim: Claim | None
    prefill: PrefillTicket
    t0: float


@dataclass(slots=True)
class NativeTry:
    """A first try the native front makes, as Python's bookkeeping sees it."""

    call: _Call
    state: _TryState
    attempt: _Try


class Go(NamedTuple):
    """The native front makes the first try on ``url`` (``handle`` names it when it reports back)."""

    tag: str
    handle: NativeTry
    url: str
    stream: bool
    last: bool  # a 5xx answer is forwarded, not retried
    headers: list[tuple[str, str]]  # the decision's, but for the attempt count and upstream time


class Answer(NamedTuple):
    """The native front answers the client with this."""

    tag: str
    status: int
    body: bytes
    headers: list[tuple[str, str]]


class Resume(NamedTuple):
    """The native front hands the request to the Python app with this token: Python goes on with it."""

    tag: str
    token: str


Plan = Go | Answer | Resume


def answer(resp: web.Response) -> Answer:
    body = resp.body
    assert isinstance(body, bytes)
    headers = [(k, v) for k, v in resp.headers.items() if k.lower() != "content-length"]
    return Answer("answer", resp.status, body, headers)


class Proxy:
    def __init__(self, router: Router, upstream: Upstream) -> None:
        self.router = router
        # Its connect timeout is connectTimeoutSeconds; the other deadlines are ours (asyncio.timeout),
        # per phase; see the module doc.
        self.upstream = upstream
        s = self.settings = router.settings
        self.metrics = router.metrics
        self.outlier = router.outlier
        self.block_size = s.block_size
        # Requests the native front began and Python goes on with, by token (router/native_http.py).
        self.resumable: dict[str, tuple[_Call, _TryState]] = {}
        self.native_tries = 0  # first tries the native front made
        self.resumed = 0  # requests it began that Python went on with (a failed or patient first try)

    # --- OpenAI generation endpoints ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _read(self, request: web.Request) -> tuple[bytes, bool]:
        s = self.settings
        return await read_body(request, limit=s.max_body_bytes, timeout=s.body_read_timeout_seconds)

    def _refuse(self, exc: BadRequest) -> web.Response:
        self.metrics.bad_requests.labels(exc.code or exc.param or "invalid").inc()
        return web.json_response(exc.body(), status=exc.status)

    def _no_endpoints(self, exc: NoEndpoints | AllEjected) -> web.Response:
        if isinstance(exc, AllEjected):
            retry = max(int(exc.retry_after + 0.999), 1)
            return json_error(
                503, str(exc), code="all_endpoints_ejected", headers={"Retry-After": str(retry)}
            )
        return json_error(503, str(exc), code="no_endpoints")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        token = request.headers.get(RESUME_HEADER)
        if token is not None and (began := self.resumable.pop(token, None)) is not None:
            self.resumed += 1
            return await self._resume(request, *began)
        try:
            raw, decoded = await self._read(request)
            args = (raw, kind, self.settings.model, self.settings.max_prompt_chars)
            if len(raw) <= _PARSE_INLINE_BYTES:
                parsed = parse_request(*args)
            else:
                parsed = await asyncio.get_running_loop().run_in_executor(None, parse_request, *args)
        except BadRequest as exc:
            return self._refuse(exc)
        header = self.settings.session_header
        session_id = request.headers.get(header) if header else None
        try:
            decision = await self.router.decide(parsed, session_id)
        except (NoEndpoints, AllEjected) as unavailable:
            return self._no_endpoints(unavailable)
        return await self._forward(
            request, raw, decoded, decision, stream=parsed.stream, output_tokens=parsed.output_tokens()
        )

    # --- everything else an engine serves --------------------------------------------------------
    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        try:
            eps = self.router.candidates()
        except AllEjected as unavailable:
            return self._no_endpoints(unavailable)
        if not eps:
            return json_error(503, "no engine endpoints are known to the router", code="no_endpoints")
        try:
            raw, decoded = await self._read(request)
        except BadRequest as exc:
            return self._refuse(exc)
        order = sorted(eps, key=lambda ep: ep.load)
        return await self._forward(
            request, raw, decoded, Decision(order, Reason.PASSTHROUGH, routed=False), stream=False
        )

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        decoded: bool,
        decision: Decision,
        *,
        stream: bool,
        output_tokens: int | None = None,
    ) -> web.StreamResponse:
        gate = self.router.gate
        grant = await self._admit(decision, output_tokens)
        call = _Call(
            request,
            raw,
            request.rel_url.raw_path_qs,
            _request_headers(request, decoded),
            decision,
            stream,
            grant,
            grant.claim,
        )
        try:
            return await self._tries(call, self._try_state(call))
        finally:
            gate.release(call.claim)  # only if no try took it (a failure before the first)

    async def _admit(self, decision: Decision, output_tokens: int | None) -> Grant:
        """The gate's grant for the first try, counted (both planes)."""
        grant = await self.router.gate.admit(decision, output_tokens)
        if decision.routed:
            self.metrics.admitted(grant.how, grant.held_s)
        return grant

    async def _resume(self, request: web.Request, call: _Call, state: _TryState) -> web.StreamResponse:
        """Go on with a request the native front began (router/native_http.py)."""
        call.request = request
        call.headers = _request_headers(request, decoded=False)
        try:
            return await self._tries(call, state)
        finally:
            self.router.gate.release(call.claim)

    def _try_state(self, call: _Call) -> _TryState:
        first = call.grant.endpoint
        return _TryState(
            [first, *(ep for ep in call.decision.order if ep is not first)],
            time.monotonic() + self.settings.upstream_timeout_seconds,
        )

    async def _tries(self, call: _Call, st: _TryState) -> web.StreamResponse:
        decision = call.decision
        while st.sent < self._budget:
            if st.last is not None:
                st.left = self.router.retry_order(decision, st.left)
                if not st.left:  # every engine was tried, and tries are left: those still usable again
                    st.rounds += 1
                    st.left = await self._another_round(decision, st.rounds, st.give_up)
                if not st.left:
                    break
                self.metrics.retries.labels(st.last.kind.value).inc()
            ep, is_last, patient = self._next_try(call, st)
            result = await self._attempt(call, ep, is_last, patient)
            if isinstance(result, Answered):
                return result.response
            self._try_failed(call, st, ep, result)
        assert st.last is not None  # a decision names at least one endpoint, and one try is always made
        return json_error(
            502,
            f"{call.tries} {'try' if call.tries == 1 else 'tries'} on {len(st.tried)} endpoint(s) failed; "
            f"last error: {st.last.kind}: {st.last.detail}",
            code="upstream_failed",
        )

    @property
    def _budget(self) -> int:
        """Tries the engines may receive; UNSENT ones are free."""
        return self.settings.max_retries + 1

    def _next_try(self, call: _Call, st: _TryState) -> tuple[Endpoint, bool, bool]:
        """The endpoint of the next try, whether it is the last, and whether it is patient."""
        ep = st.left.pop(0)
        # Last: no try left, or no endpoint left in rotation to retry on.
        is_last = st.sent + 1 == self._budget or all(self.outlier.ejected(later) for later in st.left)
        # A stream waits past its first-byte timeout when moving on could only reach engines that are
        # out or silent (wedged but not yet ejected): patience.py.
        patient = call.stream and (is_last or not self._any_live(st.left))
        return ep, is_last, patient

    def _try_failed(self, call: _Call, st: _TryState, ep: Endpoint, result: Failed) -> None:
        st.tried.add(ep.url)
        st.last = result
        if result.kind not in UNSENT:
            st.sent += 1
        log.info("try %d on %s failed: %s: %s", call.tries, ep.url, result.kind, result.detail)

    async def _another_round(self, decision: Decision, round_no: int, give_up: float) -> list[Endpoint]:
        """The endpoints to try again once every one was tried and tries are left (connect failures
        cost none): those in rotation and not known down (a refused connection marks an engine down;
        a connect timeout does not: its accept queue was full, or this router was stalled on a loaded
        machine), after a back-off.

        Seen in CI: one engine killed, one ejected, and three accepted requests got a 502 with the
        third engine live and in rotation."""
        pause = min(_ROUND_BACKOFF_S * 2 ** (round_no - 1), _ROUND_BACKOFF_MAX_S)
        if time.monotonic() + pause >= give_up:
            return []
        await asyncio.sleep(pause)
        try:
            eps = self.router.candidates()
        except AllEjected:
            return []
        return self.router.retry_order(decision, [ep for ep in eps if ep.healthy])

    def _decision_headers(self, call: _Call, ep: Endpoint, t0: float) -> dict[str, str]:
        """The decision and its cost: tries, and the answering engine's time to the first byte
        (Envoy's x-envoy-upstream-service-time), so a client can tell queueing upstream from failover."""
        headers = {
            "x-kvstrata-attempts": str(call.tries),
            "x-kvstrata-upstream-ms": str(round((time.perf_counter() - t0) * 1000)),
        }
        headers.update(self._decision_only_headers(call, ep))
        return headers

    def _decision_only_headers(self, call: _Call, ep: Endpoint) -> list[tuple[str, str]]:
        """:meth:`_decision_headers` but for the try's count and time (the native front says those)."""
        decision = call.decision
        return [
            ("x-kvstrata-endpoint", ep.url),
            (
                "x-kvstrata-predicted-cached-tokens",
                str(decision.predicted_cached_tokens(ep, self.block_size)),
            ),
            ("x-kvstrata-reason", decision.reason),
            ("x-kvstrata-admission", call.grant.how),
            ("x-kvstrata-held-ms", str(round(call.grant.held_s * 1000))),
        ]

    def _any_live(self, eps: list[Endpoint]) -> bool:
        """Whether any of ``eps`` is in rotation and not silent (Router.heard)."""
        now = time.monotonic()
        return any(self.router.heard(ep, now) and not self.outlier.ejected(ep) for ep in eps)

    async def _attempt(self, call: _Call, ep: Endpoint, is_last: bool, patient: bool) -> AttemptResult:
        """One try on ``ep``: :class:`Answered` (the client has its response) or :class:`Failed`
        (nothing was sent; the caller may try the next endpoint)."""
        t = self._start_try(call, ep)
        outcome = Outcome.DISCONNECTED
        try:
            result, outcome = await self._exchange(call, ep, is_last, patient, t.t0, t.prefill)
            return result
        except asyncio.CancelledError:
            outcome = Outcome.CLIENT_DISCONNECT
            raise
        finally:
            self._end_try(call, t, outcome)

    def _start_try(self, call: _Call, ep: Endpoint) -> _Try:
        decision = call.decision
        call.tries += 1
        if decision.committed is not ep:
            self.router.commit(decision, ep)
        claim, call.claim = call.claim, None
        if claim is None or claim.endpoint is not ep:
            self.router.gate.release(claim)
            claim = self.router.gate.claim(ep, decision, call.grant.output)
        ep.in_flight += 1
        # The gate hears when the prefill ends only where it takes prefills in turn (prefillInTurn).
        on_done = (
            partial(self.router.gate.prefilled, claim) if claim is not None and claim.prefill >= 0 else None
        )
        prefill = PrefillTicket(ep, decision.uncached_tokens(ep, self.block_size), on_done)
        return _Try(ep, claim, prefill, time.perf_counter())

    def _end_try(self, call: _Call, t: _Try, outcome: Outcome) -> None:
        ep = t.ep
        ep.in_flight -= 1
        done = outcome in (Outcome.OK, Outcome.STREAM_OK)
        self.router.gate.release(t.claim, ended=done)
        self._prefill_over(t.prefill, call.decision, ep)
        self.metrics.request_done(ep.url, outcome, time.perf_counter() - t.t0 if done else None)
        fault = ENGINE_FAULTS.get(outcome)
        if fault is not None:
            self.outlier.failure(ep, fault)
        elif outcome is not Outcome.CLIENT_DISCONNECT and outcome is not Outcome.EJECTED:
            self.outlier.success(ep)

    async def _exchange(
        self, call: _Call, ep: Endpoint, is_last: bool, patient: bool, t0: float, prefill: PrefillTicket
    ) -> tuple[AttemptResult, Outcome]:
        s = self.settings
        stream = call.stream
        deadline: float | None = s.upstream_timeout_seconds
        if stream:  # a patient try's deadline is set by last_try_patience
            deadline = None if patient else s.first_byte_timeout_seconds
        resp: Response | None = None
        try:
            try:
                async with asyncio.timeout(deadline) as limit:
                    with (
                        self.outlier.waiter(ep, limit) as waiter,
                        last_try_patience(limit, ep, s.first_byte_timeout_seconds, s.upstream_timeout_seconds)
                        if patient
                        else nullcontext(),
                    ):
                        assert call.request is not None  # Python's tries are served by its app
                        resp = await self.upstream.request(
                            ep.url, call.request.method, call.path, call.headers, call.raw
                        )
                        if resp.status >= _RETRYABLE_STATUS and not is_last:
                            kind = FailureKind.UPSTREAM_5XX
                            return Failed(kind, f"{ep.url} answered {resp.status}"), Outcome.of(kind)
                        if stream and resp.status == 200:
                            first = await resp.readany()
                        else:
                            body = await self._read_bounded(resp)
                        ep.streamed_at = time.monotonic()
            except ConnectTimedOut as exc:
                return self._failed(FailureKind.CONNECT_TIMEOUT, ep, exc)
            except ConnectFailed as refused:
                self.router.mark_down(ep)
                return self._failed(FailureKind.CONNECT_ERROR, ep, refused)
            except TimeoutError as timeout:
                if waiter.cut:
                    return self._failed(FailureKind.EJECTED, ep, timeout)
                if stream:
                    return self._failed(FailureKind.FIRST_BYTE_TIMEOUT, ep, timeout)
                # The whole budget is spent: no time left to retry.
                return Answered(self._response_timeout(ep)), Outcome.RESPONSE_TIMEOUT
            except Disconnected as broke:
                return self._failed(FailureKind.DISCONNECTED, ep, broke)
            except _TooLarge:
                return Answered(self._response_too_large(ep)), Outcome.RESPONSE_TOO_LARGE
            if stream and resp.status == 200:
                return await self._stream(call, resp, first, ep, t0, prefill)
            out = web.Response(status=resp.status, body=body, headers=_response_headers(resp))
            out.headers.update(self._decision_headers(call, ep, t0))
            if call.decision.hashes:
                self._observe_cached(call.decision, ep, body)
            if resp.status < 400:
                return Answered(out), Outcome.OK
            return Answered(out), Outcome.HTTP_4XX if resp.status < 500 else Outcome.HTTP_5XX
        finally:
            if resp is not None:
                resp.release()

    def _response_timeout(self, ep: Endpoint) -> web.Response:
        msg = f"{ep.url} did not answer within {self.settings.upstream_timeout_seconds:g}s"
        return json_error(504, msg, code="upstream_timeout")

    def _response_too_large(self, ep: Endpoint) -> web.Response:
        msg = f"{ep.url} answered more than maxResponseBytes ({self.settings.max_response_bytes}) bytes"
        return json_error(502, msg, code="upstream_response_too_large")

    def _failed(self, kind: FailureKind, ep: Endpoint, exc: BaseException) -> tuple[AttemptResult, Outcome]:
        return Failed(kind, f"{ep.url}: {exc!r}"), Outcome.of(kind)

    async def _read_bounded(self, resp: Response) -> bytes:
        limit = self.settings.max_response_bytes
        length = resp.content_length  # a scan of the headers
        if length is not None:
            if length > limit:
                raise _TooLarge
            return await resp.read()
        parts: list[bytes] = []
        size = 0
        while chunk := await resp.readany():
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            parts.append(chunk)
        return b"".join(parts)

    async def _stream(
        self,
        call: _Call,
        resp: Response,
        first: bytes,
        ep: Endpoint,
        t0: float,
        prefill: PrefillTicket,
    ) -> tuple[AttemptResult, Outcome]:
        """Relay an SSE stream whose first bytes arrived. Nothing was sent to the client before them
        (engines send headers at once), so a failure until then was still retryable.

        Reading from the engine and writing to the client fail differently: the first is the
        engine's fault (ejection counts it), the second the client's (it went away)."""
        if not first:
            kind = FailureKind.DISCONNECTED
            return Failed(kind, f"{ep.url} ended the stream before its first byte"), Outcome.of(kind)
        self._stream_started(call, ep, t0, prefill)
        out = web.StreamResponse(status=resp.status, headers=_response_headers(resp))
        out.headers.update(self._decision_headers(call, ep, t0))
        idle = self.settings.stream_idle_timeout_seconds
        chunk = first
        assert call.request is not None
        try:
            await out.prepare(call.request)
        except ConnectionError:
            return Answered(out), Outcome.CLIENT_DISCONNECT
        while chunk:
            try:
                await out.write(chunk)
            except ConnectionError:  # incl. aiohttp's ClientConnectionResetError on a closed client
                return Answered(out), Outcome.CLIENT_DISCONNECT
            try:
                async with asyncio.timeout(idle):
                    chunk = await resp.readany()
                ep.streamed_at = time.monotonic()
            except TimeoutError:
                return await self._abort(out, ep, f"no data for {idle:g}s", Outcome.STREAM_IDLE_TIMEOUT)
            except Disconnected as exc:
                return await self._abort(out, ep, repr(exc), Outcome.STREAM_ABORTED)
        try:
            await out.write_eof()
        except ConnectionError:
            return Answered(out), Outcome.CLIENT_DISCONNECT
        return Answered(out), Outcome.STREAM_OK

    def _stream_started(self, call: _Call, ep: Endpoint, t0: float, prefill: PrefillTicket) -> None:
        decision = call.decision
        self._prefill_over(prefill, decision, ep, time.perf_counter() - t0)  # the first token is out
        self.metrics.ttft.labels(ep.url).observe(time.perf_counter() - t0)
        if decision.hashes:
            self.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens(ep, self.block_size))

    def _stream_broke(self, ep: Endpoint, why: str, outcome: Outcome) -> bytes:
        """The SSE event that ends a stream that broke after it started."""
        log.warning("stream from %s broke after it started (%s); not replaying", ep.url, why)
        code = "upstream_idle_timeout" if outcome is Outcome.STREAM_IDLE_TIMEOUT else "upstream_failed"
        return sse_error(f"upstream {ep.url} failed mid-stream: {why}", code)

    async def _abort(
        self, out: web.StreamResponse, ep: Endpoint, why: str, outcome: Outcome
    ) -> tuple[AttemptResult, Outcome]:
        event = self._stream_broke(ep, why, outcome)
        try:
            await out.write(event)
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return Answered(out), outcome

    def _prefill_over(
        self,
        prefill: PrefillTicket,
        decision: Decision,
        ep: Endpoint,
        first_token_after_s: float | None = None,
    ) -> None:
        if prefill.done(first_token_after_s):
            self.router.settle(decision, ep)

    def _observe_cached(self, decision: Decision, ep: Endpoint, body: bytes) -> None:
        self.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens(ep, self.block_size))
        actual = _cached_tokens(body)
        if actual is not None:
            self.metrics.actual_cached_tokens.inc(actual)
            self.metrics.actual_cached_reports.inc()

    # --- the native front's calls (router/native_http.py; each under the router lock) ----------------
    async def plan(self, kind: Kind, path: str, raw: bytes, session_id: str | None) -> Plan:
        """What the native front does with a generation request it read: :meth:`_generate` and
        :meth:`_forward` up to the first try, which the front makes unless it is patient (that wait is
        Python's, patience.py). The body is small and plain (the front sends others to the app)."""
        s = self.settings
        try:
            parsed = parse_request(raw, kind, s.model, s.max_prompt_chars)
        except BadRequest as exc:
            return answer(self._refuse(exc))
        try:
            decision = await self.router.decide(parsed, session_id)
        except (NoEndpoints, AllEjected) as unavailable:
            return answer(self._no_endpoints(unavailable))
        grant = await self._admit(decision, parsed.output_tokens())
        call = _Call(None, raw, path, {}, decision, parsed.stream, grant, grant.claim)
        st = self._try_state(call)
        ep, is_last, patient = self._next_try(call, st)
        if patient:
            st.left.insert(0, ep)
            return self._keep(call, st)
        t = self._start_try(call, ep)
        self.native_tries += 1
        headers = self._decision_only_headers(call, ep)
        return Go("go", NativeTry(call, st, t), ep.url, call.stream, is_last, headers)

    def _keep(self, call: _Call, st: _TryState) -> Resume:
        token = secrets.token_urlsafe(18)
        self.resumable[token] = (call, st)
        return Resume("resume", token)

    def first_byte(self, nt: NativeTry) -> None:
        """A native try's stream sent its first byte."""
        t = nt.attempt
        t.ep.streamed_at = time.monotonic()
        self._stream_started(nt.call, t.ep, t.t0, t.prefill)

    def heard(self, nt: NativeTry) -> None:
        """A native try's stream is moving (patience.py reads it)."""
        nt.attempt.ep.streamed_at = time.monotonic()

    def done(self, nt: NativeTry, outcome: Outcome, body: bytes | None) -> None:
        """A native try ended with ``outcome``; ``body``: a whole answer the client got."""
        t = nt.attempt
        if body is not None:
            t.ep.streamed_at = time.monotonic()
            if nt.call.decision.hashes:
                self._observe_cached(nt.call.decision, t.ep, body)
        self._end_try(nt.call, t, outcome)

    def failed(self, nt: NativeTry, kind: FailureKind, detail: str) -> Resume:
        """A native try failed before anything reached the client: Python goes on with the request."""
        call, t = nt.call, nt.attempt
        if kind is FailureKind.CONNECT_ERROR:
            self.router.mark_down(t.ep)
        self._end_try(call, t, Outcome.of(kind))
        self._try_failed(call, nt.state, t.ep, Failed(kind, detail))
        return self._keep(call, nt.state)

    def broke(self, nt: NativeTry, outcome: Outcome, detail: str) -> Answer | bytes:
        """A native try ended in a way the client hears of: the response, or a stream's last event."""
        t = nt.attempt
        self._end_try(nt.call, t, outcome)
        if outcome is Outcome.RESPONSE_TIMEOUT:
            return answer(self._response_timeout(t.ep))
        if outcome is Outcome.RESPONSE_TOO_LARGE:
            return answer(self._response_too_large(t.ep))
        if outcome is Outcome.STREAM_IDLE_TIMEOUT:
            detail = f"no data for {self.settings.stream_idle_timeout_seconds:g}s"
        return self._stream_broke(t.ep, detail, outcome)

    def abandon(self, token: str) -> None:
        """The client left before the app took the request over: give back its admission."""
        began = self.resumable.pop(token, None)
        if began is not None:
            self.router.gate.release(began[0].claim)

    def body_timeout(self) -> Answer:
        s = self.settings
        return answer(self._refuse(body_timeout(s.body_read_timeout_seconds)))

    # --- the router's own endpoints --------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        eps = self.router.pool.all()
        ejected = [ep.url for ep in eps if self.outlier.ejected(ep)]
        healthy = sum(1 for ep in eps if ep.healthy and ep.url not in ejected)
        body: dict[str, Any] = {"healthy_endpoints": healthy, "endpoints": len(eps), "ejected": ejected}
        if healthy:
            return web.json_response({"status": "ready", **body})
        reason = (
            "every engine endpoint is ejected"
            if eps and len(ejected) == len(eps)
            else "no healthy engine endpoint"
        )
        return web.json_response({"status": "not ready", "reason": reason, **body}, status=503)

    async def state(self, request: web.Request) -> web.Response:
        """What the router believes about each endpoint: health, ejection, load, indexed blocks."""
        router = self.router
        now = time.monotonic()
        endpoints = {}
        for ep in router.pool.all():
            st = self.outlier.state(ep)
            endpoints[ep.url] = {
                "healthy": ep.healthy,
                "ejected": self.outlier.ejected(ep, now),
                "ejectedForSeconds": round(self.outlier.remaining(ep, now), 3),
                "ejectionReason": st.reason.value if st.reason else None,
                "ejections": st.total,
                "consecutiveFailures": st.consecutive,
                "probation": st.probation,
                "inFlight": ep.in_flight,
                "pendingPrefillTokens": ep.pending_prefill,
                # The pace a held request's move is weighed at (router/admission.py); None: no sample yet.
                "prefillSecondsPer1kTokens": ep.pace.seconds_for(1000),
                "admittedBlocks": router.gate.in_flight_blocks(ep),
                # Kept for the follow-ups of requests that just ended there (admission.anticipateSeconds).
                "reservedBlocks": router.gate.reserved_blocks(ep),
                # Uncached tokens of the prefill whose turn it is there (admission.prefillInTurn), or 0.
                "prefillInTurnTokens": router.gate.prefill_in_turn(ep),
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
        # Entries of endpoints no longer in the pool would be a leak; show them if there are any.
        stale = [u for u in router.index.endpoints() if u not in router.pool and router.index.blocks_of(u)]
        body = {
            "policy": router.settings.policy,
            "indexBlocks": len(router.index),
            "indexEvictions": router.index.evictions,
            "heldRequests": router.gate.held(),
            # Prompts routed on their leading blocks whose rest is being hashed (or waits to be).
            "backgroundHashing": router.work.background_pending,
            "endpoints": endpoints,
            "staleIndexEndpoints": stale,
            "incrementalTokenization": router.tokenizer_state(),
            "dataPlane": {
                "plane": router.settings.data_plane,
                "nativeTries": self.native_tries,
                "resumedInPython": self.resumed,
                # "python" when a weighted scorer has no native twin (a plugin): the ranking costs more.
                "ranking": "native" if isinstance(router.pick, NativePick) else "python",
                # The request path's Python compiled by mypyc, or why it runs from source.
                "compiled": COMPILED.as_json(),
            },
        }
        return web.json_response(body)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _admin_only(request: web.Request) -> web.Response:
    return json_error(404, "/kvstrata/state is served on the router's admin port", code="admin_only")


PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy", Proxy)


def build_app(router: Router, upstream: Upstream) -> web.Application:
    """The public app; with ``adminPort`` set, /kvstrata/state lives only on :func:`build_admin_app`."""
    proxy = Proxy(router, upstream)
    app = web.Application(client_max_size=router.settings.max_body_bytes, middlewares=[openai_errors])
    app[ROUTER_KEY] = router
    app[PROXY_KEY] = proxy
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    app.router.add_get("/metrics", proxy.metrics_handler)
    if router.settings.admin_port is None:
        app.router.add_get("/kvstrata/state", proxy.state)
    else:  # answered here, not forwarded to an engine by the catch-all below
        app.router.add_get("/kvstrata/state", _admin_only)
    app.router.add_route("*", "/{tail:.*}", proxy.passthrough)
    return app


def build_admin_app(proxy: Proxy) -> web.Application:
    """The admin port's app, over the public app's proxy (its /kvstrata/state counts that one's requests)."""
    app = web.Application(middlewares=[openai_errors])
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    app.router.add_get("/metrics", proxy.metrics_handler)
    app.router.add_get("/kvstrata/state", proxy.state)
    return app
