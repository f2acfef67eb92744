"""What became of an upstream attempt, as types: the proxy decides retries and ejection on them and
labels metrics with their values (never with text cut out of an error message)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from aiohttp import web


class FailureKind(StrEnum):
    """Why an engine failed a request before anything reached the client (so it can be retried)."""

    CONNECT_ERROR = "connect_error"  # refused / unreachable
    CONNECT_TIMEOUT = "connect_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # streamed: no first byte within firstByteTimeoutSeconds
    DISCONNECTED = "disconnected"  # the engine closed the connection before answering
    UPSTREAM_5XX = "upstream_5xx"
    EJECTED = "ejected"  # the wait was cut because the endpoint was ejected meanwhile
    # Faults that are not retried but still count toward ejection:
    HTTP_5XX = "http_5xx"  # the last endpoint tried answered 5xx (forwarded to the client)
    RESPONSE_TIMEOUT = "response_timeout"
    STREAM_ABORTED = "stream_aborted"
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    SCRAPE_FAILED = "scrape_failed"  # only from the load scraper
    SCRAPE_TIMEOUT = "scrape_timeout"


# The engine never had the request (no connection was made): trying elsewhere duplicates no work and
# cannot spread a request that breaks engines, so these tries are not counted against maxRetries.
UNSENT: frozenset[FailureKind] = frozenset({FailureKind.CONNECT_ERROR, FailureKind.CONNECT_TIMEOUT})


class Outcome(StrEnum):
    """The ``outcome`` label of ``kvstrata_router_requests_total`` (one per attempt)."""

    OK = "ok"
    STREAM_OK = "stream_ok"
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    CONNECT_ERROR = "connect_error"
    CONNECT_TIMEOUT = "connect_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    DISCONNECTED = "disconnected"
    UPSTREAM_5XX = "upstream_5xx"
    EJECTED = "ejected"
    RESPONSE_TIMEOUT = "response_timeout"  # non-streamed: no whole answer within upstreamTimeoutSeconds
    RESPONSE_TOO_LARGE = "response_too_large"
    STREAM_ABORTED = "stream_aborted"  # the engine broke a stream that had started
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    CLIENT_DISCONNECT = "client_disconnect"  # the client went away: not the engine's fault

    @classmethod
    def of(cls, kind: FailureKind) -> Outcome:
        return cls(kind.value)


# Outcomes that count against the engine for outlier ejection, as the failure they count as.
ENGINE_FAULTS: dict[Outcome, FailureKind] = {
    o: FailureKind(o.value)
    for o in (
        Outcome.CONNECT_ERROR,
        Outcome.CONNECT_TIMEOUT,
        Outcome.FIRST_BYTE_TIMEOUT,
        Outcome.DISCONNECTED,
        Outcome.UPSTREAM_5XX,
        Outcome.HTTP_5XX,
        Outcome.RESPONSE_TIMEOUT,
        Outcome.STREAM_ABORTED,
        Outcome.STREAM_IDLE_TIMEOUT,
    )
}


@dataclass(frozen=True, slots=True)
class Answered:
    """The client got (or is getting) this response; no retry."""

    response: web.StreamResponse


@dataclass(frozen=True, slots=True)
class Failed:
    """Nothing reached the client: the next-best endpoint may be tried."""

    kind: FailureKind
    detail: str


AttemptResult = Answered | Failed
