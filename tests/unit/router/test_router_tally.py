"""The request path's tallies (router/tally.py) render as prometheus_client's own Counter and Histogram
do: the same families, samples, labels and values (``_created`` times aside)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.router.tally import Tally, TallyHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _samples(
    registry: CollectorRegistry,
) -> list[tuple[str, str, list[tuple[str, tuple[tuple[str, str], ...], float]]]]:
    out = []
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        samples = [
            (s.name, tuple(sorted(s.labels.items())), 0.0 if s.name.endswith("_created") else s.value)
            for s in family.samples
        ]
        out.append((family.name, family.type, sorted(samples)))
    return sorted(out)


@pytest.mark.parametrize("seed", range(3))
def test_tallies_render_as_prometheus_clients_metrics(seed: int) -> None:
    rng = random.Random(seed)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    pc = Counter("x_requests", "Requests", ["endpoint", "outcome"], registry=theirs)
    pc0 = Counter("x_tokens", "Tokens", registry=theirs)
    ph = Histogram("x_latency_seconds", "Latency", ["endpoint"], buckets=BUCKETS, registry=theirs)
    ph0 = Histogram("x_routing_seconds", "Routing", buckets=BUCKETS, registry=theirs)
    tc = Tally("x_requests", "Requests", ["endpoint", "outcome"], registry=ours)
    tc0 = Tally("x_tokens", "Tokens", registry=ours)
    th = TallyHistogram("x_latency_seconds", "Latency", ["endpoint"], buckets=BUCKETS, registry=ours)
    th0 = TallyHistogram("x_routing_seconds", "Routing", buckets=BUCKETS, registry=ours)
    for _ in range(2000):
        ep, outcome = rng.choice(["http://a", "http://b"]), rng.choice(["ok", "connect_error"])
        amount = rng.choice([1, 3, 0.5])
        value = rng.choice([0.0, 0.005, 0.0051, 1, rng.random() * 20, 1e9])
        pc.labels(ep, outcome).inc(amount)
        tc.labels(ep, outcome).inc(amount)
        pc0.inc(amount)
        tc0.inc(amount)
        ph.labels(ep).observe(value)
        th.labels(ep).observe(value)
        ph0.observe(value)
        th0.observe(value)
    assert _samples(ours) == _samples(theirs)
    created = [s for f in text_string_to_metric_families(generate_latest(ours).decode()) for s in f.samples]
    assert sum(s.name.endswith("_created") for s in created) == 4 + 1 + 2 + 1  # one per child


def test_a_tally_refuses_what_a_counter_refuses() -> None:
    registry = CollectorRegistry()
    t = Tally("x", "X", ["a"], registry=registry)
    with pytest.raises(ValueError):
        t.labels("1").inc(-1)
    with pytest.raises(ValueError):
        t.labels("1", "2")
    with pytest.raises(ValueError):  # the same name twice in one registry
        Tally("x", "X again", registry=registry)
