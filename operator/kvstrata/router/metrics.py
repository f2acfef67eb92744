"""The router's Prometheus metrics (``kvstrata_router_*``), on a registry of its own so that tests and
embedded routers never collide in the process-global one.

The operator reads ``kvstrata_router_decisions_total`` (by reason), ``kvstrata_router_affinity_share``
and ``kvstrata_router_fallbacks_total`` into the InferenceCluster status.

``actual cached tokens`` comes from ``usage.prompt_tokens_details.cached_tokens`` in engine responses,
which vLLM includes only when it runs with ``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstrata.router.outcomes import FailureKind, Outcome
from kvstrata.router.pool import Endpoint
from kvstrata.router.reasons import AFFINITY_REASONS
from kvstrata.router.tally import Tally, TallyHistogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "kvstrata_router"
        # The metrics every request touches are tallies (router/tally.py): a plain add each.
        self.requests = Tally(
            f"{p}_requests", "Proxied requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.bad_requests = Counter(
            f"{p}_bad_requests", "Requests refused with a 4xx", ["reason"], registry=r
        )
        self.decisions = Tally(f"{p}_decisions", "Routing decisions by reason", ["reason"], registry=r)
        self.affinity_share = Gauge(
            f"{p}_affinity_share", "Share of decisions decided by a cached-prefix overlap", registry=r
        )
        self.prompt_tokens = Tally(f"{p}_prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.routed_on_leading_blocks = Counter(
            f"{p}_routed_on_leading_blocks",
            "Prompts routed on their leading blocks (no engine held the start of a long new stretch), by "
            "what became of the rest: deferred (hashed after the decision, off the request's path) or "
            "skipped (the background thread had a backlog)",
            ["rest"],
            registry=r,
        )
        self.prompt_chars = Tally(
            f"{p}_prompt_chars",
            "Prompt characters routed, by how their tokens were had: reused (an earlier prompt's chunks) "
            "or tokenized",
            ["path"],
            registry=r,
        )
        self.predicted_cached_tokens = Tally(
            f"{p}_predicted_cached_tokens",
            "Cached prompt tokens the index predicted on the chosen endpoint",
            registry=r,
        )
        self.actual_cached_tokens = Tally(
            f"{p}_actual_cached_tokens",
            "Cached prompt tokens engines reported (usage.prompt_tokens_details; needs --enable-prompt-tokens-details)",
            registry=r,
        )
        self.actual_cached_reports = Tally(
            f"{p}_actual_cached_reports", "Responses that reported cached_tokens", registry=r
        )
        self.fallbacks = Counter(
            f"{p}_fallbacks",
            "Requests routed on approximate character blocks, by cause",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            f"{p}_retries", "Attempts on a next-best endpoint, by cause", ["reason"], registry=r
        )
        self.upstream_latency = TallyHistogram(
            f"{p}_upstream_latency_seconds",
            "Upstream request time until the response is complete",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = TallyHistogram(
            f"{p}_ttft_seconds", "Time to the first streamed byte from the engine", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.routing_seconds = TallyHistogram(
            f"{p}_routing_seconds", "Time to decide (tokenize, hash, look up, score)",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r,
        )  # fmt: skip
        self.index_blocks = Gauge(f"{p}_index_blocks", "Indexed (endpoint, block) entries", registry=r)
        self.index_evictions = Gauge(
            f"{p}_index_evictions", "Entries evicted by the index bound (monotonic)", registry=r
        )
        self.kv_events = Counter(f"{p}_kv_events", "KV events applied", ["endpoint", "type"], registry=r)
        # By tier: which media the engines report blocks on (GPU, CPU, STORAGE in vLLM 0.32), i.e. what
        # the index's tier credit has to work with.
        self.kv_event_blocks = Counter(
            f"{p}_kv_event_blocks",
            "Blocks in applied BlockStored/BlockRemoved events, by medium",
            ["endpoint", "type", "medium"],
            registry=r,
        )
        self.fs_evictions_held = Counter(
            f"{p}_fs_evictions_held",
            "Block files an engine's fs-janitor evicted that the index held on STORAGE (then dropped)",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_lag = Gauge(
            f"{p}_kv_event_lag_seconds",
            "Age of the last KV event batch when applied",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_gaps = Counter(f"{p}_kv_event_gaps", "Sequence gaps detected", ["endpoint"], registry=r)
        self.kv_event_replays = Counter(
            f"{p}_kv_event_replays", "Replay requests by result", ["endpoint", "result"], registry=r
        )
        self.kv_event_errors = Counter(
            f"{p}_kv_event_errors", "Undecodable KV event messages", ["endpoint"], registry=r
        )
        self.engine_restarts = Counter(
            f"{p}_engine_restarts", "Event sequence restarts (engine restarted)", ["endpoint"], registry=r
        )
        self.endpoints = Gauge(f"{p}_endpoints", "Endpoints by health", ["state"], registry=r)
        self.in_flight = Gauge(
            f"{p}_in_flight", "Requests this router has in flight at each endpoint", ["endpoint"], registry=r
        )
        self.ejected = Gauge(
            f"{p}_ejected", "1 while the endpoint is ejected from rotation", ["endpoint"], registry=r
        )
        self.kv_blocks = Gauge(
            f"{p}_endpoint_kv_blocks",
            "Each endpoint's KV pool in blocks, from its vllm:cache_config_info (0: not known yet)",
            ["endpoint"],
            registry=r,
        )
        self.ejections = Counter(
            f"{p}_ejections", "Outlier ejections by endpoint and the failure that tipped it", ["endpoint", "reason"],
            registry=r,
        )  # fmt: skip
        self.malformed_http = Counter(
            f"{p}_malformed_http",
            "Requests aiohttp could not parse (answered 400, logged without a traceback), by error",
            ["error"],
            registry=r,
        )
        self.admissions = Tally(
            f"{p}_admissions",
            "Routed requests by how they got their engine: direct, queued (held until its engine had "
            "room), stolen (held, then sent to another engine that serves it as cheaply), moved (held as "
            "long as moving would cost, then sent elsewhere), reserved (took the room its conversation's "
            "last request kept), expired (held maxHoldSeconds), ungated",
            ["how"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            f"{p}_hold_seconds", "Time held in the router for KV room (held requests only)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.held = Gauge(f"{p}_held", "Requests held now for KV room on their engine", registry=r)
        self._affinity = 0
        self._decided = 0
        self.affinity_share.set_function(lambda: self._affinity / self._decided if self._decided else 0.0)

    def track_endpoint(self, ep: Endpoint, ejected: Callable[[], float]) -> None:
        self.in_flight.labels(ep.url).set_function(lambda: ep.in_flight)
        self.ejected.labels(ep.url).set_function(ejected)
        self.kv_blocks.labels(ep.url).set_function(lambda: ep.kv_blocks)

    def forget_endpoint(self, url: str) -> None:
        for gauge in (self.in_flight, self.ejected, self.kv_blocks):
            with contextlib.suppress(KeyError):
                gauge.remove(url)

    def ejected_by(self, ep: Endpoint, kind: FailureKind) -> None:
        self.ejections.labels(ep.url, kind.value).inc()

    def request_done(self, endpoint: str, outcome: Outcome, seconds: float | None) -> None:
        self.requests.labels(endpoint, outcome.value).inc()
        if seconds is not None:
            self.upstream_latency.labels(endpoint).observe(seconds)

    def decided(self, reason: str) -> None:
        self.decisions.labels(reason).inc()
        self._decided += 1
        if reason in AFFINITY_REASONS:
            self._affinity += 1

    def admitted(self, how: str, held_s: float) -> None:
        self.admissions.labels(how).inc()
        if held_s > 0:
            self.hold_seconds.observe(held_s)

    def bind_index(self, size: Callable[[], float], evictions: Callable[[], float]) -> None:
        self.index_blocks.set_function(size)
        self.index_evictions.set_function(evictions)

    def bind_endpoints(
        self, healthy: Callable[[], float], unhealthy: Callable[[], float], ejected: Callable[[], float]
    ) -> None:
        self.endpoints.labels("healthy").set_function(healthy)
        self.endpoints.labels("unhealthy").set_function(unhealthy)
        self.endpoints.labels("ejected").set_function(ejected)
