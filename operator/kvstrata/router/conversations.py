"""Live conversations per engine, the bound that places a new conversation by them, and the filter that
keeps a follow-up on its conversation's engine.

A conversation is a chain of prompts, each extending the one before: the router sees it as the last
full block hash of each prompt it routed (the conversation's *tip*). A prompt whose blocks contain a
live tip continues that conversation; any other prompt opens one. The tracker keeps, per engine, the
tips routed there within ``window_s`` seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.router.index import PrefixMatch
from kvstrata.router.pool import Endpoint, faded
from kvstrata.router.reasons import Reason
from kvstrata.router.scoring import RouteRequest

# One follow-up a window ago, faded (the counters decay by e per window).
_ONE_WITHIN_WINDOW = math.exp(-1.0)


def fair_share_cap(conversations: int, engines: int) -> int:
    """The most of ``conversations`` live ones that one of ``engines`` engines may serve: floor(N / n) + 1
    (within one conversation of even, and a tenant's next user may still join its system prompt)."""
    return conversations // engines + 1


@dataclass(slots=True)
class ConversationTracker:
    window_s: float
    # Tip hash -> (endpoint URL, when last routed; monotonic), oldest first.
    tips: OrderedDict[int, tuple[str, float]] = field(default_factory=OrderedDict)
    live: dict[str, int] = field(default_factory=dict)
    # Prompts that continued a live conversation, and conversations that went quiet for a window, each
    # fading over the window, as of the monotonic time beside them.
    follows: tuple[float, float] = (0.0, 0.0)
    ended: tuple[float, float] = (0.0, 0.0)
    # The blocks those follow-ups added past their conversation's tip, faded alike: over ``follows``, the
    # recent mean growth of a turn.
    grown: tuple[float, float] = (0.0, 0.0)

    def continued_tip(self, hashes: Sequence[int]) -> int | None:
        """The live tip ``hashes`` contain (the conversation this prompt continues), or None."""
        at = self._continued_at(hashes)
        return None if at is None else hashes[at]

    def _continued_at(self, hashes: Sequence[int]) -> int | None:
        """Where in ``hashes`` a live tip is. Scanned from the end: a follow-up holds its
        conversation's tip a few blocks before its own."""
        tips = self.tips
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in tips:
                return i
        return None

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s
        tips = self.tips
        while tips:
            tip, (url, at) = next(iter(tips.items()))
            if at >= cutoff:
                break
            del tips[tip]
            self._leave(url)
            self.ended = self._bump(self.ended, at)  # dated at its last turn, as a follow-up is

    def live_on(self, url: str, now: float) -> int:
        self.expire(now)
        return self.live.get(url, 0)

    def live_total(self, now: float) -> int:
        self.expire(now)
        return sum(self.live.values())

    def mostly_multi_turn(self, now: float) -> bool:
        """Lately a prompt continued a conversation (about one within the last window, at least) and at
        least as many continued as ended: prompts are conversations with follow-ups, so where one opens
        decides where its later turns go. Not on no evidence, the state of a fresh router: one-shot
        requests over a shared document look like new conversations until a window shows that none is
        continued, and spread by count they would copy the document to every engine."""
        follows = self._follows_lately(now)
        return follows > 0.0 and follows >= self._at(self.ended, now) - 1e-9

    def _follows_lately(self, now: float) -> float:
        """The faded count of follow-ups, or 0 while it is under about one within the last window: the
        evidence both the bound and the projection wait for."""
        self.expire(now)
        follows = self._at(self.follows, now)
        return follows if follows >= _ONE_WITHIN_WINDOW else 0.0

    def next_turn_blocks(self, now: float) -> float:
        """The blocks a live conversation is expected to add with its next turn: the recent mean growth
        of a follow-up, times the share of conversations that were continued rather than ended (0 on
        no evidence: a fresh router, or one-shot requests)."""
        follows = self._follows_lately(now)
        if follows == 0.0:
            return 0.0
        # (grown / follows) per follow-up, times follows / (follows + ended) continued
        return self._at(self.grown, now) / (follows + self._at(self.ended, now))

    def next_turn_growth(self, urls: Sequence[str], now: float, hashes: Sequence[int]) -> dict[str, float]:
        """Per engine, the blocks its live conversations are expected to add with their next turns,
        not counting the one ``hashes`` continues (its growth is the prompt itself); {} on no evidence."""
        per = self.next_turn_blocks(now)
        if per <= 0.0:
            return {}
        tip = self.continued_tip(hashes)
        own = None if tip is None else self.tips[tip][0]
        return {u: (self.live_on(u, now) - (u == own)) * per for u in urls}

    def routed(self, url: str, now: float, hashes: Sequence[int]) -> None:
        """A prompt with these block hashes went to ``url``."""
        if hashes:
            self.expire(now)
            at = self._continued_at(hashes)
            prior = None if at is None else hashes[at]
            if at is not None and at != len(hashes) - 1:
                self.follows = self._bump(self.follows, now)
                self.grown = self._bump(self.grown, now, float(len(hashes) - 1 - at))
            self._place(url, now, prior, hashes[-1])

    def rehashed(self, url: str, now: float, leading: Sequence[int], hashes: Sequence[int]) -> None:
        """A prompt routed to ``url`` on its ``leading`` blocks has all its ``hashes`` now: its tip moves
        to its last block (the same conversation, not a follow-up)."""
        if hashes:
            self.expire(now)
            prior = leading[-1] if leading and leading[-1] in self.tips else None
            self._place(url, now, prior, hashes[-1])

    def _place(self, url: str, now: float, prior: int | None, tip: int) -> None:
        if prior is not None:
            old_url, _ = self.tips.pop(prior)
            self._leave(old_url)
        self.tips[tip] = (url, now)
        self.live[url] = self.live.get(url, 0) + 1

    def forget(self, url: str) -> None:
        """``url`` left the pool: its conversations open anew wherever they go next."""
        for tip in [t for t, (u, _) in self.tips.items() if u == url]:
            del self.tips[tip]
        self.live.pop(url, None)

    def _leave(self, url: str) -> None:
        n = self.live.get(url, 0) - 1
        if n > 0:
            self.live[url] = n
        else:
            self.live.pop(url, None)

    def _at(self, counter: tuple[float, float], now: float) -> float:
        value, at = counter
        return faded(value, now - at, self.window_s)

    def _bump(self, counter: tuple[float, float], at: float, by: float = 1.0) -> tuple[float, float]:
        """``counter`` with ``by`` more at ``at`` (which may precede the counter's own time)."""
        value, ref = counter
        if at >= ref:
            return (faded(value, at - ref, self.window_s) + by, at)
        return (value + faded(by, ref - at, self.window_s), ref)


@dataclass(slots=True)
class ConversationBoundFilter:
    """A new conversation goes to an engine serving at most its fair share of the live conversations,
    plus one: with N conversations live on n engines (the new one counted), engines already serving
    floor(N / n) + 1 are dropped for it.

    Prefix affinity places a tenant's conversations where its system prompt is. With four tenants on
    three engines one engine gets two tenants, so twice the conversations of the others, and every one
    of them grows turn by turn in that engine's pool (family draw 409: 4/2/2 conversations, the engine
    with four thrashed and held requests up to 7 s, for a 256-token system prompt its new conversation
    saved once). A conversation's later turns stay where it opened, so the place to even the load is
    where it opens, at the price of one prefill of the prefix it shares. While fewer conversations are
    live than there are engines each new one goes to an engine serving none (so a second user of a
    tenant opens beside the first only once every engine serves one); the + 1 lets an engine serve
    one more than its floor share, so a tenant's next user still joins its system prompt while the
    split stays within one conversation of even.

    Follow-ups are never moved (their own blocks decide), nor are prompts unless some prompt lately
    continued a conversation and as many continued as ended (:meth:`ConversationTracker.mostly_multi_turn`):
    one-shot requests sharing a document would be spread by request count, a copy of the document on
    every engine (the first build acted on no evidence too and split them on a fresh router). Never
    filters everything out; filters nothing without a ``tracker`` (``conversationBound`` off). The
    router feeds the tracker, which the fit scorer's projection (``projectedFit``) reads too."""

    tracker: ConversationTracker | None
    name: str = "conversation_bound"

    def filter(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Endpoint]:
        t = self.tracker
        if t is None or len(eps) < 2 or req.approximate or not req.hashes:
            return list(eps)
        if t.continued_tip(req.hashes) is not None or not t.mostly_multi_turn(req.now):
            return list(eps)
        counts = [t.live_on(ep.url, req.now) for ep in eps]
        cap = fair_share_cap(sum(counts) + 1, len(eps))
        kept = [ep for ep, n in zip(eps, counts, strict=True) if n + 1 <= cap]
        return kept or list(eps)

    def explain(self, dropped: Sequence[Endpoint], matches: dict[str, PrefixMatch]) -> Reason | None:
        """The bound decided when it dropped an endpoint that holds part of the prompt."""
        return Reason.CONVERSATION_BOUND if any(matches.get(ep.url) for ep in dropped) else None


@dataclass(slots=True)
class StickyConversationFilter:
    """A follow-up goes to the engine its conversation's last turn went to, while that engine is among
    those the bounds before this one kept (in rotation, under the load bound).

    Prefix affinity alone keeps a conversation where its blocks are, but under memory pressure its
    blocks are often evicted between turns, and then the scorers (queue, history, load) or the
    admission gate's steals move it to whichever engine looks cheapest at that moment. Each move is a
    prefill of its whole history elsewhere, which evicts another conversation there, and so on (the
    kept family runs: in bursty pressure draws kvstrata trailed the best peer by 6.6 points where it
    moved 5 % or more of its follow-ups and by 0.3 where it moved fewer). A text-tree router never moves
    one: the tree remembers where the conversation went. Filters nothing without a ``tracker``
    (``stickyConversations`` off), for approximate (character-block) requests, or for a prompt that
    opens a conversation: the scorers place those."""

    tracker: ConversationTracker | None
    name: str = "sticky_conversations"

    def home(self, req: RouteRequest) -> str | None:
        """The engine URL of the live conversation ``req`` continues, or None."""
        t = self.tracker
        if t is None or req.approximate or not req.hashes:
            return None
        t.expire(req.now)
        tip = t.continued_tip(req.hashes)
        return None if tip is None else t.tips[tip][0]

    def filter(self, req: RouteRequest, eps: list[Endpoint]) -> list[Endpoint]:
        """``eps`` itself (no copy on the request path) unless a follow-up's engine is among them."""
        url = self.home(req)
        if url is None:
            return eps
        return [ep for ep in eps if ep.url == url] or eps
