"""Prometheus text from engines and routers, reduced to the figures the status needs (pure).

Parsing goes through `prometheus_client.parser.text_string_to_metric_families`; counter families lose
their `_total` suffix there, so samples are matched by *sample* name, which keeps it.
A process may host several engines (data parallel: label `engine`); their samples are summed
(KV usage averaged). The load gauges come from kvstrata.vllm_metrics, the parser the router uses too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvstrata.controller.hitrate import Counters
from kvstrata.router.reasons import AFFINITY_REASONS
from kvstrata.vllm_metrics import scan_load_gauges

_COUNTER_SAMPLES = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:external_prefix_cache_queries_total": "external_queries",
    "vllm:external_prefix_cache_hits_total": "external_hits",
    "vllm:num_preemptions_total": "preemptions",
}
_SOURCE_FIELDS = {
    "host": "cpu_hits",
    "disk": "nvme_hits",
    "p2p": "peer_hits",
    "external_unspecified": "other_external_hits",
}


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks the metrics we need."""


@dataclass(frozen=True)
class EngineSample:
    counters: Counters
    kv_usage: float | None
    running: int | None
    waiting: int | None
    start_time: float | None


@dataclass(frozen=True)
class RouterSample:
    requests: int
    decisions: int
    affinity_decisions: int
    fallbacks: int
    retries: int


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                yield s.name, s.labels, float(s.value)
    except (ValueError, TypeError, IndexError) as e:
        raise MetricsParseError(f"not Prometheus text: {e}") from None


def parse_engine(text: str) -> EngineSample:
    """Counters and load of one vLLM process; raises MetricsParseError if it exports no prefix-cache
    counters (prefix caching off, or not a vLLM /metrics)."""
    sums: dict[str, float] = defaultdict(float)
    start_time: float | None = None
    seen_queries = False
    for name, labels, value in _samples(text):
        if name in _COUNTER_SAMPLES:
            sums[_COUNTER_SAMPLES[name]] += value
            seen_queries |= name == "vllm:prefix_cache_queries_total"
        elif name == "vllm:prompt_tokens_cached_by_source_total":
            target = _SOURCE_FIELDS.get(labels.get("source", ""))
            if target:
                sums[target] += value
        elif name == "process_start_time_seconds":
            start_time = value
    if not seen_queries:
        raise MetricsParseError(
            "no vllm:prefix_cache_queries_total (not a vLLM engine, or prefix caching off)"
        )
    gauges = scan_load_gauges(text)
    usage, running, waiting = gauges.kv_usage, gauges.running, gauges.waiting
    return EngineSample(
        counters=Counters(**sums),
        kv_usage=sum(usage) / len(usage) if usage else None,
        running=int(sum(running)) if running else None,
        waiting=int(sum(waiting)) if waiting else None,
        start_time=start_time,
    )


def parse_router(text: str) -> RouterSample:
    """Totals of one router process (`kvstrata_router_*`)."""
    requests = decisions = affinity = fallbacks = retries = 0.0
    seen = False
    for name, labels, value in _samples(text):
        if name == "kvstrata_router_requests_total":
            requests += value
            seen = True
        elif name == "kvstrata_router_decisions_total":
            decisions += value
            if labels.get("reason") in AFFINITY_REASONS:
                affinity += value
        elif name == "kvstrata_router_fallbacks_total":
            fallbacks += value
        elif name == "kvstrata_router_retries_total":
            retries += value
    # A fresh router exports the families with no samples: a valid zero, unlike a non-router.
    if not seen and decisions == 0 and "kvstrata_router_" not in text:
        raise MetricsParseError("no kvstrata_router_* metrics (not a kvstrata router)")
    return RouterSample(int(requests), int(decisions), int(affinity), int(fallbacks), int(retries))


def sum_routers(samples: Iterable[RouterSample]) -> RouterSample | None:
    items = list(samples)
    if not items:
        return None
    return RouterSample(*(sum(getattr(s, f) for s in items) for f in RouterSample.__dataclass_fields__))
