"""The native ranking (native/src/ranking.rs, :class:`NativePick`) against its definition, scoring.py's
:func:`pick`: the same order, totals and scores, float for float, on random requests, endpoints and
scorer states, and on the requests a running router decides."""

from __future__ import annotations

import random
from array import array

import pytest
from kvstrata_native import rendezvous as native_rendezvous

from kvstrata.api.router_config import RouterSettings, TierWeights
from kvstrata.router.core import Router
from kvstrata.router.index import PrefixMatch
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.requests import parse_request
from kvstrata.router.scoring import (
    CacheRoomScorer,
    EvictsScorer,
    FitScorer,
    HistoryScorer,
    KvUsageScorer,
    LoadScorer,
    NativePick,
    PrefillCostScorer,
    PrefixScorer,
    PythonPick,
    Ranked,
    RecentScorer,
    RouteRequest,
    Scorer,
    SessionScorer,
    pick,
    picker,
    rendezvous,
)

CASES = 3000


def _endpoints(rng: random.Random) -> list[Endpoint]:
    n = rng.randint(1, 6)
    alike = rng.random() < 0.3  # equal state everywhere: the tie-break decides
    eps = []
    for i in range(n):
        ep = Endpoint(EndpointSpec(f"http://engine-{i}.ns:{8000 + rng.randint(0, 9)}"))
        r = random.Random(7) if alike else rng
        ep.in_flight = r.randint(0, 8)
        ep.running = r.choice([0.0, float(r.randint(0, 12)), r.random() * 10])
        ep.waiting = r.choice([0.0, float(r.randint(0, 5))])
        ep.kv_usage = r.choice([0.0, r.random(), 1.3, -0.1])
        ep.kv_blocks = r.choice([0, r.randint(1, 4096), 64])
        ep.pending_prefill = r.choice([0, r.randint(0, 40000)])
        eps.append(ep)
    return eps


def _scorers(rng: random.Random) -> list[tuple[Scorer, float]]:
    tiers = TierWeights(GPU=rng.choice([1.0, 0.9]), CPU=rng.choice([0.5, 0.0, 0.7]), STORAGE=rng.random())
    window = rng.choice([0.0, 1.5, 30.0])
    built: list[tuple[Scorer, float]] = [
        (
            PrefillCostScorer(tiers, rng.choice([16, 32]), rng.choice([0.0, 0.25, 1.0]), rng.random() < 0.5),
            1.0,
        ),
        (PrefixScorer(tiers), 0.0),
        (LoadScorer(), 0.2),
        (KvUsageScorer(), 0.1),
        (CacheRoomScorer(), 1.0),
        (HistoryScorer(), 0.5),
        (FitScorer(window), 0.5),
        (RecentScorer(window), 0.3),
        (EvictsScorer(window), 1.0),
        (SessionScorer(), 2.0),
    ]
    # The defaults' weights half the time, else random ones (0 leaves a scorer out).
    if rng.random() < 0.5:
        built = [(s, rng.choice([0.0, rng.random() * 2, 1.0])) for s, _ in built]
    return built


def _fill_state(
    rng: random.Random, scorers: list[tuple[Scorer, float]], eps: list[Endpoint], now: float
) -> None:
    for s, _ in scorers:
        for ep in eps:
            if rng.random() < 0.3:
                continue  # no state for this endpoint yet
            hashes = array("q", rng.sample(range(1, 10_000), rng.randint(0, 300)))
            if isinstance(s, (FitScorer, EvictsScorer)):
                s.on_routed(ep, now - rng.random() * 60, hashes)
            elif isinstance(s, RecentScorer):
                s.sent[ep.url] = (rng.random() * 20, now - rng.random() * 40)


def _request(rng: random.Random, eps: list[Endpoint], now: float) -> RouteRequest:
    n = rng.choice([0, 1, 2, rng.randint(1, 400)])
    hashes = array("q", range(1, n + 1))
    matches: dict[str, PrefixMatch] = {}
    history: dict[str, int] = {}
    cached: dict[str, int] = {}
    if n and rng.random() < 0.5:
        for ep in rng.sample(eps, rng.randint(1, len(eps))):
            blocks = rng.randint(1, n)
            gpu = rng.randint(0, blocks)
            cpu = rng.randint(0, blocks - gpu)
            storage = rng.randint(0, blocks - gpu - cpu)
            matches[ep.url] = PrefixMatch(blocks, gpu, cpu, storage, blocks - gpu - cpu - storage)
    elif rng.random() < 0.7:
        history = {ep.url: rng.randint(1, max(n, 1)) for ep in eps if rng.random() < 0.5}
        cached = {ep.url: rng.randint(0, 5000) for ep in eps if rng.random() < 0.8}
    tokens = rng.choice([None, n * 16 + rng.randint(0, 15), rng.randint(1, 200_000)])
    return RouteRequest(
        hashes=hashes,
        matches=matches,
        tie_key=rng.randbytes(8) if rng.random() < 0.9 else b"",
        session=rng.choice([None, "", f"user-{rng.randint(0, 9)}", "sessão-✓"]),
        approximate=rng.random() < 0.1,
        cached_blocks=cached,
        history=history,
        prompt_tokens=tokens,
        now=now,
        blocks=rng.choice([None, None, n + rng.randint(0, 3000)]),
        with_room=frozenset(ep.url for ep in eps if rng.random() < 0.5),
        growth={ep.url: rng.random() * 100 for ep in eps if rng.random() < 0.3},
    )


def _same(python: list[Ranked], fast: list[Ranked]) -> None:
    assert [r.endpoint.url for r in fast] == [r.endpoint.url for r in python]
    assert [r.total for r in fast] == [r.total for r in python]
    assert [r.scores for r in fast] == [r.scores for r in python]


@pytest.mark.parametrize("seed", range(4))
def test_the_native_ranking_is_pick_float_for_float(seed: int) -> None:
    rng = random.Random(seed)
    ties = 0
    for _ in range(CASES // 4):
        eps = _endpoints(rng)
        scorers = _scorers(rng)
        now = 1000.0 + rng.random() * 100
        _fill_state(rng, scorers, eps, now)
        req = _request(rng, eps, now)
        fast = NativePick.of(scorers)
        assert fast is not None
        # The fit scorer expires its window's old blocks as it scores: the same horizon, so the second
        # ranking sees what the first left (and the native one runs second, half the time first).
        if rng.random() < 0.5:
            python, native_ranked = pick(req, eps, scorers), fast(req, eps)
        else:
            native_ranked = fast(req, eps)
            python = pick(req, eps, scorers)
        _same(python, native_ranked)
        ties += len(eps) > 1 and python[0].total == python[1].total
    assert ties > 20  # the tie-break was exercised


def test_totals_a_hair_apart_tie_as_in_python() -> None:
    """Float noise in the totals is rounded away before the tie-break, the same way."""
    eps = [Endpoint(EndpointSpec(f"http://e{i}")) for i in range(3)]
    eps[0].kv_usage, eps[1].kv_usage = 0.1 + 0.2, 0.3  # 0.30000000000000004 against 0.3
    scorers: list[tuple[Scorer, float]] = [(KvUsageScorer(), 1.0)]
    fast = NativePick.of(scorers)
    assert fast is not None
    for i in range(200):
        req = RouteRequest(tie_key=i.to_bytes(8, "big"))
        _same(pick(req, eps, scorers), fast(req, eps))


def test_rendezvous_is_blake2b_as_in_python() -> None:
    rng = random.Random(5)
    for _ in range(500):
        key, url = (
            rng.randbytes(rng.randint(0, 40)),
            f"http://{rng.randbytes(6).hex()}:{rng.randint(1, 65535)}",
        )
        assert native_rendezvous(key, url) == rendezvous(key, url)


def test_a_scorer_without_a_native_twin_keeps_the_python_pick() -> None:
    class Mine(LoadScorer):
        def score(self, req: RouteRequest, eps: object) -> list[float]:  # type: ignore[override]
            return [0.0]

    assert NativePick.of([(Mine(), 1.0)]) is None
    assert isinstance(picker([(Mine(), 1.0), (LoadScorer(), 1.0)]), PythonPick)
    # Weight 0 leaves a scorer out of the ranking, so it does not matter which kind it is.
    assert isinstance(picker([(Mine(), 0.0), (LoadScorer(), 1.0)]), NativePick)
    assert isinstance(picker([(LoadScorer(), 1.0)], native=False), PythonPick)


async def test_a_router_ranks_natively_and_as_pick_would() -> None:
    """A router's own decisions, over a conversation mix on three endpoints, rank as :func:`pick`
    ranks the same requests."""
    settings = RouterSettings.model_validate({"model": "m", "blockSize": 4, "policy": "kv-aware"})
    router = Router(settings, RouterMetrics())
    assert isinstance(router.pick, NativePick)
    router.pool.replace([EndpointSpec(f"http://engine-{i}:8000") for i in range(3)])
    eps = router.pool.all()
    rng = random.Random(11)
    compared = 0
    for i in range(300):
        for ep in eps:
            ep.kv_blocks, ep.in_flight = 256, rng.randint(0, 4)
        tenant = rng.randint(0, 4)
        prompt = f"tenant {tenant} system prompt " * 8 + f"turn {i} " * rng.randint(1, 6)
        body = f'{{"model": "m", "prompt": "{prompt}", "max_tokens": 4}}'.encode()
        decision = await router.decide(parse_request(body, "completion", "m", 1 << 20))
        assert decision.request is not None
        ranked = decision.ranked
        _same(pick(decision.request, [r.endpoint for r in ranked], router.scorers), ranked)
        router.commit(decision, decision.order[0])
        compared += 1
    assert compared == 300
