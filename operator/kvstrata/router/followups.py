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

# A follow-up extends the previous prompt by that prompt's answer and a new turn: its last full block
# is this close to the follow-up's end (64 blocks: 2K tokens of answer and turn at block size 32).
_TAIL_BLOCKS = 64
# Bounds on what is remembered: the ended requests of one window, and prefix groups.
_KEEP = 4096


class FollowUps:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # Ended requests, oldest first: last full block hash -> (group, when it ended). Block hashes are
        # chained, so a request holding that hash at any position extends the ended one.
        self._ended: OrderedDict[int, tuple[int, float]] = OrderedDict()
        # Per group: how often its ended requests were followed in time (an average of 1s and 0s that
        # weighs the last observations most).
        self._rate: OrderedDict[int, float] = OrderedDict()

    def ended(self, hashes: Sequence[int], now: float) -> None:
        """A request with these prompt block hashes ended well at monotonic ``now``."""
        if not hashes:
            return
        self._expire(now)
        self._ended[hashes[-1]] = (hashes[0], now)
        self._ended.move_to_end(hashes[-1])
        while len(self._ended) > _KEEP:
            group, _ = self._ended.popitem(last=False)[1]
            self._learn(group, followed=False)

    def arrived(self, hashes: Sequence[int], now: float) -> int | None:
        """A request arrives: when it extends a request that ended within the window, that request's
        last block hash (and the group learns that it was followed); else None."""
        self._expire(now)
        n = len(hashes)
        for i in range(n - 1, max(n - 1 - _TAIL_BLOCKS, -1), -1):
            found = self._ended.pop(hashes[i], None)
            if found is not None:
                self._learn(found[0], followed=True)
                return hashes[i]
        return None

    def expected(self, hashes: Sequence[int]) -> bool:
        """Whether the group of a request that just ended usually sends its next one within the window."""
        return bool(hashes) and self._rate.get(hashes[0], 0.0) >= 0.5

    def _expire(self, now: float) -> None:
        """Ended requests not followed within the window teach their group that it was not."""
        while self._ended:
            last = next(iter(self._ended))
            group, at = self._ended[last]
            if now - at <= self.window_s:
                break
            del self._ended[last]
            self._learn(group, followed=False)

    def _learn(self, group: int, *, followed: bool) -> None:
        # Half weight on the newest observation: one follow-up in time is enough to expect the next, a
        # miss halves the belief (a conversation's last turn is followed by nothing).
        rate = self._rate.pop(group, 0.0)
        self._rate[group] = 0.5 * rate + 0.5 * float(followed)
        while len(self._rate) > _KEEP:
            self._rate.popitem(last=False)
