"""The conversation tracker and the conversation bound alone, then through the router's decisions."""

from __future__ import annotations

from collections import Counter

import pytest
from test_router_scoring import _req, _router, routed_then_evicted

from kvstrata.router.conversations import (
    ConversationBoundFilter,
    ConversationTracker,
    StickyConversationFilter,
)
from kvstrata.router.index import PrefixMatch
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.reasons import Reason
from kvstrata.router.scoring import RouteRequest


def test_a_prompt_continuing_a_tip_moves_the_conversation_and_counts_a_follow_up() -> None:
    t = ConversationTracker(window_s=30.0)
    t.routed("a", 0.0, [1, 2, 3])
    t.routed("b", 0.0, [1, 2, 7])  # the same system prompt, another user: a second conversation
    assert (t.live_on("a", 0.0), t.live_on("b", 0.0)) == (1, 1)
    assert t.continued_tip([1, 2, 3, 4, 5]) == 3 and t.continued_tip([1, 2, 8]) is None
    # The next turn of the first conversation, retried on b: it leaves a.
    t.routed("b", 1.0, [1, 2, 3, 4, 5])
    assert (t.live_on("a", 1.0), t.live_on("b", 1.0)) == (0, 2)
    assert t.follows[0] == 1.0 and t.ended[0] == 0.0
    # The same prompt's full hashes after it was routed on its leading blocks: its tip moves to its
    # last block, and no follow-up is counted.
    t.routed("a", 2.0, [20, 21])
    t.rehashed("a", 2.0, [20, 21], [20, 21, 22, 23])
    assert t.continued_tip([20, 21, 22, 23, 24]) == 23 and 21 not in t.tips
    assert t.live_on("a", 2.0) == 1 and t.follows[0] == 1.0


def test_conversations_quiet_for_a_window_end_and_single_requests_turn_the_bound_off() -> None:
    t = ConversationTracker(window_s=10.0)
    for i in range(4):  # four one-shot prompts over a shared document: none is ever continued
        t.routed("a", float(i), [1, 2, 100 + i])
    assert not t.mostly_multi_turn(5.0)  # no evidence yet: nothing continued
    assert t.live_on("a", 12.5) == 1  # three ended
    assert not t.mostly_multi_turn(12.5)
    # Conversations of two turns: one follow-up per conversation that ends, so the bound holds.
    c = ConversationTracker(window_s=10.0)
    for i in range(4):
        c.routed("a", float(i), [1, 100 + i])
        c.routed("a", float(i) + 0.5, [1, 100 + i, 200 + i])
    assert c.live_on("a", 14.0) == 0 and c.mostly_multi_turn(14.0)
    c.forget("a")
    assert not c.tips and c.live_on("a", 14.0) == 0


def _eps() -> list[Endpoint]:
    return [Endpoint(EndpointSpec(u)) for u in ("a", "b", "c")]


def _bound(window_s: float = 30.0) -> tuple[ConversationBoundFilter, ConversationTracker]:
    t = ConversationTracker(window_s)
    return ConversationBoundFilter(t), t


def test_a_new_conversation_skips_engines_at_their_fair_share_plus_one() -> None:
    f, ft = _bound()
    eps = _eps()
    for url, n in (("a", 3), ("b", 2), ("c", 2)):
        for i in range(n):
            ft.routed(url, 0.0, [ord(url) * 100 + i])
    new = RouteRequest(hashes=[9, 10], now=1.0)
    # Nothing continued yet: no evidence of conversations, nothing bounded.
    assert len(f.filter(new, eps)) == 3
    ft.routed("a", 0.5, [ord("a") * 100, 1])  # a's first conversation's next turn
    # 7 live + this one on 3 engines: floor(8 / 3) + 1 = 3, and a already serves 3.
    assert [e.url for e in f.filter(new, eps)] == ["b", "c"]
    assert f.explain([eps[0]], {"a": PrefixMatch(1)}) is Reason.CONVERSATION_BOUND
    assert f.explain([eps[0]], {"b": PrefixMatch(1)}) is None
    # A follow-up of a's conversation is never moved, nor is anything while the bound is off.
    assert len(f.filter(RouteRequest(hashes=[ord("a") * 100, 1, 5], now=1.0), eps)) == 3
    assert len(ConversationBoundFilter(None).filter(new, eps)) == 3
    # One live on a and one on b: floor(3 / 3) + 1 = 2, so a tenant's next user may still join a; with
    # one live on a alone, floor(2 / 3) + 1 = 1 and it opens on an engine serving none.
    g, gt = _bound()
    gt.routed("a", 0.0, [1])
    gt.routed("a", 0.5, [1, 11])
    gt.routed("b", 0.0, [2])
    assert len(g.filter(new, eps)) == 3
    h, ht = _bound()
    ht.routed("a", 0.0, [1])
    ht.routed("a", 0.5, [1, 11])
    assert [e.url for e in h.filter(new, eps)] == ["b", "c"]
    # The evidence fades: over a window after the one follow-up, a conversation live on a no longer
    # keeps a new one off it (as many continued as ended, but that is one long ago).
    ht.routed("a", 40.0, [50])
    assert ht.live_on("a", 41.0) == 1
    assert len(h.filter(RouteRequest(hashes=[9, 10], now=41.0), eps)) == 3


async def _four_tenants_two_users(*, evidence: bool, **extra: object) -> tuple[list[int], list[str]]:
    """Four tenants' first users open a conversation each, then their second users, and every
    conversation sends a second turn: the conversations per engine (sorted) and the reasons. With
    ``evidence`` the first users' second turns come before the second users open (family draw 409: the
    late users came while the early ones' conversations went on); without, every conversation opens
    before any is continued."""
    r = _router("kv-aware", **extra)
    system = {t: [t * 1000 + i for i in range(8)] for t in range(4)}  # two blocks of 4 each
    prompts = {
        (t, u): [*system[t], *[t * 1000 + 100 * (u + 1) + i for i in range(4)]]
        for t in range(4)
        for u in range(2)
    }
    where: dict[tuple[int, int], Endpoint] = {}
    reasons = []

    async def open_(u: int) -> None:
        for t in range(4):
            d = await r.decide(_req(prompts[t, u]))
            where[t, u] = d.order[0]
            reasons.append(str(d.reason))
            r.commit(d, d.order[0])

    async def continue_(u: int) -> None:
        for t in range(4):
            d = await r.decide(_req([*prompts[t, u], *[7] * 4]))
            assert d.order[0] is where[t, u] and d.reason == "prefix"  # a conversation stays where it opened
            r.commit(d, d.order[0])

    # (step, user) pairs, not coroutines made up front: after a failed step the rest would go unawaited.
    steps = (
        ((open_, 0), (continue_, 0), (open_, 1), (continue_, 1))
        if evidence
        else ((open_, 0), (open_, 1), (continue_, 0), (continue_, 1))
    )
    for step, user in steps:
        await step(user)
    r.close()
    return sorted(Counter(e.url for e in where.values()).values()), reasons


async def test_the_bound_evens_the_conversations_a_tenants_system_prompt_would_pile_up() -> None:
    # Off (the default): each tenant's second user follows its system prompt, so the engine holding
    # two tenants serves four conversations.
    per_engine, _ = await _four_tenants_two_users(evidence=True)
    assert per_engine == [2, 2, 4]
    per_engine, reasons = await _four_tenants_two_users(evidence=True, conversationBound=True)
    assert per_engine == [2, 3, 3]
    assert reasons.count("conversation-bound") == 1, reasons
    # On, but no conversation continued yet (a fresh router): no evidence that these are conversations
    # rather than one-shot requests sharing a system prompt, so nothing is bounded.
    per_engine, reasons = await _four_tenants_two_users(evidence=False, conversationBound=True)
    assert per_engine == [2, 2, 4] and "conversation-bound" not in reasons, reasons


def test_a_turns_expected_growth_is_the_mean_growth_of_follow_ups_times_the_share_continued() -> None:
    t = ConversationTracker(window_s=1000.0)  # a long window: the counters hardly fade in this test
    t.routed("a", 0.0, [1, 2])
    t.routed("b", 0.0, [5, 6])
    assert t.next_turn_blocks(0.0) == 0.0 and t.next_turn_growth(["a", "b"], 0.0, [9]) == {}  # no evidence
    t.routed("a", 1.0, [1, 2, 3, 4])  # two blocks past its tip
    t.routed("b", 1.0, [5, 6, 7, 8, 9, 10])  # four
    assert t.next_turn_blocks(1.0) == pytest.approx(3.0, rel=1e-2)  # all continued: the mean growth
    # A new prompt: every live conversation counts; a follow-up: not its own conversation.
    assert t.next_turn_growth(["a", "b", "c"], 1.0, [9]) == pytest.approx(
        {"a": 3.0, "b": 3.0, "c": 0.0}, rel=1e-2
    )
    assert t.next_turn_growth(["a", "b"], 1.0, [1, 2, 3, 4, 11]) == pytest.approx(
        {"a": 0.0, "b": 3.0}, rel=1e-2
    )
    # Two conversations that end (quiet for a window) for two continued: half the growth is expected.
    s = ConversationTracker(window_s=10.0)
    s.routed("a", 0.0, [1, 2])
    s.routed("a", 0.1, [1, 2, 3, 4])
    s.routed("b", 0.0, [5, 6])
    s.routed("b", 0.1, [5, 6, 7, 8])
    s.routed("c", 9.0, [20])  # keeps the evidence from fading to nothing by the time the two end
    per = s.next_turn_blocks(10.5)
    assert s.live_on("a", 10.5) == 0 and per == pytest.approx(2.0 * 2 / (2 + 2), rel=0.05)


async def test_projected_fit_keeps_a_tenants_next_user_off_an_engine_its_conversation_will_outgrow() -> None:
    """A tenant's first conversation grows two blocks a turn on a 10-block pool; its second user shares
    the system prompt. Demand alone (6 + 3 of 10) says it fits there; with the first conversation's next
    turn counted (6 + 2 + 3) it does not, and it opens on an engine with room."""
    system = list(range(8))  # two blocks of 4

    async def second_user(**extra: object) -> tuple[str, str, dict[str, float]]:
        r = _router("kv-aware", **extra)
        for ep in r.pool.all():
            ep.kv_blocks = 10
        turn1 = [*system, *range(100, 108)]
        d = await r.decide(_req(turn1))
        r.commit(d, d.order[0])
        d = await r.decide(_req([*turn1, *range(200, 208)]))  # its follow-up: two blocks more
        home = d.order[0]
        r.commit(d, home)
        d = await r.decide(_req([*system, *range(300, 312)]))  # the next user: five blocks, two shared
        r.close()
        assert d.ranked is not None
        fit = {ranked.endpoint.url: ranked.scores["fit"] for ranked in d.ranked}
        return home.url, d.order[0].url, fit

    home, went, fit = await second_user()
    assert went == home and set(fit.values()) == {0.0}  # fits everywhere: the scorer is silent
    home, went, fit = await second_user(projectedFit=True)
    # Not on its home; which of the two others is the tie-break's (rendezvous hash) call.
    assert went != home and fit[home] == 0.0 and fit[went] == 1.0


def test_the_sticky_filter_keeps_a_follow_up_on_its_conversations_engine_only() -> None:
    t = ConversationTracker(window_s=10.0)
    f = StickyConversationFilter(t)
    eps = _eps()
    t.routed("b", 0.0, [1, 2, 3])
    follow_up = RouteRequest(hashes=[1, 2, 3, 4], now=1.0)
    assert [e.url for e in f.filter(follow_up, eps)] == ["b"]
    # A new conversation over the same system prompt, an approximate request, and a follow-up whose
    # engine the bounds before dropped (over the load bound, out of rotation): every engine is kept.
    assert len(f.filter(RouteRequest(hashes=[1, 2, 9], now=1.0), eps)) == 3
    assert len(f.filter(RouteRequest(hashes=[1, 2, 3, 4], approximate=True, now=1.0), eps)) == 3
    assert [e.url for e in f.filter(follow_up, [eps[0], eps[2]])] == ["a", "c"]
    # Off (no tracker), and a conversation quiet for a window: nothing is kept to an engine.
    assert len(StickyConversationFilter(None).filter(follow_up, eps)) == 3
    assert len(f.filter(RouteRequest(hashes=[1, 2, 3, 4], now=11.0), eps)) == 3


@pytest.mark.parametrize("sticky", [False, True])
async def test_a_follow_up_whose_blocks_were_evicted_goes_home_only_when_sticky(sticky: bool) -> None:
    """A conversation's blocks evicted at its engine while another engine holds its system prompt (a
    second user of the tenant went there): the prefix scorer moves the follow-up, unless it is sticky."""
    from kvstrata.router.events import BlockStored

    r = _router("kv-aware", stickyConversations=sticky)
    system = list(range(8))  # two blocks of 4
    first = [*system, 100, 101, 102, 103]
    d, home = await routed_then_evicted(r, first)
    other = next(ep for ep in r.pool.all() if ep is not home)
    r.index.apply(other.url, BlockStored(tuple(d.hashes[:2]), None, (), 4, "GPU"))  # the system prompt
    again = await r.decide(_req([*first, 7, 7, 7, 7]))
    if sticky:
        assert again.order[0] is home and again.reason == "conversation" and again.sticky
        assert set(again.order[1:]) == set(r.pool.all()) - {home}  # the others stay retry targets
    else:
        assert again.order[0] is other and again.reason == "prefix" and not again.sticky
    r.close()


@pytest.mark.parametrize("on", [False, True])
async def test_the_gate_sees_an_engine_crowded_past_its_share_of_live_conversations(on: bool) -> None:
    """stealKeepsConversationsEven's question to the router: does an engine serve more than floor(N /
    engines) of the N live conversations? Four conversations opened on a, one on b, none on c: a (4 of
    5, share 1) is crowded, b (1) and c (0) are not; a conversation continued on b does not open another.
    Off, conversations are not tracked and no engine is crowded."""
    import time

    r = _router("kv-aware", admission={"stealKeepsConversationsEven": on})
    a, b, c = r.pool.all()
    for user in range(4):
        r.commit(await r.decide(_req([*range(8), 200 + user, 0, 0, 0])), a)
    first = [*range(8), 300, 0, 0, 0]
    r.commit(await r.decide(_req(first)), b)
    r.commit(await r.decide(_req([*first, 5, 5, 5, 5])), b)  # its next turn: still one conversation
    now = time.monotonic()
    assert [r._crowded(ep, now) for ep in (a, b, c)] == ([True, False, False] if on else [False] * 3)
    r.close()
