"""Counters read from each engine's own /metrics: the ground truth for cache hit rates and request split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
}


def parse_counters(text: str) -> dict[str, float]:
    """Sum each counter of COUNTERS over its label sets (engine, model_name, finished_reason)."""
    wanted = {sample: key for key, sample in COUNTERS.items()}
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


@dataclass(frozen=True)
class EngineDelta:
    url: str
    hits: float
    queries: float
    requests: float
    prompt_tokens: float
    preemptions: float


def deltas(
    urls: Sequence[str], before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]
) -> list[EngineDelta]:
    return [
        EngineDelta(url, **{k: a[k] - b[k] for k in COUNTERS})
        for url, b, a in zip(urls, before, after, strict=True)
    ]


def summed(rounds: Sequence[Sequence[EngineDelta]]) -> list[EngineDelta]:
    """Per engine, the counters of several runs added up (engines in the same order in each)."""
    return [
        EngineDelta(per[0].url, **{k: sum(getattr(r, k) for r in per) for k in COUNTERS})
        for per in zip(*rounds, strict=True)
    ]


def cluster_hit_rate(rows: Sequence[EngineDelta]) -> float | None:
    queries = sum(r.queries for r in rows)
    return sum(r.hits for r in rows) / queries if queries else None


def split_imbalance(rows: Sequence[EngineDelta]) -> float | None:
    """max/mean of requests per engine: 1.0 is a perfectly even split, `len(rows)` is all on one engine."""
    counts = [r.requests for r in rows]
    total = sum(counts)
    return max(counts) / (total / len(counts)) if total else None
