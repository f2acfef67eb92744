"""Admission: the engine's waiting queue, held in the router while the router can still choose.

An engine whose KV pool is full of its running requests' blocks cannot start another request: vLLM
queues it first come, first served, and with chunked prefill it may start several and then preempt
(recompute) one when the pool runs out. Under memory pressure that queue decides the hit rate: while a
follow-up waits behind a cold prompt, the cold prompt's prefill evicts the follow-up's cached prefix
(seen in the family benchmark: the index predicted 71 % cached, the engines served 32 %, at one
running request per engine).

So a request whose engine has no room for it is held here instead, and when room frees the engine gets
the held request that costs it the least prefill now (its cached prefix is still there: serve it before
something evicts it), oldest first among equals; of many held, only the oldest few of each engine are
weighed (``_WEIGHED``), so what holding costs the router stays bounded under a burst. A held request
whose prefix no engine holds better goes to whichever engine frees room first (*stolen*), since moving
it loses none of its own hit (``stealWhenHomeHoldsNoMore``; off, it waits for its own engine while that
one is in rotation; with ``stealOnlyToSpareRoom`` only to an engine with room for it beside everything
routed there lately). With ``moveWhenHeldPastPrefill`` (off by default) a held request whose prefix its
home holds better also *moves* to an engine with room once it has waited as long as moving would cost
there, at that engine's recent pace: its extra prefill, and the prefill of the cached blocks that
evicts (rent or buy: built for family draw 15, where 12 of 32 requests were held 3.4 s in all for their
home while a third engine sat idle). It is off: on held-out pressure draws it cost 1.7 hit points and
6 % of mean TTFT (3.6 points without the eviction term): what a moved request adds evicts what the
other engine's own conversations come back for. ``moveToSpareRoom`` (off by default) moves only where
the request's blocks fit beside everything routed there lately, after its extra prefill there alone.
Nothing is held longer than ``maxHoldSeconds``:
then it goes to its engine's own queue, as it would have without the gate. Cheapest-first alone
starves a long cold prompt while cheaper follow-ups keep coming; with ``overdueAfterPrefills`` (off by
default: on held-out pressure draws it cost hit rate and TTFT) a request that has waited that many times
its own prefill there goes before cheaper ones, oldest first (*overdue*).

With ``anticipateSeconds`` (router/followups.py) a request that ends keeps its blocks' room on its engine
for that long when its prefix group's requests are usually followed at once (agents, closed loops): a
held request that would evict them waits until the follow-up arrives, which then goes first
(*reserved*), or until the window ends. With ``anticipateOnlyEvicted`` a group keeps rooms only once
its follow-ups have found their blocks evicted: where nothing evicts them a kept room saves no prefill.

With ``prefillInTurn`` (off by default) a request also waits while its engine computes the prefill of
another request of ours (sent, no first token yet): on a compute-bound engine two prefills batched in one
step share it, so both first tokens come as late as the second's alone would, where in turn the first
comes sooner and the second no later. vLLM schedules the prefills it runs first come, first served in
chunks of its token budget, so a short prompt sent beside a long one waits for the long one's chunks
anyway: the one that goes when a prefill ends is the engine's cheapest held request (non-preemptive
shortest first). A prefill of one block or less never waits nor holds others back: it adds at most a
block to a step.

*Room* is this router's own count: the distinct blocks its in-flight requests pin on the engine (a
prefix shared by several counts once), plus each one's output, against the pool size the engine reports
(``num_gpu_blocks``, less the one vLLM keeps as its null block). Nothing is held while an engine has
nothing of ours in flight, or its pool size is unknown, or the request's size is (character-block
fallback). With several router replicas each
counts only its own requests; the engine's queue takes the rest, as without the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import kvstrata_native
from mypy_extensions import mypyc_attr

from kvstrata.api.router_config import AdmissionSettings, TierWeights
from kvstrata.router.decision import Decision
from kvstrata.router.followups import FollowUp, FollowUpLearner, NativeFollowUps
from kvstrata.router.index import PrefixMatch
from kvstrata.router.pool import Endpoint
from kvstrata.router.scoring import credited_blocks, uncached_tokens

__all__ = ["Admitted", "Claim", "Gate", "Grant"]

# A child of the decision log: `kvstrata router --log-decisions` shows holds and grants beside decisions.
log = logging.getLogger("kvstrata.router.route.admission")

# How often the gate looks again at its held requests without being woken (an ejection, a scrape that
# learned a pool size): a wake-up comes with every release, so this only bounds staleness. One look for
# all of them: each held request looking on its own timer made every look weigh every held request, so
# the loop's work grew with the square of how many were held (make bench-admission: 100 held requests
# took 1.2 s of CPU per idle second, 1,000 saturated the loop).
_RECHECK_S = 0.5

# How many held requests a pass of the gate weighs (one index lookup each, and a cost where it asks),
# shared among the engines holding some: each engine's oldest ``_WEIGHED // engines``, at least
# ``_WEIGHED_MIN``. A pass runs on every release, so weighing all of them made each release cost the loop
# milliseconds per hundred held (bench-admission: 76 ms at 1,000). The cheapest of an engine's oldest
# few goes first; one further back waits until it is among them or its hold ends. The family benchmark
# never held more than 7 requests at once, so its decisions are those of weighing all.
_WEIGHED = 96
_WEIGHED_MIN = 4


class Admitted(StrEnum):
    """How a request got its engine (the ``x-kvstrata-admission`` header and the metric's label)."""

    DIRECT = "direct"  # its engine had room at once
    QUEUED = "queued"  # held until its engine had room
    STOLEN = "stolen"  # held, then sent to another engine with room that holds as much of its prompt
    MOVED = "moved"  # held as long as moving would cost, then sent to another engine with room
    RESERVED = "reserved"  # the request it extends had just ended there and kept its room for it
    OVERDUE = "overdue"  # held as long as its own prefill takes there, then sent before cheaper ones
    EXPIRED = "expired"  # held maxHoldSeconds, then sent to its engine's own queue
    UNGATED = "ungated"  # not held: gate off, size or pool unknown, or not a routed request


@dataclass(eq=False, slots=True)
class Claim:
    """A request's blocks on one engine while it runs there."""

    endpoint: Endpoint
    hashes: Sequence[int]
    blocks: int  # every block it pins: its prompt's full blocks, the partial last one, its output's
    # Whose blocks: a prompt routed on its leading blocks is hashed whole later (Gate.rehashed).
    decision: Decision | None = None
    output: int = 0  # output tokens counted in ``blocks``
    # Its uncached prompt tokens there while its prefill runs (prefillInTurn); -1 once its first token
    # is out, when prefills are not taken in turn, or for a prefill of a block or less.
    prefill: int = -1


@dataclass(frozen=True, slots=True)
class Grant:
    endpoint: Endpoint
    how: Admitted
    held_s: float
    claim: Claim | None
    output: int  # output tokens its claims count; a retry's claim counts as many


@dataclass(eq=False, slots=True)
class _Waiter:
    decision: Decision
    home: Endpoint
    output: int
    claim_blocks: int
    since: float
    future: asyncio.Future[Grant]
    # As of pass ``weighed``: what the index holds of it, and its cost per endpoint URL, each cost filled
    # in when the pass first asks (Gate._cost_of).
    weighed: int = -1
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    keys: dict[str, float] = field(default_factory=dict)
    move_at: float = math.inf  # monotonic time it may move to some other engine (this pump's estimate)
    follow_up: FollowUp | None = None  # the request it extends ended within the window, keeping no room


@dataclass(slots=True)
class GateDeps:
    """What the gate reads from the router: the index, the tier credit, and whether an engine is in
    rotation and heard from (a held request never waits on an ejected or silent engine)."""

    lookup: Callable[[Sequence[int]], dict[str, PrefixMatch]]
    tiers: TierWeights
    block_size: int
    usable: Callable[[Endpoint], bool]  # healthy and in rotation (not ejected)
    silent: Callable[[Endpoint], bool]  # not heard from lately: likely wedged
    endpoints: Callable[[], list[Endpoint]]
    indexed_blocks: Callable[[Endpoint], int]  # blocks the index says the engine holds
    # A request starts waiting for ``home``: it counts as routed there (the index predicts its blocks
    # there, so the rest of its prefix group follows it instead of spreading while it waits).
    commit: Callable[[Decision, Endpoint], None]
    # A held request left its home for another engine: its prediction at the home is void. (The
    # scorers' own hooks are not undone: a moved request counts as recent traffic at both engines.)
    moved: Callable[[Decision, Endpoint], None]
    # Whether ``blocks`` more fit in the engine's pool beside every block routed there lately (the fit
    # scorer's demand, as of monotonic ``now``): a copy there evicts nothing lately asked for.
    spare_room: Callable[[Endpoint, int, float], bool] = lambda ep, blocks, now: False
    # Whether ``ep`` serves more than its share of the live conversations, floor(N / engines) of N, as of
    # monotonic ``now`` (False while conversations are not tracked): one more there is one too many.
    crowded: Callable[[Endpoint, float], bool] = lambda ep, now: False


@mypyc_attr(allow_interpreted_subclasses=True)
class Gate:
    def __init__(
        self, settings: AdmissionSettings, max_hold_s: float, deps: GateDeps, *, surviving: bool = False
    ) -> None:
        self.settings = settings
        # Held requests are costed by what their engines will still hold when they can start (surviving).
        self.surviving_costs = surviving
        self.max_hold_s = max_hold_s
        self.deps = deps
        # Attributes, not module globals, so that a test may set them whether or not this module is
        # compiled (kvstrata/compiled.py: compiled code reads module globals once).
        self.clock: Callable[[], float] = time.monotonic
        self.recheck_s = _RECHECK_S
        self.weighed = _WEIGHED
        self.weighed_min = _WEIGHED_MIN
        self._claims: dict[str, dict[Claim, None]] = {}  # per endpoint URL, in order of claiming
        # The distinct blocks the claims pin per engine, alone and with the rooms kept for follow-ups,
        # and the kept rooms themselves (native/src/rooms.rs).
        self._rooms = kvstrata_native.Rooms()
        # prefillInTurn: per endpoint URL, the claims whose prefill runs there.
        self._prefilling: dict[str, dict[Claim, None]] = {}
        self._held_at: dict[Endpoint, list[_Waiter]] = {}  # held requests by home, in arrival order
        self._recheck: asyncio.TimerHandle | None = None
        self._room_ends: asyncio.TimerHandle | None = None  # see _pass_when_a_room_ends
        self._passes = 0  # pump passes so far: a waiter's costs are weighed once per pass
        self._usable: set[str] = set()  # during a pass: the URLs in rotation
        self._followups: FollowUpLearner = NativeFollowUps(
            settings.anticipate_seconds, only_evicted=settings.anticipate_only_evicted
        )

    # --- bookkeeping -----------------------------------------------------------------------------
    def output(self, output_tokens: int | None) -> int:
        """Output tokens counted for a request that asks for ``output_tokens`` (None: unbounded)."""
        return self.settings.assumed_output_tokens if output_tokens is None else max(output_tokens, 0)

    def blocks(self, decision: Decision, output: int) -> int | None:
        """Blocks the request will pin, or None when its token count is unknown."""
        if decision.prompt_tokens is None or decision.approximate:
            return None
        return math.ceil((decision.prompt_tokens + output) / self.deps.block_size)

    def claim(self, ep: Endpoint, decision: Decision, output: int, prefill: float = -1.0) -> Claim | None:
        """Count a request's blocks on ``ep`` until :meth:`release` (a retry claims where it goes);
        ``prefill``: its uncached tokens there, when known (else the decision's estimate)."""
        blocks = self.blocks(decision, output)
        if blocks is None:
            return None
        self._rooms.pin(ep.url, decision.hashes, blocks)
        return self._claimed(ep, decision, output, blocks, prefill)

    def _claimed(
        self, ep: Endpoint, decision: Decision, output: int, blocks: int, prefill: float = -1.0
    ) -> Claim:
        """The claim of blocks just pinned on ``ep``; with prefillInTurn its prefill (``prefill`` uncached
        tokens, else the decision's estimate) counts as running there until :meth:`prefilled` or
        :meth:`release`."""
        c = Claim(ep, decision.hashes, blocks, decision, output)
        self._claims.setdefault(ep.url, {})[c] = None
        if self.settings.prefill_in_turn:
            tokens = round(prefill) if prefill >= 0 else decision.uncached_tokens(ep, self.deps.block_size)
            if tokens > self.deps.block_size:
                c.prefill = tokens
                self._prefilling.setdefault(ep.url, {})[c] = None
        return c

    def prefilled(self, claim: Claim | None) -> None:
        """``claim``'s request has its first token (or its try ended): its engine may start the next
        prefill (prefillInTurn)."""
        if claim is None or claim.prefill < 0:
            return
        claim.prefill = -1
        running = self._prefilling.get(claim.endpoint.url)
        if running is not None:
            running.pop(claim, None)
        if self._held_at:
            self.pump()

    def prefill_in_turn(self, ep: Endpoint) -> int:
        """Uncached tokens of the prefills of ours running on ``ep`` that hold its turn (prefillInTurn)."""
        return sum(c.prefill for c in self._prefilling.get(ep.url, {}))

    def in_turn(self, ep: Endpoint, prefill: float) -> bool:
        """Whether a prefill of ``prefill`` uncached tokens may start on ``ep`` now: always, unless
        prefillInTurn, it is longer than a block, and a request of ours computes one there."""
        return prefill <= self.deps.block_size or not self._prefilling.get(ep.url)

    def rehashed(self, decision: Decision) -> None:
        """A prompt routed on its leading blocks is hashed whole: its claims and its wait count its real
        size, and share its whole prefix with the requests beside it, not only the leading blocks.

        Seen in the family benchmark: a cold prompt's claim kept its two leading hashes and a size
        estimated from characters, so each follow-up sharing its 42-block system prompt counted as 44
        blocks more on a 48-block pool and was held 0.3-0.7 s behind it instead of running beside it."""
        for claims in self._claims.values():
            for c in claims:
                if c.decision is decision and (n := self.blocks(decision, c.output)) is not None:
                    url = c.endpoint.url
                    self._rooms.unpin(url, c.hashes, c.blocks)
                    c.hashes, c.blocks = decision.hashes, n
                    self._rooms.pin(url, c.hashes, c.blocks)
        for held in self._held_at.values():
            for w in held:
                if w.decision is decision and (n := self.blocks(decision, w.output)) is not None:
                    w.claim_blocks = n
        if self._held_at:
            self.pump()

    def release(self, claim: Claim | None, *, ended: bool = False) -> None:
        """``claim``'s request is over on its engine; ``ended``: it was answered in full (not failed,
        nor left by its client), so a follow-up may come: where its group usually sends one at once,
        its room is kept for it (its blocks stay counted among the kept) for ``anticipateSeconds``."""
        if claim is None:
            return
        url = claim.endpoint.url
        claims = self._claims.get(url)
        if claims is not None and claim in claims:
            del claims[claim]
            if claim.prefill >= 0:
                claim.prefill = -1
                self._prefilling[url].pop(claim, None)
            now = self.clock()
            window = self.settings.anticipate_seconds
            if ended and window > 0 and self._followed(claim, now):
                self._rooms.unpin(url, claim.hashes, claim.blocks, claim.endpoint, now + window, now)
                log.debug(
                    "reserve prefix=%016x blocks=%d at %s for %.3fs",
                    claim.hashes[0],
                    claim.blocks,
                    url,
                    window,
                )
                self._pass_when_a_room_ends()
            else:
                self._rooms.unpin(url, claim.hashes, claim.blocks)
        if self._held_at:
            self.pump()

    def _followed(self, claim: Claim, now: float) -> bool:
        """``claim``'s request ended well: whether its group usually sends a follow-up in the window."""
        self._followups.ended(claim.hashes, claim.endpoint.url, now)
        return self._followups.expected(claim.hashes)

    def _take_reservation(self, follow_up: FollowUp | None, now: float) -> Endpoint | None:
        """The engine where the request ``follow_up`` extends kept its room, or None. The room is given
        up: the follow-up claims it."""
        if follow_up is None:
            return None
        ep: Endpoint | None = self._rooms.take(follow_up.last, now)
        return ep

    def in_flight_blocks(self, ep: Endpoint) -> int:
        return self._rooms.in_flight(ep.url)

    def reserved_blocks(self, ep: Endpoint) -> int:
        """Blocks kept on ``ep`` for follow-ups of requests that ended there."""
        return self._rooms.reserved(ep.url, self.clock())

    def held(self) -> int:
        return sum(map(len, self._held_at.values()))

    def fits(self, ep: Endpoint, blocks: int, hashes: Sequence[int] = (), *, kept: bool = True) -> bool:
        """Room for ``blocks`` more on ``ep``: always when nothing of ours runs there (nor is kept for a
        follow-up) or its pool is unknown (a request larger than the pool must still run, and the engine
        says if it cannot). ``kept``: rooms kept for follow-ups count as taken."""
        return self._rooms.fits(ep.url, ep.kv_blocks, hashes, blocks, kept=kept, now=self.clock())

    # --- admission -------------------------------------------------------------------------------
    async def admit(self, decision: Decision, output_tokens: int | None) -> Grant:
        """The engine this request goes to first, when it may go: at once where its best engine has
        room, else when room frees somewhere that serves it as well (or after ``maxHoldSeconds``)."""
        home = decision.order[0]
        out = self.output(output_tokens)
        blocks = self.blocks(decision, out)
        if not self.settings.enabled or blocks is None or decision.request is None:
            return Grant(home, Admitted.UNGATED, 0.0, self.claim(home, decision, out), out)
        unkept: FollowUp | None = None
        now = self.clock()
        if self.settings.anticipate_seconds > 0:
            follow_up = self._followups.arrived(decision.hashes, now)
            # The room its conversation's last request kept is its own: it goes before those held there.
            # Rooms kept for other conversations do not hold it back: they keep out requests that would
            # evict them for nothing, not each other's follow-ups (first ablation, draw 91: two
            # conversations on one pool each kept a room, and each one's follow-up waited for the other's
            # window to end).
            kept_at = self._take_reservation(follow_up, now)
            if kept_at is None:
                unkept = follow_up  # it reports, once it goes, whether its blocks outlived no kept room
            if (
                kept_at is home
                and self._starts_now(home, decision)
                and self._rooms.pin_if_fits(
                    home.url, home.kv_blocks, decision.hashes, blocks, now, kept=False
                )
            ):
                log.debug("reserved prefix=%016x blocks=%d -> %s", decision.hashes[0], blocks, home.url)
                return Grant(home, Admitted.RESERVED, 0.0, self._claimed(home, decision, out, blocks), out)
            if kept_at is not None and self._held_at:
                self.pump()  # routed elsewhere: the room kept for it is free
        if (
            not self._waiting_for(home)
            and self._starts_now(home, decision)
            and self._rooms.pin_if_fits(home.url, home.kv_blocks, decision.hashes, blocks, now)
        ):
            self._found(unkept, decision.matches)
            return Grant(home, Admitted.DIRECT, 0.0, self._claimed(home, decision, out, blocks), out)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(decision, home, out, blocks, self.clock(), loop.create_future(), follow_up=unkept)
        self._held_at.setdefault(home, []).append(waiter)
        self.deps.commit(decision, home)
        log.debug(
            "hold prefix=%016x blocks=%d at %s: %d blocks of %d in flight there, %d prefill tokens in turn, "
            "%d held",
            decision.hashes[0] if decision.hashes else 0,
            blocks,
            home.url,
            self.in_flight_blocks(home),
            home.kv_blocks,
            self.prefill_in_turn(home),
            self.held(),
        )
        self.pump()
        self._recheck_later()
        self._pass_when_a_room_ends()
        try:
            while not waiter.future.done():
                now = self.clock()
                left = waiter.since + self.max_hold_s - now
                if left <= 0:
                    self._grant(waiter, waiter.home, Admitted.EXPIRED)
                    break
                # Wake when it may move, too: a release wakes the gate, the end of a wait does not.
                until_move = waiter.move_at - now
                await asyncio.wait(
                    (waiter.future,), timeout=min(left, until_move) if until_move > 0 else left
                )
                if not waiter.future.done() and self.clock() >= waiter.move_at:
                    self.pump()
            return waiter.future.result()
        except asyncio.CancelledError:
            # The client left while held, or just after its grant: give back what was granted.
            if waiter in self._held_at.get(waiter.home, ()):
                self._unhold(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result().claim)
            raise

    def _found(self, follow_up: FollowUp | None, matches: dict[str, PrefixMatch]) -> None:
        """A follow-up whose predecessor kept no room goes to an engine now: what the predecessor's engine
        holds of it on the GPU, as its events confirmed (not what the router predicts there: a held
        request's own prediction covers its prompt at its home), tells the group whether its turns
        lose their blocks in between. Read when it goes, not when it arrives: a request admitted as the
        predecessor ended evicts its blocks while the follow-up waits (first ablation, nineteenth
        session: read at arrival, no follow-up in 16 pressure draws had yet lost a block)."""
        if follow_up is None:
            return
        m = matches.get(follow_up.endpoint)
        held = m.gpu if m else 0
        self._followups.found(follow_up, held)
        if held < follow_up.blocks:
            log.debug(
                "evicted prefix=%016x: %d of %d blocks left at %s",
                follow_up.group,
                held,
                follow_up.blocks,
                follow_up.endpoint,
            )

    def _waiting_for(self, ep: Endpoint) -> bool:
        return ep in self._held_at

    def _starts_now(self, ep: Endpoint, decision: Decision) -> bool:
        """:meth:`in_turn` for a request arriving for ``ep`` (its prefill as the decision estimated it)."""
        return not self._prefilling or self.in_turn(ep, decision.uncached_tokens(ep, self.deps.block_size))

    def _unhold(self, waiter: _Waiter) -> None:
        mine = self._held_at[waiter.home]
        mine.remove(waiter)
        if not mine:
            del self._held_at[waiter.home]

    def _pass_when_a_room_ends(self) -> None:
        """When a kept room's window ends the room is back: admit into it. A pass at the end of each
        window while any request is held, as one timer for the earliest (not one per room: at thousands
        of requests a second, that was a timer, and a wake of the event loop, per request; none is
        needed while nothing is held, and a request held later arms it). Without a running loop, in a
        unit test, the held requests' own rechecks find the room expired."""
        if self._room_ends is not None or not self._held_at:
            return
        now = self.clock()
        ends = self._rooms.next_end(now)
        if ends == math.inf:
            return
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            self._room_ends = loop.call_at(loop.time() + (ends - now), self._room_ended)

    def _room_ended(self) -> None:
        self._room_ends = None
        try:
            self.pump()
        finally:
            self._pass_when_a_room_ends()

    def _recheck_later(self) -> None:
        """One look at every held request in ``recheck_s``, and again after it while any is held."""
        if self._recheck is None and self._held_at:
            self._recheck = asyncio.get_running_loop().call_later(self.recheck_s, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        try:
            self.pump()
        finally:
            self._recheck_later()

    def _grant(self, waiter: _Waiter, ep: Endpoint, how: Admitted) -> None:
        self._unhold(waiter)
        if ep is not waiter.home:
            self.deps.moved(waiter.decision, ep)
        held = self.clock() - waiter.since
        if waiter.follow_up is not None:
            self._found(waiter.follow_up, self.deps.lookup(waiter.decision.hashes))
        claim = self.claim(ep, waiter.decision, waiter.output, waiter.keys.get(ep.url, -1.0))
        log.debug(
            "%s prefix=%016x after %.3fs -> %s (cost %.0f tokens there, %.0f at %s)",
            how,
            waiter.decision.hashes[0] if waiter.decision.hashes else 0,
            held,
            ep.url,
            waiter.keys.get(ep.url, -1),
            waiter.keys.get(waiter.home.url, -1),
            waiter.home.url,
        )
        waiter.future.set_result(Grant(ep, how, held, claim, waiter.output))

    def _cost(self, waiter: _Waiter, ep: Endpoint, matches: dict[str, PrefixMatch]) -> float:
        """Prompt tokens ``ep`` must compute for the waiter now: what it holds (not what the router
        predicted, which may be the waiter's own prediction) or what our in-flight requests there are
        computing (they will hold it by the time this one runs)."""
        d = waiter.decision
        m = matches.get(ep.url)
        if m:
            m = m._replace(predicted=0)
            if self.surviving_costs:
                m = self.surviving(ep, m, d.hashes)
        held = credited_blocks(m, self.deps.tiers) if m else 0.0
        running = self._running(ep, d.hashes)
        return uncached_tokens(d.prompt_tokens, len(d.hashes), max(held, running), self.deps.block_size)

    def _running(self, ep: Endpoint, hashes: Sequence[int]) -> int:
        """The most leading blocks a prompt shares with a request of ours running on ``ep`` (as the pass
        began, in a pass; two comparisons, not one per running request: a GPU engine runs hundreds)."""
        return self._rooms.longest_shared(ep.url, hashes)

    def surviving_matches(
        self, matches: dict[str, PrefixMatch], hashes: Sequence[int], eps: Sequence[Endpoint]
    ) -> dict[str, PrefixMatch]:
        """``matches`` (the index's, per endpoint URL) as :meth:`surviving` leaves them; an engine left
        holding none of the prompt drops out, as if the index held none of it (then the history and
        eviction scorers speak for it)."""
        if not matches:
            return matches
        by_url = {ep.url: ep for ep in eps}
        left: dict[str, PrefixMatch] = {}
        for url, m in matches.items():
            ep = by_url.get(url)
            kept = m if ep is None else self.surviving(ep, m, hashes)
            if kept.blocks:
                left[url] = kept
        return left

    def surviving(self, ep: Endpoint, m: PrefixMatch, hashes: Sequence[int]) -> PrefixMatch:
        """What of ``m`` (``ep``'s cached prefix of a prompt, as the index says) ``ep`` will still hold
        when the prompt can start there. The blocks it shares with our requests running there stay (they
        are in use); the rest are free blocks, and a pool that cannot hold both them and what those
        requests pin (prompts and outputs) evicts the excess first as they run, before the prompt can
        start, since it starts only once room frees. vLLM frees a request's blocks tail first, so the
        prefix's leading blocks are the last to go: the first ``kept`` blocks stay. The engine's events
        report the evictions only after the step that makes them (a CPU prefill step takes ~0.5 s), so
        without this a request follows a prefix its engine is about to lose (family draw 844: 62 % of
        prompt tokens predicted cached, 43 % served; held requests 70 % predicted, 41 % served).
        Only GPU blocks and predictions are clipped: the CPU and storage tiers are not the pool."""
        if ep.kv_blocks <= 0 or m.cpu or m.storage:
            return m
        kept = self._rooms.surviving(ep.url, ep.kv_blocks, hashes, m.blocks)
        if kept >= m.blocks:
            return m
        predicted = min(m.predicted, kept)  # as counted by credited_blocks: only the sum matters
        return PrefixMatch(kept, kept - predicted, 0, 0, predicted)

    def _cost_of(self, w: _Waiter, ep: Endpoint) -> float:
        """``w``'s prefill cost at ``ep`` as of this pass's start (infinite out of rotation). Filled in
        when first asked: a pass under a burst asks each weighed request about one or two engines, not
        every engine (32 engines: bench-admission)."""
        cost = w.keys.get(ep.url)
        if cost is None:
            if ep.url not in self._usable:
                return math.inf
            cost = w.keys[ep.url] = self._cost(w, ep, w.matches)
        return cost

    def _may_move(self, w: _Waiter, ep: Endpoint, usable: list[Endpoint], now: float) -> Admitted | None:
        """Whether held ``w`` may leave its home for ``ep`` now, and how: STOLEN when it loses nothing
        there (or its home cannot serve it), MOVED when it has waited as long as moving would cost
        (:meth:`_move_at`)."""
        if w.home not in usable or self.deps.silent(w.home):
            return Admitted.STOLEN
        if w.decision.sticky:
            return None  # a follow-up waits for its conversation's engine (stickyConversations)
        here, home = self._cost_of(w, ep), self._cost_of(w, w.home)
        s = self.settings
        if (
            s.steal_when_home_holds_no_more
            and here <= home + self.deps.block_size
            and (not s.steal_only_to_spare_room or self.deps.spare_room(ep, self._added_blocks(w, ep), now))
            and not (s.steal_keeps_conversations_even and self.deps.crowded(ep, now))
        ):
            return Admitted.STOLEN
        return Admitted.MOVED if now >= self._move_at(w, ep, here - home, now) else None

    def _move_at(self, w: _Waiter, ep: Endpoint, extra_tokens: float, now: float) -> float:
        """When ``w`` has waited as long as moving to ``ep`` would cost there (infinite: never).

        ``moveWhenHeldPastPrefill``: its extra prefill, plus the prefill of the cached blocks that
        prefill evicts (if they are asked for again: an upper bound; blocks no index entry holds are
        free to fill). ``moveToSpareRoom``: its extra prefill alone, and only where its blocks fit
        beside everything routed there lately, so that what it evicts is not about to be asked for."""
        if extra_tokens <= 0:
            return math.inf
        s = self.settings
        at = math.inf
        if s.move_when_held_past_prefill:
            bs = self.deps.block_size
            new_blocks = math.ceil(extra_tokens / bs)
            free = max(ep.kv_blocks - 1 - self.deps.indexed_blocks(ep), 0) if ep.kv_blocks > 0 else new_blocks
            prefill_s = ep.pace.seconds_for(extra_tokens + max(new_blocks - free, 0) * bs)
            if prefill_s is not None:
                at = w.since + prefill_s
        if s.move_to_spare_room and self.deps.spare_room(ep, self._added_blocks(w, ep), now):
            prefill_s = ep.pace.seconds_for(extra_tokens)
            if prefill_s is not None:
                at = min(at, w.since + prefill_s)
        return at

    @staticmethod
    def _added_blocks(w: _Waiter, ep: Endpoint) -> int:
        """The blocks of ``w``'s prompt that ``ep`` does not hold (as the pass's lookup saw it)."""
        m = w.matches.get(ep.url)
        return len(w.decision.hashes) - (m.blocks if m else 0)

    def _overdue(self, w: _Waiter, now: float) -> bool:
        """Whether held ``w`` has waited ``overdueAfterPrefills`` times its own prefill at its home, at
        that engine's recent pace (never before a pace is known). Cheapest-first alone starves a long
        cold prompt for as long as cheaper follow-ups keep coming (family draw 251: held 4.4 s behind
        another tenant's turns); bounding each wait by the request's own prefill bounds its slowdown."""
        factor = self.settings.overdue_after_prefills
        if factor <= 0:
            return False
        prefill_s = w.home.pace.seconds_for(self._cost_of(w, w.home))
        return prefill_s is not None and now - w.since >= factor * prefill_s

    def _next_of_own(self, ep: Endpoint, mine: list[_Waiter], now: float) -> tuple[_Waiter, Admitted]:
        """Which of the requests held for ``ep`` goes when room frees there: the oldest overdue one,
        else the cheapest (oldest among equals)."""
        if overdue := [w for w in mine if self._overdue(w, now)]:
            return min(overdue, key=lambda w: w.since), Admitted.OVERDUE
        return min(mine, key=lambda w: (self._cost_of(w, ep), w.since)), Admitted.QUEUED

    def _weigh(self, w: _Waiter, usable: list[Endpoint]) -> _Waiter:
        """What the index holds of ``w`` now (once per pass; its costs follow from it, when asked), and
        when it may move."""
        if w.weighed != self._passes:
            w.weighed = self._passes
            w.matches = self.deps.lookup(w.decision.hashes)
            w.keys = {}
            w.move_at = math.inf
            moves = self.settings.move_when_held_past_prefill or self.settings.move_to_spare_room
            if moves and not w.decision.sticky:
                home, now = self._cost_of(w, w.home), self.clock()
                w.move_at = min(
                    (
                        self._move_at(w, ep, self._cost_of(w, ep) - home, now)
                        for ep in usable
                        if ep is not w.home
                    ),
                    default=math.inf,
                )
        return w

    def _weighed(self, held: list[_Waiter], usable: list[Endpoint]) -> list[_Waiter]:
        """The oldest of ``held`` (one engine's), as many as a pass weighs, weighed."""
        each = max(self.weighed_min, self.weighed // max(len(self._held_at), 1))
        return [self._weigh(w, usable) for w in held[:each]]

    def _candidates(self, usable: list[Endpoint]) -> list[_Waiter]:
        """Every engine's held requests a pass weighs, weighed."""
        return [w for held in self._held_at.values() for w in self._weighed(held, usable)]

    def pump(self) -> None:
        """Send held requests where there is room: each engine its cheapest waiter (its own first,
        then one that may move there: see :meth:`_may_move`), until nothing more fits. Each engine's
        oldest few are weighed (``_WEIGHED``) as the pass begins. What is sent changes the rest's costs,
        so a cost asked later in the pass is the cost at its start (``Rooms.begin_pass``): a pass's
        choices are those of costing every weighed request everywhere first."""
        if not self._held_at:
            return
        self._passes += 1
        usable = [ep for ep in self.deps.endpoints() if self.deps.usable(ep)]
        self._usable = {ep.url for ep in usable}
        self._rooms.begin_pass()
        try:
            self._send(usable)
        finally:
            self._rooms.end_pass()

    def _send(self, usable: list[Endpoint]) -> None:
        """One pass's sending (see :meth:`pump`)."""
        self._candidates(usable)
        now = self.clock()
        progress = True
        while progress and self._held_at:
            progress = False
            for ep in usable:
                mine = self._weighed(self._held_at.get(ep, []), usable)
                if mine:
                    nxt, turn = self._next_of_own(ep, mine, now)
                    # An overdue request takes a room kept for a follow-up: else a conversation whose
                    # turns keep rooms holds it back turn after turn.
                    kept = turn is not Admitted.OVERDUE
                    if self.in_turn(ep, self._cost_of(nxt, ep)) and self.fits(
                        ep, nxt.claim_blocks, nxt.decision.hashes, kept=kept
                    ):
                        self._grant(nxt, ep, turn)
                        progress = True
                    continue
                # No request of its own waits: take the cheapest one that may move here.
                movable = [
                    (w, how) for w in self._candidates(usable) if (how := self._may_move(w, ep, usable, now))
                ]
                if movable:
                    best, how = min(movable, key=lambda m: (self._cost_of(m[0], ep), m[0].since))
                    if self.in_turn(ep, self._cost_of(best, ep)) and self.fits(
                        ep, best.claim_blocks, best.decision.hashes
                    ):
                        self._grant(best, ep, how)
                        progress = True
