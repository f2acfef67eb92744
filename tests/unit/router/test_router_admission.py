"""The admission gate (router/admission.py): who is held, who goes first when room frees, who moves.

The gate is exercised alone with a dictionary standing in for the index (what each engine holds), and
once through the real router app over loopback HTTP."""

from __future__ import annotations

import asyncio
import random
from array import array
from collections.abc import Sequence

import kvstrata_native
import pytest

from kvstrata.api.router_config import AdmissionSettings, TierWeights
from kvstrata.router import admission
from kvstrata.router.admission import Admitted, Claim, Gate, GateDeps, Grant
from kvstrata.router.decision import Decision
from kvstrata.router.followups import FollowUp
from kvstrata.router.index import PrefixMatch
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.reasons import Reason
from kvstrata.router.scoring import RouteRequest

BS = 32


def hashes(prefix: int, n: int) -> array[int]:
    """``n`` block hashes of a prompt whose prefix group is ``prefix`` (chained: a group shares all)."""
    return array("Q", [prefix * 1000 + i for i in range(n)])


class World:
    """Endpoints, what each holds (a stand-in for the index) and the gate's record of moves."""

    def __init__(
        self, *pools: int, max_hold_s: float = 30.0, settings: AdmissionSettings | None = None
    ) -> None:
        self.eps = [Endpoint(EndpointSpec(f"http://e{i}"), kv_blocks=p) for i, p in enumerate(pools)]
        self.held: dict[str, set[int]] = {ep.url: set() for ep in self.eps}
        self.down: set[str] = set()
        self.silent: set[str] = set()
        self.committed: list[str] = []
        self.moved: list[str] = []
        self.spare: set[str] = set()  # engines with room beside their recent demand (moveToSpareRoom)
        self.crowded: set[str] = set()  # engines serving more than their share of live conversations
        self.spare_asked: list[tuple[str, int]] = []
        deps = GateDeps(
            lookup=self.lookup,
            tiers=TierWeights(),
            block_size=BS,
            usable=lambda ep: ep.url not in self.down,
            silent=lambda ep: ep.url in self.silent,
            endpoints=lambda: list(self.eps),
            indexed_blocks=lambda ep: len(self.held[ep.url]),
            commit=lambda d, ep: self.committed.append(ep.url),
            moved=lambda d, ep: self.moved.append(ep.url),
            spare_room=self.spare_room,
            crowded=lambda ep, now: ep.url in self.crowded,
        )
        self.gate = Gate(settings or AdmissionSettings(), max_hold_s, deps)

    def spare_room(self, ep: Endpoint, blocks: int, now: float) -> bool:
        self.spare_asked.append((ep.url, blocks))
        return ep.url in self.spare

    def lookup(self, hs: Sequence[int]) -> dict[str, PrefixMatch]:
        out = {}
        for url, held in self.held.items():
            n = 0
            while n < len(hs) and hs[n] in held:
                n += 1
            if n:
                out[url] = PrefixMatch(n, gpu=n)
        return out

    def decision(self, hs: array[int], home: int, tokens: int | None = None) -> Decision:
        order = [self.eps[home], *(ep for i, ep in enumerate(self.eps) if i != home)]
        n = len(hs) * BS if tokens is None else tokens
        return Decision(
            order, Reason.PREFIX, hs, matches=self.lookup(hs), prompt_tokens=n, request=RouteRequest(hs)
        )


def distinct_blocks(claims: Sequence[tuple[Sequence[int], int]]) -> int:
    """The plain count the gate's rooms keep: every distinct prefix of the claims' block hashes (a node
    of their trie) once, plus each claim's blocks beyond its full ones (its partial last block and its
    output), which are its own."""
    nodes = {tuple(hs[: i + 1]) for hs, _ in claims for i in range(len(hs))}
    return len(nodes) + sum(blocks - len(hs) for hs, blocks in claims)


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefixes_count_once() -> None:
    a = (hashes(1, 10), 11)
    b = (array("Q", [*hashes(1, 6), 77, 78]), 9)  # shares 6 blocks with a
    c = (hashes(2, 4), 5)
    d = (hashes(1, 10), 11)  # the same full blocks as a (prompts that differ only in a partial last block)
    assert distinct_blocks([a, b, c]) == 11 + 9 - 6 + 5
    for order in ([a], [a, b, c], [c, b, a], [a, d], [a, b, c, d], [d, c, b, a]):
        rooms = kvstrata_native.Rooms()
        for hs, blocks in order:
            rooms.pin("http://e", hs, blocks)
        assert rooms.in_flight("http://e") == distinct_blocks(order)
    # Equal keys leave the same trie whichever one goes; a claim never pinned is refused, not guessed.
    rooms.unpin("http://e", *a)
    assert rooms.in_flight("http://e") == distinct_blocks([b, c, d])
    with pytest.raises(KeyError):
        rooms.unpin("http://e", hashes(3, 2), 2)


def test_the_pinned_blocks_are_kept_as_requests_and_kept_rooms_come_and_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate keeps each engine's running claims, alone and with the rooms kept for follow-ups, as
    sorted tries changed at each claim, release, rehash, kept room taken or expired. Against the plain
    computation (sort them all, sum what neighbours do not share), through random claims of prompts that
    share prefixes: the blocks pinned and kept, whether a prompt fits with and without the kept rooms,
    and the longest prefix a prompt shares with a running request."""
    rng = random.Random(7)
    clock = FrozenClock()
    w = World(10_000, settings=AdmissionSettings(anticipate_seconds=0.25, anticipate_only_evicted=False))
    w.gate.clock = clock.monotonic
    monkeypatch.setattr(w.gate._followups, "expected", lambda hs: rng.random() < 0.5)
    ep = w.eps[0]
    groups = [hashes(g, 12) for g in range(4)]

    def prompt() -> array[int]:
        tail = [rng.randrange(1 << 40) for _ in range(rng.randrange(1, 6))]
        return array("Q", [*rng.choice(groups)[: rng.randrange(0, 13)], *tail])

    leading: list[Decision] = []
    for _ in range(400):
        roll = rng.random()
        claims = list(w.gate._claims.get(ep.url, ()))
        if roll < 0.3 and claims:
            w.gate.release(rng.choice(claims), ended=rng.random() < 0.7)
        elif roll < 0.4 and leading:
            d = leading.pop(rng.randrange(len(leading)))  # hashed whole: a longer prompt, more blocks
            d.hashes = array("Q", [*d.hashes, *prompt()])
            d.prompt_tokens = len(d.hashes) * BS
            w.gate.rehashed(d)
        elif roll < 0.5:
            clock.t += rng.choice((0.05, 0.1, 0.3))
        elif roll < 0.6 and (rooms := w.gate._rooms.open_rooms()):
            _, room, _, _ = rng.choice(rooms)
            follow_up = FollowUp(room[-1], ep.url, len(room), room[0])
            assert w.gate._take_reservation(follow_up, clock.t) in (ep, None)
        else:
            d = w.decision(prompt(), 0, tokens=None)
            d.prompt_tokens = len(d.hashes) * BS + rng.randrange(0, BS)  # a partial last block or not
            w.gate.claim(ep, d, rng.randrange(0, 3 * BS))
            leading.append(d)
        claims = [(c.hashes, c.blocks) for c in w.gate._claims.get(ep.url, ())]
        kept = [(hs, blocks) for _, hs, blocks, until in w.gate._rooms.open_rooms() if until > clock.t]
        assert w.gate.in_flight_blocks(ep) == distinct_blocks(claims)
        assert w.gate.reserved_blocks(ep) == distinct_blocks(kept)
        hs = prompt()
        walked = max((common_blocks(hs, c) for c, _ in claims), default=0)
        assert w.gate._running(ep, hs) == walked
        for pinned in (claims, [*claims, *kept]):
            need = distinct_blocks([*pinned, (hs, 20)])
            for pool in (need, need + 1):  # just too small (less the null block), and just enough
                ep.kv_blocks = pool
                fits = w.gate.fits(ep, 20, hs, kept=pinned is not claims)
                assert fits == (not pinned or need <= pool - 1)
        ep.kv_blocks = 10_000


def test_rooms_kept_and_never_taken_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept room closes when it expires, also where nothing asks whether a prompt fits there (every
    request a follow-up taking its own room, as in an agent's loop): the rooms of the last window only."""
    clock = FrozenClock()
    w = World(10_000, settings=AdmissionSettings(anticipate_seconds=0.25, anticipate_only_evicted=False))
    w.gate.clock = clock.monotonic
    monkeypatch.setattr(w.gate._followups, "expected", lambda hs: True)
    for n in range(1000):
        w.gate.release(w.gate.claim(w.eps[0], w.decision(hashes(n % 5, 8), 0), 0), ended=True)
        clock.t += 0.1
    listed, by_last = w.gate._rooms.listed()
    assert listed <= 3 and by_last <= 3


async def test_a_request_waits_for_room_and_takes_it_when_freed() -> None:
    w = World(10)
    first = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    assert first.how is Admitted.DIRECT and w.gate.in_flight_blocks(w.eps[0]) == 8
    pending = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.05)
    assert not pending.done() and w.gate.held() == 1
    assert w.committed == ["http://e0"]  # counted at its engine while it waits
    w.gate.release(first.claim)
    grant = await asyncio.wait_for(pending, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0] and grant.held_s > 0
    assert w.gate.held() == 0 and w.gate.in_flight_blocks(w.eps[0]) == 8


async def test_a_prefix_group_fits_where_its_copies_would_not() -> None:
    w = World(11)
    a = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    # The same 8-block prefix plus 2 of its own: 10 distinct blocks in all, the pool less its null block.
    b = await w.gate.admit(w.decision(array("Q", [*hashes(1, 8), 5, 6]), 0), 0)
    assert a.how is b.how is Admitted.DIRECT


async def test_when_room_frees_the_cached_prompt_goes_before_an_older_cold_one() -> None:
    w = World(10)
    running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.held["http://e0"].update(hashes(3, 8))  # the engine holds the follow-up's prefix
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.gate.release(running.claim)
    await asyncio.sleep(0.01)
    assert warm.done() and not cold.done()
    w.gate.release(warm.result().claim)
    assert (await asyncio.wait_for(cold, 1)).how is Admitted.QUEUED


class FrozenClock:
    """The gate's monotonic clock, moved only by the test: who is overdue depends on waits measured
    against the engine's pace, and a real clock lets a collector pause of tens of ms decide it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


async def test_a_cold_prompt_held_as_long_as_its_own_prefill_goes_before_cheaper_ones() -> None:
    """Overdue: cheapest-first would keep the cold prompt waiting for as long as warm follow-ups came;
    once it has waited as long as its prefill takes at the engine's pace, it goes first."""
    clock = FrozenClock()
    w = World(10, settings=AdmissionSettings(overdue_after_prefills=1.0, anticipate_seconds=0))
    w.gate.clock = clock.monotonic
    w.eps[0].pace.observe(BS, BS * 0.002)  # 2 ms a token: 8 cold blocks 512 ms, one new block 64 ms
    running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    w.held["http://e0"].update(hashes(3, 8))  # the engine holds the follow-ups' prefix
    await asyncio.sleep(0)
    clock.t += 0.01
    warm = asyncio.ensure_future(w.gate.admit(w.decision(extend(hashes(3, 8), 1), 0), 0))
    await asyncio.sleep(0)
    clock.t += 0.01
    w.gate.release(running.claim)  # neither has waited its own prefill: the cheaper one goes
    first = await asyncio.wait_for(warm, 1)
    assert first.how is Admitted.QUEUED and not cold.done()
    later = asyncio.ensure_future(w.gate.admit(w.decision(extend(hashes(3, 8), 2), 0), 0))
    await asyncio.sleep(0)
    clock.t += 0.55  # past the cold prompt's own prefill
    w.gate.release(first.claim)
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.OVERDUE and grant.endpoint is w.eps[0] and not later.done()
    w.gate.release(grant.claim)
    assert (await asyncio.wait_for(later, 1)).how is Admitted.OVERDUE  # it waited past its 64 ms too


async def test_without_a_pace_or_with_the_factor_at_zero_the_cheapest_still_goes_first() -> None:
    for factor, paced in ((1.0, False), (0.0, True)):
        w = World(10, settings=AdmissionSettings(overdue_after_prefills=factor, anticipate_seconds=0))
        if paced:
            w.eps[0].pace.observe(BS, BS * 0.00001)
        running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
        cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
        w.held["http://e0"].update(hashes(3, 8))
        await asyncio.sleep(0.03)
        warm = asyncio.ensure_future(w.gate.admit(w.decision(extend(hashes(3, 8), 1), 0), 0))
        await asyncio.sleep(0.01)
        w.gate.release(running.claim)
        assert (await asyncio.wait_for(warm, 1)).how is Admitted.QUEUED and not cold.done(), factor
        cold.cancel()


async def test_an_overdue_request_takes_a_room_kept_for_a_follow_up() -> None:
    window = 2.0
    settings = AdmissionSettings(
        anticipate_seconds=window, anticipate_only_evicted=False, overdue_after_prefills=1.0
    )
    w = World(10, settings=settings)
    w.eps[0].pace.observe(BS, BS * 0.0001)  # 8 cold blocks: 26 ms of prefill
    turn1 = hashes(1, 6)
    first = await w.gate.admit(w.decision(turn1, 0), 0)
    w.gate.release(first.claim, ended=True)
    second = await w.gate.admit(w.decision(extend(turn1, 901), 0), 0)  # followed at once: expected
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.05)  # overdue by now
    w.gate.release(second.claim, ended=True)  # its room would be kept for 2 s
    grant = await asyncio.wait_for(cold, 0.5)
    assert grant.how is Admitted.OVERDUE and grant.held_s < window


async def test_equal_costs_go_first_come_first_served() -> None:
    w = World(10)
    running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    one = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    two = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.gate.release(running.claim)
    await asyncio.sleep(0.01)
    assert one.done() and not two.done()
    two.cancel()


async def test_a_cold_request_moves_to_an_engine_with_room_but_a_warm_one_stays() -> None:
    w = World(10, 10)
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    other = await w.gate.admit(w.decision(hashes(9, 8), 1), 0)
    w.held["http://e0"].update(hashes(3, 8))
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not warm.done() and not cold.done()
    w.gate.release(other.claim)  # e1 has room: the cold one costs it no more than e0 would
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1] and w.moved == ["http://e1"]
    assert not warm.done()  # its prefix is at e0: it waits there
    w.gate.release(busy.claim)
    assert (await asyncio.wait_for(warm, 1)).endpoint is w.eps[0]


def test_a_cached_prefix_counts_only_as_far_as_the_pool_keeps_it_beside_running_requests() -> None:
    """What an engine will still hold of a prompt when it can start there (Gate.surviving): blocks our
    running requests share with it stay; the rest only as far as the pool's room beside what they pin."""
    w = World(20, 0)  # e0: 19 usable blocks; e1: pool size unknown
    e0, e1 = w.eps
    cold = PrefixMatch(10, gpu=10)
    assert w.gate.surviving(e0, cold, hashes(2, 12)) == cold  # nothing runs there: nothing evicts it
    w.gate.claim(e0, w.decision(hashes(1, 12), 0), 0)  # 12 blocks pinned, 7 left beside them
    assert w.gate.surviving(e0, cold, hashes(2, 12)) == PrefixMatch(7, gpu=7)
    # The 5 blocks it shares with the running request stay, and 7 more fit beside it.
    sharing = array("Q", [*hashes(1, 5), *hashes(3, 10)])
    assert w.gate.surviving(e0, PrefixMatch(14, gpu=10, predicted=4), sharing) == PrefixMatch(
        12, gpu=8, predicted=4
    )
    small = PrefixMatch(6, gpu=6)
    assert w.gate.surviving(e0, small, hashes(2, 12)) == small  # fits in the room left
    tiered = PrefixMatch(10, gpu=4, cpu=6)
    assert w.gate.surviving(e0, tiered, hashes(2, 12)) == tiered  # not the GPU pool's alone
    w.gate.claim(e1, w.decision(hashes(1, 12), 1), 0)
    assert w.gate.surviving(e1, cold, hashes(2, 12)) == cold  # pool size unknown
    # Every engine's match at once: one left holding none of the prompt drops out.
    w.gate.claim(e0, w.decision(hashes(4, 7), 0), 0)  # 19 pinned: no room left on e0
    both = {e0.url: cold, e1.url: cold}
    assert w.gate.surviving_matches(both, hashes(2, 12), w.eps) == {e1.url: cold}


async def test_with_surviving_costs_a_warm_request_whose_home_cannot_keep_its_prefix_moves() -> None:
    """The warm request of the test above, with held requests costed by what will survive: its home
    runs 8 blocks in a pool of 9 usable, so its 8 cached blocks will be gone by the time it can start
    there, and it goes to the engine that frees room first instead of waiting for its home."""
    w = World(10, 10)
    w.gate.surviving_costs = True
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    other = await w.gate.admit(w.decision(hashes(9, 8), 1), 0)
    w.held["http://e0"].update(hashes(3, 8))
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not warm.done()
    w.gate.release(other.claim)
    grant = await asyncio.wait_for(warm, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]
    w.gate.release(busy.claim)


async def _cold_held_while_another_engine_frees(w: World) -> tuple[Grant, asyncio.Future[Grant]]:
    """e0 busy, a cold request held for it, then e1 frees room: e1 would cost it no more than e0."""
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    other = await w.gate.admit(w.decision(hashes(9, 8), 1), 0)
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.gate.release(other.claim)
    await asyncio.sleep(0.01)
    return busy, cold


async def _waits_for_its_own_engine(w: World, busy: Grant, cold: asyncio.Future[Grant]) -> None:
    assert not cold.done() and w.moved == []
    w.gate.release(busy.claim)
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0]


async def test_without_stealing_a_cold_request_waits_for_its_own_engine() -> None:
    w = World(10, 10)
    w.gate.settings = AdmissionSettings(steal_when_home_holds_no_more=False)
    await _waits_for_its_own_engine(w, *await _cold_held_while_another_engine_frees(w))


async def test_a_sticky_follow_up_waits_for_its_conversations_engine_where_a_cold_one_is_stolen() -> None:
    """stickyConversations: the router kept a follow-up on its conversation's engine (Decision.sticky);
    the gate does not steal it either, however little its home holds of it now."""
    w = World(10, 10)
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    other = await w.gate.admit(w.decision(hashes(9, 8), 1), 0)
    d = w.decision(hashes(2, 8), 0)
    d.sticky = True
    held = asyncio.ensure_future(w.gate.admit(d, 0))
    await asyncio.sleep(0.01)
    w.gate.release(other.claim)
    await asyncio.sleep(0.01)
    await _waits_for_its_own_engine(w, busy, held)


async def test_a_sticky_follow_up_still_leaves_a_silent_engine() -> None:
    w = World(10, 10)
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)  # never released: the engine is wedged
    d = w.decision(hashes(3, 8), 0)
    d.sticky = True
    held = asyncio.ensure_future(w.gate.admit(d, 0))
    await asyncio.sleep(0.01)
    assert not held.done()
    w.silent.add("http://e0")
    grant = await asyncio.wait_for(held, 2)  # the periodic re-check sees it
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]


@pytest.mark.parametrize("spare", [False, True])
async def test_steals_only_to_spare_room_wait_where_the_thief_would_evict_what_was_asked_for_lately(
    spare: bool,
) -> None:
    """stealOnlyToSpareRoom: a steal's premise counts the moved request's own hit only; its prefill also
    evicts what the thief's own conversations come back for (family draw 923). The thief needs room for
    the blocks it lacks beside its recent demand; without it the request waits for its own engine."""
    w = World(10, 10, settings=AdmissionSettings(steal_only_to_spare_room=True))
    if spare:
        w.spare.add("http://e1")
    busy, cold = await _cold_held_while_another_engine_frees(w)
    assert ("http://e1", 8) in w.spare_asked  # asked about the 8 blocks e1 lacks
    if not spare:
        await _waits_for_its_own_engine(w, busy, cold)
        return
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]
    w.gate.release(busy.claim)


@pytest.mark.parametrize("even", [False, True])
async def test_steals_that_keep_conversations_even_wait_where_the_thief_serves_more_than_its_share(
    even: bool,
) -> None:
    """stealKeepsConversationsEven: a steal commits the request's next turns to the thief, so a thief
    already serving more than its share of the live conversations (family draw 1028: the engine whose
    first requests ended first stole the burst's held ones and served four of eight) does not take it;
    it waits for its own engine. Off, or to a thief within its share, it is stolen as before."""
    w = World(10, 10, settings=AdmissionSettings(steal_keeps_conversations_even=even))
    w.crowded.add("http://e1")
    busy, cold = await _cold_held_while_another_engine_frees(w)
    if even:
        await _waits_for_its_own_engine(w, busy, cold)
        return
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]
    w.gate.release(busy.claim)


async def test_steals_that_keep_conversations_even_still_go_to_a_thief_within_its_share() -> None:
    w = World(10, 10, settings=AdmissionSettings(steal_keeps_conversations_even=True))
    w.crowded.add("http://e0")  # the home is the crowded one: the steal evens the count
    busy, cold = await _cold_held_while_another_engine_frees(w)
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]
    w.gate.release(busy.claim)


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("spare_only", [False, True])
@pytest.mark.parametrize("steal", [True, False])
@pytest.mark.parametrize("fault", ["silent", "ejected or gone"])
async def test_a_request_waiting_on_a_silent_or_lost_engine_goes_elsewhere(
    fault: str, steal: bool, spare_only: bool, even: bool
) -> None:
    w = World(10, 10)
    w.gate.settings = AdmissionSettings(
        steal_when_home_holds_no_more=steal,
        steal_only_to_spare_room=spare_only,
        steal_keeps_conversations_even=even,
    )
    w.crowded.add("http://e1")  # crowded or not, a request leaves an engine that cannot serve it
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)  # never released: the engine is wedged
    w.held["http://e0"].update(hashes(3, 8))
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not warm.done()
    (w.silent if fault == "silent" else w.down).add("http://e0")
    grant = await asyncio.wait_for(warm, 2)  # the periodic re-check sees it
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]


async def test_nobody_is_held_longer_than_max_hold() -> None:
    w = World(10, max_hold_s=0.2)
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    grant = await asyncio.wait_for(w.gate.admit(w.decision(hashes(2, 8), 0), 0), 2)
    assert grant.how is Admitted.EXPIRED and grant.endpoint is w.eps[0] and grant.held_s >= 0.2


async def test_many_held_requests_cost_each_pass_and_each_quiet_second_a_bounded_number_of_lookups() -> None:
    """Each held request used to look again on its own timer, and every look weighed every held request:
    the loop's work grew with the square of how many were held (make bench-admission). Now one timer
    looks at all of them, and a look weighs each engine's oldest few."""
    w = World(10, 10)
    w.gate.weighed = 8  # shared by the two engines holding requests
    w.gate.weighed_min = 1
    w.gate.recheck_s = 0.1
    lookups = 0

    def counted(hs: Sequence[int]) -> dict[str, PrefixMatch]:
        nonlocal lookups
        lookups += 1
        return w.lookup(hs)

    w.gate.deps.lookup = counted
    for e in (0, 1):
        await w.gate.admit(w.decision(hashes(100 + e, 8), e), 0)  # never released: nothing fits
    held = [asyncio.ensure_future(w.gate.admit(w.decision(hashes(i, 8), i % 2), 0)) for i in range(60)]
    await asyncio.sleep(0.01)
    assert w.gate.held() == 60
    lookups = 0
    w.gate.pump()
    assert lookups == 2 * 4  # each engine's oldest four
    lookups = 0
    await asyncio.sleep(0.55)  # about five looks at all of them
    assert 0 < lookups <= 6 * 2 * 4, lookups
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert w.gate.held() == 0


async def test_past_the_weighed_few_held_requests_come_forward_in_arrival_order() -> None:
    """The cheapest of an engine's oldest few goes first; one further back waits until it is among them,
    and a hold still ends after maxHoldSeconds wherever it is in the line."""
    w = World(10)
    w.gate.weighed = 2
    w.gate.weighed_min = 1
    running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    w.held["http://e0"].update(hashes(5, 8))  # the engine holds the last one's prompt: it costs nothing
    order: list[int] = []
    held: dict[int, asyncio.Future[Grant]] = {}
    for n in (2, 3, 4, 5):
        held[n] = asyncio.ensure_future(w.gate.admit(w.decision(hashes(n, 8), 0), 0))
        held[n].add_done_callback(lambda _, n=n: order.append(n))
        await asyncio.sleep(0.01)
    claim = running.claim
    for _ in held:
        w.gate.release(claim)  # room for one
        await asyncio.sleep(0.01)
        claim = held[order[-1]].result().claim
    # 5 is the cheapest, but it is weighed only once 2 and 3 have gone; then it goes before the older 4.
    assert order == [2, 3, 5, 4]

    short = World(10, max_hold_s=0.2)
    short.gate.weighed = 1
    short.gate.weighed_min = 1
    await short.gate.admit(short.decision(hashes(1, 8), 0), 0)
    grants = await asyncio.wait_for(
        asyncio.gather(*(short.gate.admit(short.decision(hashes(n, 8), 0), 0) for n in (2, 3, 4))), 2
    )
    assert [g.how for g in grants] == [Admitted.EXPIRED] * 3


class _EveryCostGate(Gate):
    """The gate as it was: every weighed request costed at every engine in rotation when first weighed."""

    def _weigh(self, w: admission._Waiter, usable: list[Endpoint]) -> admission._Waiter:
        fresh = w.weighed != self._passes
        super()._weigh(w, usable)
        if fresh:
            for ep in usable:
                self._cost_of(w, ep)
        return w


async def test_costs_asked_late_in_a_pass_are_the_costs_at_its_start() -> None:
    """A pass costs a held request at an engine only when it asks, and what it sends meanwhile must not
    change the answer: against a gate that costs every request everywhere first, through random holds,
    releases, steals and index changes on three small pools, the same requests go to the same engines,
    the same way, in the same order."""
    rng = random.Random(11)
    worlds = [World(16, 16, 16), World(16, 16, 16)]
    worlds[1].gate = _EveryCostGate(worlds[1].gate.settings, 30.0, worlds[1].gate.deps)
    for world in worlds:
        world.gate.recheck_s = 1000.0  # no timer between the two worlds' steps
    granted: list[list[tuple[int, str, str]]] = [[], []]
    running: list[dict[int, Claim | None]] = [{}, {}]

    def admit(i: int, n: int, hs: array[int], home: int) -> None:
        w = worlds[i]
        task = asyncio.ensure_future(w.gate.admit(w.decision(hs, home), 0))

        def done(t: asyncio.Future[Grant]) -> None:
            granted[i].append((n, t.result().endpoint.url, t.result().how.value))
            running[i][n] = t.result().claim

        task.add_done_callback(done)

    for n in range(300):
        roll = rng.random()
        if roll < 0.45:
            group, size, home = rng.randrange(5), rng.randrange(3, 10), rng.randrange(3)
            hs = array("Q", [*hashes(group, size - 2), n * 7919 + 1, n * 7919 + 2])
            for i in (0, 1):
                admit(i, n, hs, home)
        elif roll < 0.8 and running[0]:
            done = rng.choice(sorted(running[0]))
            for i in (0, 1):
                worlds[i].gate.release(running[i].pop(done))
        else:
            url, group, stored = f"http://e{rng.randrange(3)}", rng.randrange(5), rng.random() < 0.5
            for w in worlds:  # the engine stores or evicts a group's blocks
                if stored:
                    w.held[url].update(hashes(group, 8))
                else:
                    w.held[url].difference_update(hashes(group, 8))
        for _ in range(3):
            await asyncio.sleep(0)
        assert granted[0] == granted[1]
    assert {how for _, _, how in granted[0]} >= {"direct", "queued", "stolen"}
    for w in worlds:
        for waiter in [x for held in w.gate._held_at.values() for x in held]:
            waiter.future.cancel()


async def test_a_request_sent_in_a_pass_does_not_change_what_the_pass_weighs_after_it() -> None:
    """A's grant on e1 starts computing blocks that B shares. Weighed at the start of the pass, B would
    lose a steal to e1 (its home holds more of it); costed later in the same pass it must still be
    weighed as at the start, or the pass would steal it on a cost the gate that weighs everything first
    never saw."""
    w = World(30, 20)
    w.gate.claim(w.eps[0], w.decision(hashes(9, 29), 0), 0)  # e0 full for good
    busy = w.gate.claim(w.eps[1], w.decision(hashes(8, 19), 1), 0)
    w.held["http://e0"].update(hashes(1, 4))  # e0 holds B's first 4 blocks
    a = asyncio.ensure_future(w.gate.admit(w.decision(hashes(1, 8), 1), 0))
    b = asyncio.ensure_future(w.gate.admit(w.decision(hashes(1, 10), 0), 0))
    await asyncio.sleep(0.01)
    assert w.gate.held() == 2
    w.gate.release(busy)  # e1 has room for A and for B beside it
    await asyncio.sleep(0.01)
    assert a.done() and a.result().endpoint is w.eps[1]
    assert not b.done() and w.moved == []
    b.cancel()


async def test_a_client_that_leaves_while_held_is_forgotten() -> None:
    w = World(10)
    running = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    pending = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert w.gate.held() == 0
    w.gate.release(running.claim)
    assert w.gate.in_flight_blocks(w.eps[0]) == 0


@pytest.mark.parametrize(
    ("tokens", "pool", "enabled"),
    [(None, 10, True), (256, 0, True), (256, 10, False)],
    ids=["size unknown", "pool unknown", "gate off"],
)
async def test_nothing_is_held_without_a_size_a_pool_or_the_gate(
    tokens: int | None, pool: int, enabled: bool
) -> None:
    w = World(pool)
    w.gate.settings = AdmissionSettings(enabled=enabled)
    for prefix in (1, 2, 3):
        d = w.decision(hashes(prefix, 8), 0)
        d.prompt_tokens = tokens
        grant = await asyncio.wait_for(w.gate.admit(d, 0), 1)
        assert grant.how in (Admitted.DIRECT, Admitted.UNGATED)


def test_output_tokens_count_toward_a_requests_size() -> None:
    w = World(10)
    d = w.decision(hashes(1, 4), 0, tokens=4 * BS + 5)
    assert w.gate.blocks(d, w.gate.output(0)) == 5
    assert w.gate.blocks(d, w.gate.output(64)) == 7
    assert w.gate.blocks(d, w.gate.output(None)) == 5 + AdmissionSettings().assumed_output_tokens // BS


async def test_a_prompt_hashed_whole_after_its_leading_blocks_shares_its_prefix_with_followers() -> None:
    """A cold prompt routed on its leading blocks claims them and a size guessed from characters; once
    its rest is hashed (core.Router._hashed_later), a follow-up sharing its whole prefix fits beside it."""
    w = World(12)
    prefix = hashes(1, 8)
    cold = w.decision(prefix[:2], 0, tokens=11 * BS)  # two leading hashes, an over-estimate of 11 blocks
    first = await w.gate.admit(cold, 0)
    assert first.how is Admitted.DIRECT and w.gate.in_flight_blocks(w.eps[0]) == 11
    follower = asyncio.ensure_future(w.gate.admit(w.decision(array("Q", [*prefix, 5, 6]), 0), 0))
    await asyncio.sleep(0.01)
    assert not follower.done()  # 11 + 10 - 2 shared blocks: no room in 11
    cold.hashes, cold.prompt_tokens = prefix, 8 * BS
    w.gate.rehashed(cold)  # 8 + 10 - 8 shared blocks: room for the follower at once
    grant = await asyncio.wait_for(follower, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0]
    assert w.gate.in_flight_blocks(w.eps[0]) == 10
    w.gate.release(grant.claim)
    assert w.gate.in_flight_blocks(w.eps[0]) == 8  # the cold prompt's claim, at its real size


async def test_a_warm_request_moves_once_it_has_waited_as_long_as_its_extra_prefill_would_take() -> None:
    """Rent or buy: its home holds its prefix but runs something that will not end soon; e1 is free and
    prefills at a known pace. Held as long as the extra prefill at e1 would take, it goes there."""
    w = World(10, 10)
    w.gate.settings = AdmissionSettings(move_when_held_past_prefill=True)
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)  # never released
    w.held["http://e0"].update(hashes(3, 8))
    w.eps[1].pace.observe(10 * BS, 0.005)  # 10 blocks in 5 ms
    grant = await asyncio.wait_for(w.gate.admit(w.decision(hashes(3, 8), 0), 0), 2)
    assert grant.how is Admitted.MOVED and grant.endpoint is w.eps[1] and w.moved == ["http://e1"]
    extra_s = w.eps[1].pace.seconds_for(7 * BS)  # at least 7 of its 8 blocks are new at e1
    assert extra_s is not None and grant.held_s >= extra_s


async def test_a_move_that_evicts_cached_blocks_waits_for_their_prefill_too() -> None:
    """e1's pool is full of another tenant's cached blocks: moving there costs the mover's prefill and
    the evicted blocks' prefill when that tenant comes back, so the move waits for both."""
    w = World(10, 10)
    w.gate.settings = AdmissionSettings(move_when_held_past_prefill=True)
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)  # never released
    w.held["http://e0"].update(hashes(3, 8))
    w.held["http://e1"].update(hashes(7, 9))  # e1's whole pool, less the null block
    w.eps[1].pace.observe(10 * BS, 0.05)  # 10 blocks in 50 ms: 40 ms for the mover's, 80 with the evicted
    grant = await asyncio.wait_for(w.gate.admit(w.decision(hashes(3, 8), 0), 0), 2)
    assert grant.how is Admitted.MOVED and grant.endpoint is w.eps[1]
    both_s = w.eps[1].pace.seconds_for(2 * 7 * BS)  # its 7+ new blocks, and as many evicted
    assert both_s is not None and grant.held_s >= both_s


async def test_a_warm_request_moves_to_spare_room_once_it_has_waited_its_extra_prefill_there() -> None:
    """moveToSpareRoom: e1 has room for the prompt beside everything routed there lately, so the move
    evicts nothing lately asked for; it is made once the request has waited as long as its extra prefill
    at e1 would take (the blocks e1 already holds are not counted)."""
    w = World(10, 10, settings=AdmissionSettings(move_to_spare_room=True))
    await w.gate.admit(w.decision(hashes(1, 8), 0), 0)  # never released
    w.held["http://e0"].update(hashes(3, 8))
    w.held["http://e1"].update(hashes(3, 2))  # e1 holds the first 2 of its 8 blocks
    w.spare.add("http://e1")
    w.eps[1].pace.observe(10 * BS, 0.05)  # 10 blocks in 50 ms
    grant = await asyncio.wait_for(w.gate.admit(w.decision(hashes(3, 8), 0), 0), 2)
    assert grant.how is Admitted.MOVED and grant.endpoint is w.eps[1] and w.moved == ["http://e1"]
    assert ("http://e1", 6) in w.spare_asked  # asked about the 6 blocks e1 lacks
    extra_s = w.eps[1].pace.seconds_for(6 * BS)
    assert extra_s is not None and grant.held_s >= extra_s


async def test_with_move_to_spare_room_a_warm_request_stays_home_while_the_other_engine_is_in_demand() -> (
    None
):
    """e1's pool has room now but not beside what was routed there lately: moving would evict what its
    own conversations come back for, so the request waits for its home however long that takes."""
    w = World(10, 10, settings=AdmissionSettings(move_to_spare_room=True))
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    w.held["http://e0"].update(hashes(3, 8))
    w.eps[1].pace.observe(10 * BS, 0.005)
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.1)  # 25 times its extra prefill at e1's pace
    assert not warm.done() and ("http://e1", 8) in w.spare_asked
    w.gate.release(busy.claim)
    grant = await asyncio.wait_for(warm, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0] and w.moved == []


@pytest.mark.parametrize("why", ["rule off (the default)", "no pace yet"])
async def test_a_warm_request_stays_home_without_the_rule_or_a_pace(why: str) -> None:
    w = World(10, 10)
    if why == "no pace yet":
        w.gate.settings = AdmissionSettings(move_when_held_past_prefill=True)
    else:
        w.eps[1].pace.observe(10 * BS, 0.005)
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    w.held["http://e0"].update(hashes(3, 8))
    warm = asyncio.ensure_future(w.gate.admit(w.decision(hashes(3, 8), 0), 0))
    await asyncio.sleep(0.1)  # 25 times the extra prefill at e1's pace, where it has one
    assert not warm.done()
    w.gate.release(busy.claim)
    grant = await asyncio.wait_for(warm, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0] and w.moved == []


def test_the_prefill_pace_is_a_decayed_ratio_of_seconds_to_uncached_tokens() -> None:
    pace = Endpoint(EndpointSpec("http://e")).pace
    assert pace.seconds_for(1000) is None
    pace.observe(0, 0.3)  # a fully cached prompt: no sample
    assert pace.seconds_for(1000) is None
    pace.observe(1000, 0.5)
    assert pace.seconds_for(1000) == pytest.approx(0.5)
    for _ in range(30):  # the engine got faster: old samples fade
        pace.observe(1000, 0.1)
    seconds = pace.seconds_for(1000)
    assert seconds is not None and 0.1 < seconds < 0.11


def extend(hs: array[int], *more: int) -> array[int]:
    """A follow-up's hashes: the previous prompt's, then its answer's and the new turn's blocks."""
    return array("Q", [*hs, *more])


async def test_an_ended_request_keeps_its_room_for_a_follow_up_that_comes_at_once() -> None:
    """Anticipation: a group whose requests are followed at once (a closed loop) keeps its room when one
    ends; the cold request held there waits for the follow-up, which goes first."""
    window = 0.2
    w = World(10, settings=AdmissionSettings(anticipate_seconds=window, anticipate_only_evicted=False))
    turn1 = hashes(1, 6)
    first = await w.gate.admit(w.decision(turn1, 0), 0)
    w.gate.release(first.claim, ended=True)  # nothing learned yet: no reservation
    assert w.gate.reserved_blocks(w.eps[0]) == 0
    turn2 = extend(turn1, 901)
    second = await w.gate.admit(w.decision(turn2, 0), 0)  # followed at once: the group learns it
    assert second.how is Admitted.DIRECT
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not cold.done()  # 7 + 8 blocks: no room in 9
    w.gate.release(second.claim, ended=True)
    await asyncio.sleep(0.01)
    assert not cold.done() and w.gate.reserved_blocks(w.eps[0]) == 7  # the room is kept
    third = await w.gate.admit(w.decision(extend(turn2, 902), 0), 0)
    assert third.how is Admitted.RESERVED and third.endpoint is w.eps[0] and not cold.done()
    w.gate.release(third.claim, ended=True)  # the conversation's last turn: nothing follows
    grant = await asyncio.wait_for(cold, 2)
    assert grant.how is Admitted.QUEUED and grant.held_s >= window  # the window ran out
    assert w.gate.reserved_blocks(w.eps[0]) == 0


@pytest.mark.parametrize("evicted", [False, True])
async def test_with_only_evicted_a_room_is_kept_only_for_turns_that_evict_each_other(evicted: bool) -> None:
    """``anticipateOnlyEvicted``: a conversation followed at once whose engine still holds its blocks
    when its next turn arrives keeps no room (nothing would evict them); one whose blocks were evicted
    between its turns keeps its room at its next turn's end."""
    settings = AdmissionSettings(anticipate_seconds=5.0, anticipate_only_evicted=True)
    w = World(10, settings=settings)
    turn1 = hashes(1, 6)
    first = await w.gate.admit(w.decision(turn1, 0), 0)
    w.gate.release(first.claim, ended=True)
    if not evicted:
        w.held["http://e0"].update(turn1)  # the engine reported the turn's blocks, and still holds them
    second = await w.gate.admit(w.decision(extend(turn1, 901), 0), 0)
    assert second.how is Admitted.DIRECT
    w.gate.release(second.claim, ended=True)
    assert w.gate.reserved_blocks(w.eps[0]) == (7 if evicted else 0)


@pytest.mark.parametrize("evicted", [False, True])
async def test_a_held_follow_up_reports_what_is_left_of_its_blocks_when_it_goes(evicted: bool) -> None:
    """The request admitted as a turn ends evicts that turn's blocks while the next turn waits for room:
    the follow-up reports what its engine holds when it is granted, not what the index said when it
    arrived (then the blocks were still there)."""
    settings = AdmissionSettings(anticipate_seconds=5.0, anticipate_only_evicted=True)
    w = World(10, settings=settings)
    turn1 = hashes(1, 6)
    first = await w.gate.admit(w.decision(turn1, 0), 0)
    w.held["http://e0"].update(turn1)  # the engine reported the turn's blocks
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.gate.release(first.claim, ended=True)  # the cold request takes the room
    cold_grant = await asyncio.wait_for(cold, 1)
    turn2 = extend(turn1, 901)
    arrived = w.decision(turn2, 0)
    assert arrived.matches["http://e0"].gpu == 6  # at arrival the turn's blocks are all there
    if evicted:
        w.held["http://e0"].difference_update(turn1)  # the cold request's prefill evicts them
    second = asyncio.ensure_future(w.gate.admit(arrived, 0))
    await asyncio.sleep(0.01)
    assert not second.done()  # 8 + 7 blocks: it waits for the cold request
    w.gate.release(cold_grant.claim, ended=True)
    grant = await asyncio.wait_for(second, 1)
    assert grant.how is Admitted.QUEUED
    w.gate.release(grant.claim, ended=True)
    assert w.gate.reserved_blocks(w.eps[0]) == (7 if evicted else 0)


@pytest.mark.parametrize("why", ["anticipation off", "the request failed", "never followed"])
async def test_no_room_is_kept_without_anticipation_an_answer_or_a_follow_up_in_time(why: str) -> None:
    window = 0.05
    settings = AdmissionSettings(
        anticipate_seconds=0 if "off" in why else window, anticipate_only_evicted=False
    )
    w = World(10, settings=settings)
    turn1 = hashes(1, 6)
    first = await w.gate.admit(w.decision(turn1, 0), 0)
    w.gate.release(first.claim, ended=True)
    if why == "never followed":
        await asyncio.sleep(2 * window)  # the follow-up comes after the window: a miss
    second = await w.gate.admit(w.decision(extend(turn1, 901), 0), 0)
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    w.gate.release(second.claim, ended=why != "the request failed")
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.QUEUED and w.gate.reserved_blocks(w.eps[0]) == 0
    assert grant.held_s < 1  # granted on the release, not after some window or the hold bound


def test_a_group_is_expected_back_after_a_follow_up_in_time_and_doubted_after_a_miss() -> None:
    from kvstrata.router.followups import FollowUps

    f = FollowUps(window_s=1.0)
    a = hashes(1, 4)
    assert not f.expected(a)
    f.ended(a, "http://e0", now=10.0)
    assert f.arrived(hashes(2, 9), now=10.1) is None  # another group's request extends nothing
    assert f.arrived(extend(a, 7, 8), now=10.2) == FollowUp(a[-1], "http://e0", 4, a[0])
    assert f.expected(a) and f.expected(hashes(1, 9))  # the group: its first block
    f.ended(extend(a, 7, 8), "http://e0", now=11.0)
    assert f.arrived(extend(a, 7, 8, 9), now=12.5) is None  # too late: a miss
    assert not f.expected(a)
    f.ended(a, "http://e0", now=20.0)
    assert f.arrived(array("Q", [*a, *range(500, 600)]), now=20.1) is None  # extended by 100 blocks: no turn


def test_with_only_evicted_a_group_is_expected_back_once_its_follow_ups_find_their_blocks_gone() -> None:
    from kvstrata.router.followups import FollowUps

    f = FollowUps(window_s=1.0, only_evicted=True)
    a = hashes(1, 4)
    f.ended(a, "http://e0", now=10.0)
    follow_up = f.arrived(extend(a, 7), now=10.1)
    assert follow_up is not None and not f.expected(a)  # followed in time, but nothing evicted yet known
    f.found(follow_up, held_blocks=4)  # the engine still held all 4 blocks it left there
    assert not f.expected(a)
    f.found(follow_up, held_blocks=1)  # 3 of them evicted before the follow-up came
    assert f.expected(a) and not FollowUps(1.0).expected(a)
    f.found(follow_up, held_blocks=4)
    assert not f.expected(a)  # the newest observation weighs half: kept only while evictions go on


async def test_a_follow_up_is_not_held_back_by_the_room_kept_for_another_conversation() -> None:
    """Two conversations of one tenant end on a pool that holds one: each keeps its room, and each
    follow-up takes its own at once instead of waiting for the other's window to end."""
    w = World(10, settings=AdmissionSettings(anticipate_seconds=5.0, anticipate_only_evicted=False))
    tenant = hashes(1, 3)
    convs = [extend(tenant, 10 + c, 20 + c, 30 + c) for c in range(2)]  # 6 blocks each, 3 shared
    running = []
    for conv in convs:  # teach the group that its requests are followed at once
        first = await w.gate.admit(w.decision(conv[:-1], 0), 0)
        w.gate.release(first.claim, ended=True)
        running.append(await w.gate.admit(w.decision(conv, 0), 0))
    for grant in running:
        w.gate.release(grant.claim, ended=True)
    assert w.gate.reserved_blocks(w.eps[0]) == 9  # both kept: 3 shared + 3 + 3
    follow_up = await asyncio.wait_for(w.gate.admit(w.decision(extend(convs[0], 40, 41, 42), 0), 0), 1)
    assert follow_up.how is Admitted.RESERVED  # 9 of its blocks beside the other's 6: not "no room"
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 3), 0), 0))
    await asyncio.sleep(0.05)
    assert not cold.done()  # the other conversation's room still keeps a cold request out
    cold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cold


def _in_turn(*pools: int) -> World:
    return World(*pools, settings=AdmissionSettings(prefill_in_turn=True))


async def test_prefills_in_turn_the_next_waits_for_the_first_token_of_one_as_long() -> None:
    """A pool with room for both: with prefillInTurn the second prefill of as many tokens waits for the
    first one's first token (not its end), then goes; off, both go at once."""
    off = World(100)
    a = await off.gate.admit(off.decision(hashes(1, 8), 0), 0)
    b = await off.gate.admit(off.decision(hashes(2, 8), 0), 0)
    assert a.how is b.how is Admitted.DIRECT

    w = _in_turn(100)
    first = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    assert first.how is Admitted.DIRECT and first.claim is not None and first.claim.prefill == 8 * BS
    second = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not second.done() and w.gate.held() == 1
    w.gate.prefilled(first.claim)  # its first token is out; it still runs (decodes)
    grant = await asyncio.wait_for(second, 1)
    assert grant.how is Admitted.QUEUED and grant.endpoint is w.eps[0]
    assert w.gate.in_flight_blocks(w.eps[0]) == 16  # both run: the first's blocks are still counted
    w.gate.prefilled(first.claim)  # told twice (first token, then the try's end): once counts
    assert grant.claim is not None and grant.claim.prefill == 8 * BS


async def test_prefills_in_turn_the_cheapest_held_goes_next_and_a_one_block_prefill_never_waits() -> None:
    w = _in_turn(100)
    long_ = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    tiny = await w.gate.admit(w.decision(hashes(3, 1), 0), 0)  # one block: never waits
    assert tiny.how is Admitted.DIRECT and tiny.claim is not None and tiny.claim.prefill == -1
    older = asyncio.ensure_future(w.gate.admit(w.decision(hashes(4, 6), 0), 0))
    await asyncio.sleep(0.01)
    newer = asyncio.ensure_future(w.gate.admit(w.decision(hashes(5, 3), 0), 0))  # shorter, yet waits
    await asyncio.sleep(0.01)
    assert not older.done() and not newer.done() and w.gate.held() == 2
    w.gate.prefilled(tiny.claim)  # a one-block prefill holds nobody back
    await asyncio.sleep(0.01)
    assert not older.done() and not newer.done()
    w.gate.prefilled(long_.claim)
    await asyncio.sleep(0.01)
    # The 3-block prompt goes first (cheapest), the older 6-block one after it.
    assert newer.done() and (await newer).how is Admitted.QUEUED and not older.done()
    w.gate.release((await newer).claim)  # a try that ends before its first token frees the turn too
    assert (await asyncio.wait_for(older, 1)).how is Admitted.QUEUED


async def test_prefills_in_turn_an_idle_engine_takes_a_cold_prefill_waiting_for_a_busy_one() -> None:
    w = _in_turn(100, 100)
    busy = await w.gate.admit(w.decision(hashes(1, 8), 0), 0)
    other = await w.gate.admit(w.decision(hashes(9, 8), 1), 0)
    w.held["http://e0"].update(hashes(3, 8))
    warm = asyncio.ensure_future(w.gate.admit(w.decision(array("Q", [*hashes(3, 8), 1, 2]), 0), 0))
    cold = asyncio.ensure_future(w.gate.admit(w.decision(hashes(2, 8), 0), 0))
    await asyncio.sleep(0.01)
    assert not warm.done() and not cold.done()
    w.gate.prefilled(other.claim)  # e1's prefill is over: the cold one costs it no more than e0
    grant = await asyncio.wait_for(cold, 1)
    assert grant.how is Admitted.STOLEN and grant.endpoint is w.eps[1]
    assert not warm.done()  # its prefix is at e0: it waits for e0's turn
    w.gate.prefilled(busy.claim)
    assert (await asyncio.wait_for(warm, 1)).how is Admitted.QUEUED
