"""Which prefix groups send their next request the moment the last one ends.

An agent loop or a closed-loop client sends a conversation's next request as soon as the previous answer
arrives; a person reading the answer does not. Under memory pressure the difference decides the hit rate:
when a request ends, the admission gate admits a held request in its place, whose prefill evicts the
blocks the conversation's next request (a few milliseconds away) was about to reuse. Seen in held-out
family draws 57 and 67: six closed-loop conversations on three pools that each hold about one, 15 % and
4 % hit rate against an oracle's 75 % and 64 %, for every router.

This module learns, per prefix group (the first block: a tenant's system prompt, or a conversation's
start), whether its requests are followed within ``window_s`` by a request that extends them: like the
anticipatory I/O scheduler, which idles a disk for a process whose next read usually comes at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvstrata.router import native

# A follow-up extends the previous prompt by that prompt's answer and a new turn: its last full block
# is this close to the follow-up's end (64 blocks: 2K tokens of answer and turn at block size 32).
_TAIL_BLOCKS = 64
# Bounds on what is remembered: the ended requests of one window, and prefix groups.
_KEEP = 4096


class FollowUp(NamedTuple):
    """An arriving request extends one that ended within the window."""

    last: int  # the ended request's last full block hash
    endpoint: str  # the engine it ended on
    blocks: int  # its full prompt blocks: what that engine held of the follow-up when it ended
    group: int


class FollowUpLearner(Protocol):
    def ended(self, hashes: Sequence[int], endpoint: str, now: float) -> None: ...
    def arrived(self, hashes: Sequence[int], now: float) -> FollowUp | None: ...
    def found(self, follow_up: FollowUp, held_blocks: int) -> None: ...
    def expected(self, hashes: Sequence[int]) -> bool: ...


class NativeFollowUps(native.FollowUps):
    """:class:`FollowUps` in Rust (native/src/followups.rs), what the admission gate uses: the same
    answers (the parity test replays random calls through both) without a Python loop over an arriving
    prompt's last blocks. A Python subclass, so a test may replace a method on an instance."""

    def __new__(cls, window_s: float, *, only_evicted: bool = False) -> NativeFollowUps:
        return super().__new__(cls, window_s, FollowUp, only_evicted=only_evicted)


class FollowUps:
    """The definition (and the reference the native one is tested against)."""

    def __init__(self, window_s: float, *, only_evicted: bool = False) -> None:
        self.window_s = window_s
        self.only_evicted = only_evicted
        # Ended requests, oldest first, by last full block hash: what a follow-up would find, and when it
        # ended. Block hashes are chained, so a request holding that hash at any position extends it.
        self._ended: OrderedDict[int, tuple[FollowUp, float]] = OrderedDict()
        # Per group: how often its ended requests were followed in time, and how often a follow-up found
        # its blocks evicted (averages of 1s and 0s that weigh the last observations most).
        self._rate: OrderedDict[int, float] = OrderedDict()
        self._evicted: OrderedDict[int, float] = OrderedDict()

    def ended(self, hashes: Sequence[int], endpoint: str, now: float) -> None:
        """A request with these prompt block hashes ended well on ``endpoint`` at monotonic ``now``."""
        if not hashes:
            return
        self._expire(now)
        self._ended[hashes[-1]] = (FollowUp(hashes[-1], endpoint, len(hashes), hashes[0]), now)
        self._ended.move_to_end(hashes[-1])
        while len(self._ended) > _KEEP:
            self._learn(self._rate, self._ended.popitem(last=False)[1][0].group, False)

    def arrived(self, hashes: Sequence[int], now: float) -> FollowUp | None:
        """A request arrives: the request it extends when that one ended within the window (and the group
        learns that it was followed); else None."""
        self._expire(now)
        if not self._ended:  # the common case of closed loops: no scan of the tail on the request path
            return None
        n = len(hashes)
        for i in range(n - 1, max(n - 1 - _TAIL_BLOCKS, -1), -1):
            found = self._ended.pop(hashes[i], None)
            if found is not None:
                self._learn(self._rate, found[0].group, True)
                return found[0]
        return None

    def found(self, follow_up: FollowUp, held_blocks: int) -> None:
        """A follow-up whose predecessor kept no room goes to an engine while ``held_blocks`` of its prefix
        are still on the engine that predecessor ended on: fewer than it left there, and the group's
        turns evict each other. (Follow-ups into a kept room teach nothing: the room kept their blocks.)"""
        self._learn(self._evicted, follow_up.group, held_blocks < follow_up.blocks)

    def expected(self, hashes: Sequence[int]) -> bool:
        """Whether the group of a request that just ended usually sends its next one within the window
        (and, with ``only_evicted``, usually finds its blocks evicted by then)."""
        if not hashes or self._rate.get(hashes[0], 0.0) < 0.5:
            return False
        return not self.only_evicted or self._evicted.get(hashes[0], 0.0) >= 0.5

    def _expire(self, now: float) -> None:
        """Ended requests not followed within the window teach their group that it was not."""
        while self._ended:
            last = next(iter(self._ended))
            follow_up, at = self._ended[last]
            if now - at <= self.window_s:
                break
            del self._ended[last]
            self._learn(self._rate, follow_up.group, False)

    @staticmethod
    def _learn(rates: OrderedDict[int, float], group: int, seen: bool) -> None:
        # Half weight on the newest observation: one follow-up in time is enough to expect the next, a
        # miss halves the belief (a conversation's last turn is followed by nothing).
        rate = rates.pop(group, 0.0)
        rates[group] = 0.5 * rate + 0.5 * float(seen)
        while len(rates) > _KEEP:
            rates.popitem(last=False)
