"""Prefix-cache hit rates from engine counters: pure arithmetic, no I/O.

vLLM exports cumulative token counters per engine process (`vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`, `vllm:external_prefix_cache_*`, `vllm:prompt_tokens_cached_by_source_total`).
A hit rate over a window is a ratio of counter *deltas*, and a counter that went down means the process
restarted: its new value counts from zero.

`CacheTracker` keeps, per InferenceCluster, the last raw counters of every pod and an accumulated
total that only grows (resets folded in), sampled over time. The window rate is the ratio of the
accumulated deltas between the oldest sample inside the window and now.

Tiers: every rate here is a share of *all* queried prompt tokens, so the tier rates add up to the
overall rate: `hit_rate == gpu_hit_rate + external_hit_rate` (GPU = the engine's own prefix cache;
external = tokens a KV connector loaded from the CPU/NVMe tiers or a peer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields

# `vllm:prompt_tokens_cached_by_source_total{source=...}` labels, by our tier names.
SOURCE_TIERS: Mapping[str, str] = {
    "device": "gpu",
    "host": "cpu",
    "disk": "nvme",
    "p2p": "peer",
    "external_unspecified": "external",
}
TIERS = ("gpu", "cpu", "nvme", "peer", "external")


@dataclass(frozen=True)
class Counters:
    """Cumulative token counters of one engine (or a sum of engines)."""

    queries: float = 0.0
    hits: float = 0.0
    external_queries: float = 0.0
    external_hits: float = 0.0
    # connector hits by tier (host/disk/...); GPU hits are `hits`
    cpu_hits: float = 0.0
    nvme_hits: float = 0.0
    peer_hits: float = 0.0
    other_external_hits: float = 0.0
    preemptions: float = 0.0

    def __add__(self, other: Counters) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: Counters) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


def reset_aware_delta(
    previous: Counters | None, current: Counters, *, restarted_since: bool = False
) -> Counters:
    """What the counters grew by since `previous`. A counter that went down was reset by a restart, so
    its current value is all that was counted since; with no previous sample everything counts.
    `restarted_since` says the process is known to be new (its start time changed)."""
    if previous is None or restarted_since:
        return current
    restarted = any(getattr(current, f.name) < getattr(previous, f.name) for f in fields(current))
    # One process exports all of them: if any went down, the process restarted and all count from zero.
    return current if restarted else current - previous


def ratio(part: float, whole: float) -> float | None:
    """None when nothing was queried: no traffic is not a 0% hit rate."""
    if whole <= 0:
        return None
    return max(0.0, min(1.0, part / whole))


@dataclass(frozen=True)
class HitRates:
    """Rates over one span of counters; every rate is None when no prompt tokens were queried."""

    queried_tokens: int
    tokens_from_cache: int
    hit_rate: float | None
    gpu_hit_rate: float | None
    external_hit_rate: float | None
    tier_hit_rates: Mapping[str, float | None]

    @staticmethod
    def of(c: Counters) -> HitRates:
        cached = c.hits + c.external_hits
        return HitRates(
            queried_tokens=int(c.queries),
            tokens_from_cache=int(cached),
            hit_rate=ratio(cached, c.queries),
            gpu_hit_rate=ratio(c.hits, c.queries),
            external_hit_rate=ratio(c.external_hits, c.queries),
            tier_hit_rates={
                "gpu": ratio(c.hits, c.queries),
                "cpu": ratio(c.cpu_hits, c.queries),
                "nvme": ratio(c.nvme_hits, c.queries),
                "peer": ratio(c.peer_hits, c.queries),
                "external": ratio(c.other_external_hits, c.queries),
            },
        )


@dataclass
class CacheTracker:
    """Per-InferenceCluster memory of counter samples (kept in the operator process only).

    The first observation of the tracker is a baseline: the window is empty (rates None), the total
    counts everything the pods counted so far. A pod first seen later (new or replaced pod) counts from
    zero, as does a pod whose counters went down (process restart)."""

    window_seconds: float = 300.0
    last: dict[str, Counters] = field(default_factory=dict)
    started: dict[str, float | None] = field(default_factory=dict)
    total: Counters = field(default_factory=Counters)
    history: deque[tuple[float, Counters]] = field(default_factory=deque)

    def observe(
        self,
        now: float,
        samples: Mapping[str, Counters],
        *,
        alive: Collection[str] | None = None,
        start_times: Mapping[str, float | None] | None = None,
    ) -> None:
        """Fold one scrape in. `samples` maps a pod key (its UID) to its current counters. Pods in
        `alive` that were not scraped this time (a failed scrape, not ready) keep their last sample;
        pods not in `alive` are gone and forgotten (default: keep all). `start_times` (the engine's
        `process_start_time_seconds`) catches a restart whose counters already grew past the old ones."""
        if self.history and now < self.history[-1][0]:
            raise ValueError(f"time went backwards: {now} < {self.history[-1][0]}")
        start_times = start_times or {}
        for key, current in samples.items():
            start = start_times.get(key)
            known = self.started.get(key)
            restarted = key in self.last and start is not None and known is not None and start != known
            self.total = self.total + reset_aware_delta(
                self.last.get(key), current, restarted_since=restarted
            )
            self.last[key] = current
            self.started[key] = start
        if alive is not None:
            for key in [k for k in self.last if k not in alive]:
                del self.last[key]
                self.started.pop(key, None)
        self.history.append((now, self.total))
        # Keep one sample at or before the window's start so the window spans the whole length.
        start = now - self.window_seconds
        while len(self.history) >= 2 and self.history[1][0] <= start:
            self.history.popleft()

    def window(self) -> Counters:
        """Counter growth over the window (zero until two samples exist)."""
        if len(self.history) < 2:
            return Counters()
        return self.history[-1][1] - self.history[0][1]

    def window_rates(self) -> HitRates:
        return HitRates.of(self.window())

    def total_rates(self) -> HitRates:
        return HitRates.of(self.total)


def percent(value: float | None) -> int | None:
    """A 0-1 share as a whole percent for printer columns (None stays None)."""
    return None if value is None else round(value * 100)
