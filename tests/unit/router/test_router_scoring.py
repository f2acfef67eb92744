"""Each scorer and filter alone, then the picker, then the policies' reasons."""

from __future__ import annotations

import math
import time
from typing import get_args

import pytest

from kvstrata.api.router_config import Policy, RouterSettings, TierWeights, Weights
from kvstrata.router.core import Router
from kvstrata.router.decision import Decision
from kvstrata.router.index import BlockIndex, PrefixMatch
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policies import POLICIES
from kvstrata.router.pool import Endpoint, EndpointSpec, PrefillTicket, faded
from kvstrata.router.requests import parse_request
from kvstrata.router.scoring import (
    SCORERS,
    BoundedLoadFilter,
    CacheRoomScorer,
    EvictsScorer,
    FitScorer,
    KvUsageScorer,
    LoadScorer,
    PrefillCostScorer,
    PrefixScorer,
    RecentScorer,
    RouteRequest,
    SessionScorer,
    ShareBoundFilter,
    pick,
    rendezvous,
)


def ep(url: str, **state: float) -> Endpoint:
    e = Endpoint(EndpointSpec(url))
    for k, v in state.items():
        setattr(e, k, v)
    return e


def test_prefix_scorer_credits_tiers() -> None:
    tiers = TierWeights(GPU=1.0, CPU=0.5, STORAGE=0.25)
    eps = [ep("a"), ep("b"), ep("c"), ep("d")]
    req = RouteRequest(
        hashes=[1, 2, 3, 4],
        matches={
            "a": PrefixMatch(4, gpu=4),
            "b": PrefixMatch(4, cpu=4),
            "c": PrefixMatch(2, gpu=1, storage=1),
        },
    )
    assert PrefixScorer(tiers).score(req, eps) == [1.0, 0.5, (1 + 0.25) / 4, 0.0]
    pred = RouteRequest(hashes=[1, 2], matches={"a": PrefixMatch(2, predicted=2)})
    assert PrefixScorer(tiers).score(pred, eps[:1]) == [1.0]
    assert PrefixScorer(tiers).score(RouteRequest(), eps) == [0.0] * 4


def test_prefill_cost_counts_uncached_tokens_and_the_queue() -> None:
    tiers = TierWeights(GPU=1.0, CPU=0.5, STORAGE=0.25)
    s = PrefillCostScorer(tiers, block_size=32, queue_weight=0.5)
    eps = [ep("gpu"), ep("cpu"), ep("none"), ep("none-queued", pending_prefill=400)]
    req = RouteRequest(
        hashes=[1, 2, 3, 4],
        matches={"gpu": PrefixMatch(4, gpu=3, predicted=1), "cpu": PrefixMatch(4, cpu=4)},
        prompt_tokens=140,
    )
    # 140 tokens, 4 full blocks of 32 cached: 12 left on GPU; a CPU hit saves half of each block.
    assert [s.cost(req, e) for e in eps] == [12.0, 76.0, 140.0, 140.0 + 200.0]
    assert s.score(req, eps) == pytest.approx([1.0, 13 / 77, 13 / 141, 13 / 341])
    # A fully cached prompt still computes its last token; character blocks stand in for token blocks.
    assert (
        s.cost(RouteRequest(hashes=[1], matches={"gpu": PrefixMatch(1, gpu=1)}, prompt_tokens=32), eps[0])
        == 1.0
    )
    assert s.cost(RouteRequest(hashes=[1, 2], matches={"gpu": PrefixMatch(1, gpu=1)}), eps[0]) == 32.0
    assert s.score(RouteRequest(), eps[:2]) == [1.0, 1.0]
    # A prompt no engine holds: the same queue weight (cache room, not this prefill, decides placement).
    cold = RouteRequest(hashes=[7, 8], prompt_tokens=64)
    assert [s.cost(cold, e) for e in eps[2:]] == [64.0, 64.0 + 200.0]


def test_prefill_keeps_a_follow_up_on_its_busy_holder_unless_prefill_queues_there() -> None:
    """The failure measured in `make bench-router` with a share score: a holder running four cache hits
    lost a follow-up to an idle engine, which then recomputed the whole document."""
    tiers = TierWeights()
    req = RouteRequest(hashes=list(range(26)), matches={"holder": PrefixMatch(24, gpu=24)}, prompt_tokens=850)
    scorers = [(PrefillCostScorer(tiers, 32, 0.5), 1.0), (LoadScorer(), 0.2), (KvUsageScorer(), 0.1)]
    hits_queued = [ep("holder", in_flight=4, pending_prefill=4 * 80), ep("idle")]
    assert pick(req, hits_queued, scorers)[0].endpoint.url == "holder"
    # The share score with the old weights gave this request away.
    old = [(PrefixScorer(tiers), 1.0), (LoadScorer(), 2.0)]
    assert pick(req, hits_queued, old)[0].endpoint.url == "idle"
    # Three cold documents queued at the holder: recomputing elsewhere is faster.
    cold_queued = [ep("holder", in_flight=3, pending_prefill=3 * 850), ep("idle")]
    assert pick(req, cold_queued, scorers)[0].endpoint.url == "idle"


def test_with_copy_with_room_an_uncached_token_counts_once_where_the_copy_evicts_nothing() -> None:
    """copyWithRoom: the queue weight's discount stands for the evictions a copy causes; at an engine
    with room for the prompt's new blocks the cost is the TTFT estimate (queue + own prefill)."""
    tiers = TierWeights()
    req = RouteRequest(hashes=list(range(26)), matches={"holder": PrefixMatch(24, gpu=24)}, prompt_tokens=850)
    holder = ep("holder", in_flight=2, pending_prefill=2 * 850)  # two cold documents queued there
    idle = ep("idle")
    plain = PrefillCostScorer(tiers, 32, 0.25)
    aware = PrefillCostScorer(tiers, 32, 0.25, room_aware=True)
    # Off, or on without room anywhere: the follow-up waits for its holder (82 + 1,700 / 4 < 850).
    assert plain.score(req, [holder, idle])[0] == 1.0
    assert aware.score(req, [holder, idle])[0] == 1.0
    assert aware.cost(req, holder) == pytest.approx(plain.cost(req, holder) / 0.25)
    # The idle engine has room for the copy: 850 tokens of prefill there beat 1,700 queued + 4 x 82 at home.
    roomy = RouteRequest(req.hashes, req.matches, prompt_tokens=850, with_room=frozenset({"idle"}))
    assert aware.cost(roomy, idle) == 850.0
    assert aware.cost(roomy, holder) == pytest.approx(1700 + 4 * 82)
    assert aware.score(roomy, [holder, idle])[1] == 1.0
    assert plain.score(roomy, [holder, idle])[0] == 1.0  # off: the room is not looked at
    # With a queue too short to outweigh the copy's prefill, the holder keeps it even where there is room.
    short = ep("holder", in_flight=1, pending_prefill=300)
    assert aware.score(roomy, [short, idle])[0] == 1.0


async def test_copy_with_room_asks_the_fit_scorer_which_engines_have_room() -> None:
    r = _router("kv-aware", copyWithRoom=True)
    a, b, c = r.pool.all()
    a.kv_blocks, b.kv_blocks, c.kv_blocks = 4, 100, 0  # c: pool size unknown
    fit = r._scorer(FitScorer)
    assert fit is not None
    fit.on_routed(a, time.monotonic(), [101, 102])  # two of a's four blocks in demand
    d = await r.decide(_req(list(range(12))))  # three blocks, held by nobody
    assert d.request is not None and d.request.with_room == frozenset({b.url})
    off = _router("kv-aware")
    for e in off.pool.all():
        e.kv_blocks = 100
    d = await off.decide(_req(list(range(12))))
    assert d.request is not None and d.request.with_room == frozenset()  # only computed when on


def test_prefill_ticket_counts_until_done() -> None:
    e = ep("a")
    first, second = PrefillTicket(e, 100), PrefillTicket(e, 30)
    assert e.pending_prefill == 130
    first.done()
    first.done()  # idempotent: the first token and the end of the attempt both call it
    assert e.pending_prefill == 30
    second.done()
    assert e.pending_prefill == 0


def test_load_scorer_prefers_less_loaded() -> None:
    eps = [ep("a", in_flight=3), ep("b", running=1, waiting=2), ep("c")]
    # load = max(in_flight, running) + waiting: a=3, b=3, c=0
    assert LoadScorer().score(RouteRequest(), eps) == [0.25, 0.25, 1.0]
    assert LoadScorer().score(RouteRequest(), [ep("x"), ep("y")]) == [1.0, 1.0]


def test_kv_usage_scorer() -> None:
    eps = [ep("a", kv_usage=0.9), ep("b", kv_usage=0.0), ep("c", kv_usage=1.5)]
    assert KvUsageScorer().score(RouteRequest(), eps) == pytest.approx([0.1, 1.0, 0.0])


def test_session_scorer_is_sticky_and_spreads() -> None:
    eps = [ep(f"http://e{i}") for i in range(4)]
    s = SessionScorer()
    assert s.score(RouteRequest(), eps) == [0.0] * 4
    chosen = {s.score(RouteRequest(session=f"user-{i}"), eps).index(1.0) for i in range(40)}
    assert len(chosen) > 1  # different sessions land on different endpoints
    one = s.score(RouteRequest(session="user-7"), eps)
    assert one == s.score(RouteRequest(session="user-7"), list(eps)) and sum(one) == 1.0


def test_bounded_load_filter() -> None:
    f = BoundedLoadFilter(factor=1.5)
    eps = [ep("a", in_flight=6), ep("b", in_flight=1), ep("c", in_flight=1)]
    # cap = ceil(1.5 * (8 + 1) / 3) = 5: a (6 + 1 > 5) is filtered out
    assert [e.url for e in f.filter(RouteRequest(), eps)] == ["b", "c"]
    assert [e.url for e in f.filter(RouteRequest(), eps[:1])] == ["a"]  # never empty
    even = [ep("a", in_flight=2), ep("b", in_flight=2)]
    assert len(f.filter(RouteRequest(), even)) == 2


def test_bounded_load_slack_keeps_a_prefix_group_together_at_low_concurrency() -> None:
    # 5 in flight over 3 engines, 3 of them on the prefix holder: fair share (5 + 1) / 3 = 2.
    eps = [ep("holder", in_flight=3), ep("b", in_flight=1), ep("c", in_flight=1)]
    # Factor alone: cap ceil(1.5 * 2) = 3, the holder (3 + 1) is filtered out and the prefix misses.
    assert "holder" not in [e.url for e in BoundedLoadFilter(1.5).filter(RouteRequest(), eps)]
    # With slack 2: cap max(3, 2 + 2) = 4, the holder stays eligible.
    assert "holder" in [e.url for e in BoundedLoadFilter(1.5, slack=2).filter(RouteRequest(), eps)]
    # At high concurrency the factor dominates: 60 in flight, fair ~20.3, cap 31, slack irrelevant.
    hot = [ep("holder", in_flight=31), ep("b", in_flight=15), ep("c", in_flight=14)]
    assert "holder" not in [e.url for e in BoundedLoadFilter(1.5, slack=2).filter(RouteRequest(), hot)]


def _share_bound(over: set[str], sent: dict[str, float] | None = None) -> ShareBoundFilter:
    f = ShareBoundFilter(1.3, 2.0, 30.0, lambda e, t: e.url in over)
    f.sent = {url: (n, 100.0) for url, n in (sent or {}).items()}
    return f


def _kept(f: ShareBoundFilter, eps: list[Endpoint], now: float = 100.0) -> list[str]:
    return [e.url for e in f.filter(RouteRequest(now=now), eps)]


def test_share_bound_gives_one_conversation_of_an_engine_short_of_room_to_one_with_room() -> None:
    eps = [ep("hot"), ep("b"), ep("c")]
    # fair (16 + 1) / 3 = 5.67, cap max(1.3 x 5.67, 5.67 + 2) = 7.67: hot (8 + 1) is over it.
    share = {"hot": 8.0, "b": 4.0, "c": 4.0}
    f = _share_bound(over={"hot"}, sent=share)
    assert _kept(f, eps) == ["b", "c"]
    # One at a time: for a window after it gave a request away it keeps its requests (the counts show
    # the move only a window later), then it may give again.
    assert _kept(f, eps, now=110.0) == ["hot", "b", "c"]
    f.sent = {url: (n, 131.0) for url, n in share.items()}
    assert _kept(f, eps, now=131.0) == ["b", "c"]
    # The same share on an engine with room to spare: its groups stay together.
    assert _kept(_share_bound(over=set(), sent=share), eps) == ["hot", "b", "c"]
    # No engine with room to take it (all short of room): nothing moves.
    assert _kept(_share_bound(over={"hot", "b", "c"}, sent=share), eps) == ["hot", "b", "c"]
    # Within its share (over it only by the slack) nothing is dropped: 6 against 4 and 4.
    assert len(_kept(_share_bound(over={"hot"}, sent={"hot": 6.0, "b": 4.0, "c": 4.0}), eps)) == 3
    # Never empty, and an engine that left is forgotten.
    assert _kept(_share_bound(over={"hot"}, sent=share), eps[:1]) == ["hot"]
    f.on_routed(eps[0], 131.0)
    f.on_removed(eps[0])
    assert f.recent(eps[0], 131.0) == 0.0 and "hot" not in f.gave_at


def test_share_bound_counts_fade_with_the_window() -> None:
    f = _share_bound(over={"hot"})
    hot, b, c = ep("hot"), ep("b"), ep("c")
    for _ in range(8):
        f.on_routed(hot, 0.0)
    for _ in range(4):
        f.on_routed(b, 0.0)
        f.on_routed(c, 0.0)
    assert f.recent(hot, 30.0) == pytest.approx(8 * faded(1.0, 30.0, 30.0))
    assert "hot" not in _kept(f, [hot, b, c], now=0.0)
    # Two windows on, nothing new routed: 8 x e^-2 = 1.08 against 0.54 each, inside fair + slack.
    assert "hot" in _kept(f, [hot, b, c], now=60.0)


def test_cache_room_sends_an_unknown_prompt_to_the_emptiest_cache() -> None:
    eps = [ep("full"), ep("half"), ep("empty")]
    req = RouteRequest(hashes=[1], cached_blocks={"full": 120, "half": 60, "empty": 0})
    scores = CacheRoomScorer().score(req, eps)
    assert scores[2] == 1.0 and scores[0] < scores[1] < scores[2]
    ranked = pick(req, eps, [(LoadScorer(), 0.5), (CacheRoomScorer(), 1.0)])
    assert ranked[0].endpoint.url == "empty"
    # Once an engine holds the prompt's prefix, the prefix scorer decides alone.
    held = RouteRequest(hashes=[1], matches={"full": PrefixMatch(1, gpu=1)}, cached_blocks={"full": 120})
    assert CacheRoomScorer().score(held, eps) == [0.0, 0.0, 0.0]


def test_recent_requests_fade_with_age() -> None:
    e, recent = ep("a"), RecentScorer(10.0)
    recent.on_routed(e, 100.0)
    recent.on_routed(e, 100.0)
    assert recent.recent_requests(e, 100.0) == 2.0
    assert recent.recent_requests(e, 110.0) == pytest.approx(2 / 2.718281828, rel=1e-6)
    recent.on_routed(e, 110.0)  # the old ones have faded, the new one counts in full
    assert recent.recent_requests(e, 110.0) == pytest.approx(1 + 2 / 2.718281828, rel=1e-6)
    recent.on_removed(e)  # the scorer owns this state, and forgets an endpoint that left
    assert recent.recent_requests(e, 110.0) == 0.0
    assert faded(5.0, -3.0, 10.0) == 5.0  # clock skew never inflates
    assert faded(5.0, 1.0, 0.0) == 0.0


def test_recent_scorer_prefers_the_engine_with_fewer_live_conversations() -> None:
    eps = [ep("busy"), ep("quiet"), ep("new")]
    recent = RecentScorer(10.0)
    for url, times in (("busy", [1.0, 2.0, 3.0]), ("quiet", [0.0])):
        for t in times:
            recent.on_routed(next(e for e in eps if e.url == url), t)
    scores = recent.score(RouteRequest(now=3.0), eps)
    assert scores[2] == 1.0 and scores[0] < scores[1] < scores[2]
    # A prompt some engine holds is the prefix scores' business: a follow-up must not leave its holder
    # for an engine that holds less of it because the holder is busy with its conversations.
    held = RouteRequest(
        hashes=[1, 2], matches={"busy": PrefixMatch(2, gpu=2), "quiet": PrefixMatch(1, gpu=1)}, now=3.0
    )
    assert recent.score(held, eps) == [0.0, 0.0, 0.0]


def test_a_new_document_goes_where_fewer_follow_ups_are_coming_with_default_weights() -> None:
    """The case measured in the open-loop bench: the emptiest-looking engine still decodes its one
    conversation's last answer (one in flight), another has two conversations between turns."""
    r = _router("kv-aware")
    a, b, c = r.pool.all()
    recent = _recent(r)
    for e, sent in ((a, [0.0, 2.1, 6.6, 8.1]), (b, [4.1]), (c, [0.4, 5.3])):
        for t in sent:
            recent.on_routed(e, t)
    b.in_flight = 1
    req = RouteRequest(hashes=[7], tie_key=b"doc", cached_blocks={a.url: 64, b.url: 52, c.url: 56}, now=8.6)
    assert pick(req, [a, b, c], r.scorers)[0].endpoint is b
    without = [(s, w) for s, w in r.scorers if s.name != "recent"]
    assert pick(req, [a, b, c], without)[0].endpoint is c  # what it did before


def test_picker_combines_weighted_scores() -> None:
    eps = [ep("busy-holder", in_flight=4), ep("idle")]
    req = RouteRequest(hashes=[1, 2], matches={"busy-holder": PrefixMatch(2, gpu=2)}, tie_key=b"k")
    scorers = [(PrefixScorer(TierWeights()), 1.0), (LoadScorer(), 0.5)]
    ranked = pick(req, eps, scorers)
    assert [r.endpoint.url for r in ranked] == ["busy-holder", "idle"]
    assert ranked[0].scores == {"prefix": 1.0, "load": pytest.approx(0.2)}
    # With load weighted heavily, the idle endpoint wins despite the prefix.
    ranked = pick(req, eps, [(PrefixScorer(TierWeights()), 1.0), (LoadScorer(), 2.0)])
    assert ranked[0].endpoint.url == "idle"
    # A zero weight removes the scorer from the decision.
    assert "load" not in pick(req, eps, [(PrefixScorer(TierWeights()), 1.0), (LoadScorer(), 0.0)])[0].scores


def test_picker_ties_follow_rendezvous_of_the_tie_key() -> None:
    eps = [ep(f"http://e{i}") for i in range(3)]
    winners = set()
    for key in (b"a", b"b", b"c", b"d", b"e", b"f"):
        ranked = pick(RouteRequest(tie_key=key), eps, [(LoadScorer(), 1.0)])
        want = max(eps, key=lambda e: rendezvous(key, e.url)).url
        assert ranked[0].endpoint.url == want
        winners.add(want)
    assert len(winners) > 1


def _router(policy: str, **extra: object) -> Router:
    settings = RouterSettings.model_validate(
        {
            "model": "m",
            "blockSize": 4,
            "policy": policy,
            "remoteTokenize": False,
            "approxChunkChars": 4,
            **extra,
        }
    )
    r = Router(settings, RouterMetrics())
    r.pool.replace([EndpointSpec("http://a"), EndpointSpec("http://b"), EndpointSpec("http://c")])
    return r


def _evicts(r: Router) -> EvictsScorer:
    (scorer,) = [s for s, _ in r.scorers if isinstance(s, EvictsScorer)]
    return scorer


def _recent(r: Router) -> RecentScorer:
    (scorer,) = [s for s, _ in r.scorers if isinstance(s, RecentScorer)]
    return scorer


def test_every_policy_and_scorer_is_registered() -> None:
    assert set(POLICIES) == set(get_args(Policy))
    assert set(SCORERS) == set(Weights.model_fields)  # each scorer's weight is a settings field
    for policy in POLICIES:
        r = _router(policy)
        assert [s.name for s, _ in r.scorers] == list(SCORERS)
        r.close()


def _req(prompt: object) -> object:
    import json

    return parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), "completion", "m")


async def test_the_gate_sees_spare_room_where_the_fit_scorers_demand_leaves_it() -> None:
    """moveToSpareRoom's question to the router: do ``n`` more blocks fit in an engine's pool beside
    every block routed there in the last fitWindowSeconds? A prompt of 8 blocks routed to a fills its
    demand; b was routed nothing; a pool of unknown size never has spare room."""
    r = _router("kv-aware", fitWindowSeconds=30)
    a, b, c = r.pool.all()
    a.kv_blocks = b.kv_blocks = 10
    d = await r.decide(_req(list(range(32))))  # 8 blocks of 4 tokens
    r.commit(d, a)
    spare, now = r.gate.deps.spare_room, time.monotonic()
    assert spare(a, 2, now) and not spare(a, 3, now)
    assert spare(b, 10, now) and not spare(b, 11, now)
    assert not spare(c, 1, now)  # pool size unknown
    assert spare(a, 10, now + 31)  # the window has passed: nothing there is demanded
    r.close()


async def test_with_surviving_match_an_engine_that_will_have_evicted_the_prompt_scores_as_holding_none() -> (
    None
):
    """survivingMatch: the scorers see what an engine will still hold when the prompt can start there.
    Engine a holds the prompt's three blocks, but runs a request pinning its whole pool: it drops out of
    the scored matches (the decision keeps the index's own, for the header and the log)."""
    for on in (True, False):
        r = _router("kv-aware", survivingMatch=on)
        a = r.pool.all()[0]
        for e in r.pool.all():
            e.kv_blocks = 5  # 4 usable blocks of 4 tokens
        first = await r.decide(_req(list(range(12))))
        r.index.predict(a.url, first.hashes, 60.0)
        running = await r.decide(_req(list(range(100, 116))))  # four blocks, pinned on a
        r.gate.claim(a, running, 0)
        d = await r.decide(_req(list(range(12))))
        assert d.request is not None and set(d.matches) == {a.url}
        assert set(d.request.matches) == (set() if on else {a.url})


async def test_kv_aware_reasons_and_predictions() -> None:
    r = _router("kv-aware")
    tokens = list(range(12))  # three blocks of 4
    d = await r.decide(_req(tokens))
    assert d.reason == "tie-hash" and len(d.hashes) == 3 and not d.approximate
    r.commit(d, d.order[0])
    d2 = await r.decide(_req(tokens))
    assert d2.reason == "prefix" and d2.order[0] is d.order[0]
    # 12 tokens = 3 full blocks all cached, but the engine recomputes the last token: 2 blocks hit.
    assert d2.predicted_cached_tokens(d2.order[0], 4) == 8
    d2b = await r.decide(_req([*tokens, 50]))
    assert d2b.predicted_cached_tokens(d2b.order[0], 4) == 12
    # The holder is now overloaded: bounded load moves the request, and says so.
    d.order[0].in_flight = 10
    d3 = await r.decide(_req(tokens))
    assert d3.reason == "bounded-load" and d3.order[0] is not d.order[0]
    assert d3.order[-1] is d.order[0]  # still a last-resort retry target
    # A different load on otherwise equal endpoints decides by load.
    d.order[0].in_flight = 0
    d.order[1].in_flight = 1
    d4 = await r.decide(_req([99, 98, 97, 96]))
    assert d4.reason in ("load", "tie-hash") and d4.order[0] is not d.order[1]
    # Cold prefill queued at the holder outweighs its match: the request goes elsewhere, and says so.
    d.order[1].in_flight = 0
    d.order[0].pending_prefill = 1000
    d5 = await r.decide(_req(tokens))
    assert d5.reason == "queue" and d5.order[0] is not d.order[0]
    # 12 tokens: all 3 blocks cached at the holder, yet the last token is always computed.
    assert d5.uncached_tokens(d5.order[0], 4) == 12 and d5.uncached_tokens(d.order[0], 4) == 1


async def test_kv_aware_says_when_recent_traffic_decided() -> None:
    r = _router("kv-aware")
    eps = r.pool.all()
    recent = _recent(r)
    for busiest in (eps[0], eps[2]):
        recent.sent.clear()
        now = time.monotonic()
        for e, n in zip(eps, (2, 1, 2) if busiest is eps[0] else (2, 2, 1), strict=True):
            for _ in range(n):
                recent.on_routed(e, now)
        d = await r.decide(_req([100, 101, 102, 103]))  # no engine holds it
        quiet = min(eps, key=lambda e: recent.recent_requests(e, now))
        assert d.order[0] is quiet and d.reason == "recent"
    before = recent.recent_requests(d.order[0], time.monotonic())
    r.commit(d, d.order[0])
    assert recent.recent_requests(d.order[0], time.monotonic()) > before + 0.9  # sending counts


async def test_prediction_holds_until_the_prefill_is_over() -> None:
    r = _router("kv-aware")
    now = [100.0]
    r.index = BlockIndex(1000, clock=lambda: now[0])
    tokens = list(range(12))
    d = await r.decide(_req(tokens))
    r.commit(d, d.order[0])
    now[0] += 60  # a slow prefill: far past the 5 s prediction TTL
    again = await r.decide(_req(tokens))
    assert again.reason == "prefix" and again.order[0] is d.order[0]
    r.settle(d, d.order[0])  # first token: the engine's events take over within moments
    now[0] += 6
    assert (await r.decide(_req(tokens))).matches == {}


async def test_round_robin_least_load_prefix_hash() -> None:
    rr = _router("round-robin")
    firsts = [(await rr.decide(_req("x"))).order[0].url for _ in range(6)]
    assert sorted(set(firsts)) == ["http://a", "http://b", "http://c"] and firsts[:3] == firsts[3:]

    ll = _router("least-load")
    for e, n in zip(ll.pool.all(), (3, 0, 5), strict=True):
        e.in_flight = n
    d = await ll.decide(_req("x"))
    assert [e.url for e in d.order] == ["http://b", "http://a", "http://c"] and d.reason == "least-load"

    ph = _router("prefix-hash")
    same = {(await ph.decide(_req("abcd" + str(i)))).order[0].url for i in range(5)}
    assert len(same) == 1  # same first block → same endpoint
    spread = {(await ph.decide(_req(f"{i:04d}tail"))).order[0].url for i in range(30)}
    assert len(spread) > 1


def test_evicts_scorer_prefers_the_engine_whose_evicted_blocks_were_used_longest_ago() -> None:
    evicts = EvictsScorer(window_s=10.0)
    a, b, c = ep("a", kv_blocks=6), ep("b", kv_blocks=6), ep("c", kv_blocks=6)
    evicts.on_routed(a, 10.0, [1, 2, 3, 4])
    evicts.on_routed(a, 19.0, [5, 6, 7, 8])  # a's pool: a group used 1 s ago beside an older one
    evicts.on_routed(b, 12.0, [11, 12, 13, 14, 15, 16])
    evicts.on_routed(c, 15.0, [21, 22, 23, 24, 25, 26])
    cold = RouteRequest(hashes=[900, 901, 902, 903], now=20.0)  # 4 new blocks: each pool keeps 2
    assert [evicts.evicted_age(cold, e) for e in (a, b, c)] == [1.0, 8.0, 5.0]
    # The share of each one's use that has faded on the 10 s scale.
    faded_share = [1.0 - math.exp(-age / 10.0) for age in (1.0, 8.0, 5.0)]
    assert evicts.score(cold, [a, b, c]) == pytest.approx(faded_share)
    # Two new blocks: a keeps its newest group (4 blocks) and evicts only the one used 10 s ago.
    small = RouteRequest(hashes=[900, 901], now=20.0)
    assert evicts.evicted_age(small, a) == 10.0
    # An engine that would evict nothing this router sent there scores 1.
    assert evicts.score(cold, [a, b, ep("d", kv_blocks=6)]) == pytest.approx([*faded_share[:2], 1.0])
    # Blocks all used a moment ago score alike near 0: milliseconds do not tell engines apart.
    first = EvictsScorer(window_s=10.0)
    for i, e in enumerate((a, b, c)):
        first.on_routed(e, 30.0 + i / 1000, [300 + 10 * i + k for k in range(6)])
    burst = RouteRequest(hashes=[900, 901, 902, 903], now=30.003)
    assert all(0 < v < 0.001 for v in first.score(burst, [a, b, c]))
    # Silent: a prompt some engine holds, an unknown pool size, all alike, the character fallback.
    held = RouteRequest(hashes=[1, 900], matches={"a": PrefixMatch(1, gpu=1)}, now=20.0)
    assert evicts.score(held, [a, b, c]) == [0.0, 0.0, 0.0]
    assert evicts.score(cold, [a, ep("x")]) == [0.0, 0.0]
    assert evicts.score(cold, [ep("y", kv_blocks=6), ep("z", kv_blocks=6)]) == [0.0, 0.0]
    approx = RouteRequest(hashes=[900, 901, 902, 903], approximate=True, now=20.0)
    assert evicts.score(approx, [a, b, c]) == [0.0, 0.0, 0.0]
    evicts.on_removed(a)
    assert evicts.evicted_age(cold, a) == float("inf")


def test_evicts_keeps_no_more_blocks_per_engine_than_it_can_weigh() -> None:
    evicts = EvictsScorer(window_s=10.0)
    a = ep("a", kv_blocks=4)
    evicts.on_routed(a, 3.0, list(range(100, 5000)))
    assert len(evicts.used["a"]) == 1024  # max(pool, 1024): nothing older is ever weighed


def test_a_huge_prompt_touches_only_the_blocks_the_recency_bounds_keep() -> None:
    """Fit and evicts keep at most a few pools' worth of blocks per engine, newest last; touching only a
    huge prompt's last blocks leaves each in the state that touching them all, then trimming, did."""
    from kvstrata_native import Recency

    a = ep("a", kv_blocks=1500)
    fit, evicts = FitScorer(window_s=30.0), EvictsScorer(window_s=10.0)
    earlier, huge = list(range(1, 3001)), list(range(10_000, 48_000))
    for scorer, recency, limit in ((fit, fit.demand, 4 * 1500), (evicts, evicts.used, 1500)):
        want = Recency()
        for at, hashes in ((1.0, earlier), (2.0, huge)):
            scorer.on_routed(a, at, hashes)
            want.touch(hashes, at)
            want.trim(limit)
        got = recency["a"]
        assert len(got) == len(want) == limit
        assert [got.touched_at_rank(i) for i in range(limit + 1)] == [
            want.touched_at_rank(i) for i in range(limit + 1)
        ]


async def test_an_evicted_prefix_goes_where_its_prefill_evicts_the_coldest_blocks() -> None:
    """Family draw 338: the group's home held another tenant's prompt used a moment ago, the other
    engines prompts used seconds before; going home evicted the hot prompt and both tenants missed."""
    from kvstrata.router.events import BlockRemoved, BlockStored

    r = _router("kv-aware")
    eps = r.pool.all()
    for e in eps:
        e.kv_blocks = 4
    tokens = list(range(12))  # three blocks of 4
    d = await r.decide(_req(tokens))
    home = d.order[0]
    r.commit(d, home)
    r.settle(d, home)
    r.index.apply(home.url, BlockStored(tuple(d.hashes), None, (), 4, "GPU"))
    r.index.apply(home.url, BlockRemoved(tuple(d.hashes), "GPU"))
    now = time.monotonic()
    (fit,) = [s for s, _ in r.scorers if isinstance(s, FitScorer)]
    for i, e in enumerate(eps):  # every pool thrashes: the fit scorer is silent, as in that draw
        fit.on_routed(e, now, [1000 + 10 * i + k for k in range(6)])
    others = [e for e in eps if e is not home]
    evicts = _evicts(r)
    for i, e in enumerate(others):
        evicts.on_routed(e, now - 8.0 - i, [600 + 10 * i + k for k in range(4)])
    evicts.on_routed(home, now - 0.5, [500, 501, 502, 503])  # another tenant's prompt, just used
    again = await r.decide(_req([*tokens, 77, 78, 79, 80]))
    assert again.matches == {} and again.order[0] is others[1] and again.reason == "evicts"
    # Where its home's blocks are as cold as the coldest elsewhere, the group still goes home.
    evicts.used[home.url].trim(0)
    evicts.on_routed(home, now - 9.0, [700, 701, 702, 703])
    home_again = await r.decide(_req([*tokens, 77, 78, 79, 81]))
    assert home_again.order[0] is home and home_again.reason == "history"


async def routed_then_evicted(r: Router, tokens: list[int]) -> tuple[Decision, Endpoint]:
    """``tokens`` routed, cached at the engine chosen, then all evicted there by memory pressure."""
    from kvstrata.router.events import BlockRemoved, BlockStored

    d = await r.decide(_req(tokens))
    home = d.order[0]
    r.commit(d, home)
    r.settle(d, home)
    r.index.apply(home.url, BlockStored(tuple(d.hashes), None, (), 4, "GPU"))
    r.index.apply(home.url, BlockRemoved(tuple(d.hashes), "GPU"))
    return d, home


async def test_an_evicted_prefix_goes_back_to_the_engine_that_held_it() -> None:
    from kvstrata.router.events import BlockStored

    r = _router("kv-aware")
    eps = r.pool.all()
    tokens = list(range(12))
    _, home = await routed_then_evicted(r, tokens)
    # The home now holds the most blocks and had the most recent traffic: room and recency alone
    # would send the group elsewhere.
    r.index.apply(home.url, BlockStored((500, 501, 502), None, (), 4, "GPU"))
    _recent(r).on_routed(home, time.monotonic())
    again = await r.decide(_req([*tokens, 77, 78, 79, 80]))
    assert again.matches == {} and again.order[0] is home and again.reason == "history"
    # Its queue still counts: a long prefill queued at the home sends the group to an idle engine.
    home.pending_prefill = 10_000
    busy = await r.decide(_req(tokens))
    assert busy.order[0] is not home and busy.order[0] in eps


def test_fit_scorer_packs_groups_where_they_fit_and_spares_engines_that_fit() -> None:
    fit = FitScorer(window_s=30.0)
    a, b, c = ep("a", kv_blocks=10), ep("b", kv_blocks=10), ep("c", kv_blocks=10)
    fit.on_routed(a, 100.0, list(range(8)))  # 8 of 10 blocks in demand
    fit.on_routed(b, 100.0, list(range(100, 103)))  # 3 of 10
    fit.on_routed(c, 100.0, list(range(200, 215)))  # 15: over its pool already, thrashing
    cold = RouteRequest(hashes=[900, 901, 902, 903], now=101.0)
    # b fits the 4 new blocks; c thrashes anyway; a would be pushed from fitting into thrashing.
    assert fit.score(cold, [a, b, c]) == [0.0, 1.0, 0.5]
    # The blocks a prompt shares with what an engine holds are not added again.
    held = RouteRequest(hashes=[0, 1, 2, 3, 904], matches={"a": PrefixMatch(4, gpu=4)}, now=101.0)
    assert fit.score(held, [a, c]) == [1.0, 0.5]
    # Demand fades with the window; unknown pool sizes or equal scores say nothing.
    assert fit.demand_blocks(a, 200.0) == 0
    assert fit.score(cold, [a, ep("x")]) == [0.0, 0.0]
    assert fit.score(RouteRequest(hashes=[1], now=200.0), [a, b]) == [0.0, 0.0]
    fit.on_removed(c)
    assert fit.demand_blocks(c, 101.0) == 0


def test_fit_demand_counts_distinct_blocks_and_stays_bounded() -> None:
    fit = FitScorer(window_s=30.0)
    a = ep("a", kv_blocks=8)
    fit.on_routed(a, 1.0, [1, 2, 3])
    fit.on_routed(a, 2.0, [1, 2, 3, 4])  # a group's second user: only the new block adds demand
    assert fit.demand_blocks(a, 3.0) == 4
    fit.on_routed(a, 40.0, [1])  # refreshed: block 1 stays in demand, 2-4 age out
    assert fit.demand_blocks(a, 40.0) == 1
    fit.on_routed(a, 41.0, list(range(10_000)))
    assert len(fit.demand["a"]) == 4 * 1024


async def test_a_retry_tries_engines_heard_from_before_silent_ones() -> None:
    """A silent engine (no scrape answered, nothing streamed within a first-byte period: wedged, not yet
    ejected) is tried last on a retry whatever its rank; with none heard from, the ranking stands."""
    import time

    r = _router("kv-aware")
    tokens = list(range(12))
    d = await r.decide(_req(tokens))
    r.commit(d, d.order[0])
    d = await r.decide(_req(tokens))
    holder, *others = d.order
    left = [holder, *others]
    assert r.retry_order(d, left)[0] is holder  # its prefix match ranks it first
    now = time.monotonic()
    for e in others:
        e.answered_at = now
    assert r.retry_order(d, left)[-1] is holder
    others[0].answered_at = 0.0
    others[0].streamed_at = now  # streaming counts as heard from too
    assert r.retry_order(d, left)[-1] is holder
    r.close()


async def _doubled_traffic(r: Router, pool: int) -> list[tuple[str, bool]]:
    """Four prefix groups of three blocks on three engines of ``pool`` blocks each, then the engine that
    got two of them hears from both, six times: (reason, sent to that engine) per request."""
    for e in r.pool.all():
        e.kv_blocks = pool
    prompts = [[g * 100 + i for i in range(12)] for g in range(4)]
    home: dict[int, Endpoint] = {}
    for g, tokens in enumerate(prompts):
        d = await r.decide(_req(tokens))
        home[g] = d.order[0]
        r.commit(d, d.order[0])
    (doubled,) = [e for e in r.pool.all() if sum(h is e for h in home.values()) == 2]
    seen = []
    for _ in range(6):
        for g in (g for g, h in home.items() if h is doubled):
            d = await r.decide(_req(prompts[g]))
            seen.append((str(d.reason), d.order[0] is doubled))
            r.commit(d, d.order[0])
    r.close()
    return seen


async def test_share_bound_moves_a_group_off_an_engine_that_is_short_of_room_and_says_so() -> None:
    # Pools of 5 blocks: the doubled engine was routed more than its pool and has more than its share,
    # so a request of one of its groups goes elsewhere, with the reason.
    seen = await _doubled_traffic(_router("kv-aware", shareBoundFactor=1.3), pool=5)
    assert ("share-bound", False) in seen and ("prefix", True) in seen, seen
    # With room to spare (pools of 1,000 blocks) the same traffic stays with its groups' holder.
    seen = await _doubled_traffic(_router("kv-aware", shareBoundFactor=1.3), pool=1000)
    assert set(seen) == {("prefix", True)}, seen
    # Off by default (it cost hit rate in the family benchmark): the groups stay, short of room or not.
    seen = await _doubled_traffic(_router("kv-aware"), pool=5)
    assert set(seen) == {("prefix", True)}, seen


def test_a_commit_calls_the_hooks_of_exactly_the_scorers_that_have_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router calls ``on_routed`` and ``on_hashed`` only where a scorer overrides the no-op: the
    built-in scorers with state, and a plugin's hook (here one that replaces the load scorer)."""
    from kvstrata.router import scoring
    from kvstrata.router.reasons import Reason

    seen: list[tuple[str, str]] = []

    class Counting(scoring.LoadScorer):
        def on_routed(self, ep: Endpoint, now: float, hashes: object = ()) -> None:
            seen.append(("routed", ep.url))

    monkeypatch.setitem(scoring.SCORERS, "load", lambda s: Counting())
    r = _router("kv-aware")
    assert {type(s).__name__ for s in r._on_routed} == {
        "FitScorer",
        "RecentScorer",
        "EvictsScorer",
        "Counting",
    }
    assert {type(s).__name__ for s in r._on_hashed} == {"FitScorer", "EvictsScorer"}
    ep = r.pool.all()[0]
    r.commit(Decision([ep], Reason.LOAD, hashes=[1, 2]), ep)
    assert seen == [("routed", ep.url)]
    assert _recent(r).recent_requests(ep, time.monotonic()) > 0.9  # a built-in hook ran too
    r.close()
