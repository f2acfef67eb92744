"""Which engine holds which KV blocks, and on which tier.

The index maps, per endpoint, a block's 64-bit hash (the engine's own, from KV events) to a small
bit mask of the media it lives on (GPU, CPU, STORAGE) plus an optional *prediction*: when the router
sends a prompt to an engine it records the prompt's blocks there with a TTL, because the engine's
BlockStored events arrive only after prefill; a BlockStored confirms the entry, otherwise it expires.

A prompt's cached prefix on an endpoint is a walk over its chained hashes until the first miss: a
block hash commits to every token before it, so a hit on block i implies the whole prefix.

Memory bound: at most ``max_blocks`` (endpoint, block) entries in total. Each endpoint keeps its
entries in least-recently-touched order (stored, predicted or matched by a lookup); when the bound is
exceeded the least-recently-touched entry of the endpoint with the most entries is evicted, so one busy
engine cannot push every other engine out of the index. Evictions are counted.

History: a block an engine evicted (from every tier, or dropped from the index by its bound) is kept
as a *ghost* of that engine, under the same bound, until it is stored again. A prompt's longest
prefix of live-or-ghost blocks on an engine says where its prefix group lived before memory pressure
pushed it out: a text-tree router never forgets where it sent a prefix, so it keeps sending the group
to one engine, which keeps it hot; a router that only knows what is cached now scatters the group over
every engine once it is evicted, and each copy evicts other groups (router/scoring.py, HistoryScorer).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import NamedTuple, Protocol

from mypy_extensions import mypyc_attr

from kvstrata.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstrata.router.native import CPU, GPU, STORAGE, BlockTable, Prediction, Predictions

REAL = GPU | CPU | STORAGE
_MEDIUM_BIT = {"GPU": GPU, "CPU": CPU, "STORAGE": STORAGE}


class PrefixMatch(NamedTuple):
    """Length of an endpoint's cached prefix of a prompt, in blocks, split by the best tier of each."""

    blocks: int
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    predicted: int = 0


class PrefixIndex(Protocol):
    def lookup(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]: ...
    def history(self, hashes: Sequence[int]) -> dict[str, int]: ...
    def apply(self, endpoint: str, event: KVEvent) -> int: ...
    def predict(self, endpoint: str, hashes: Sequence[int], ttl: float) -> Prediction | None: ...
    def drop_endpoint(self, endpoint: str) -> None: ...
    def __len__(self) -> int: ...


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockIndex:
    """The in-memory :class:`PrefixIndex`. Not thread-safe: it lives on the event loop.

    Each endpoint's blocks live in a native :class:`BlockTable` (router/native.py): every per-block
    loop (a lookup's walk, a prediction's inserts, an event's blocks, an expiry) is one native call, so a
    128K-token prompt's 4,096 blocks cost microseconds, not a Python iteration each."""

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._clock = clock
        # endpoint -> its blocks: hash -> (mask, live predictions holding it), least recently touched first
        self._eps: dict[str, BlockTable] = {}
        # The predictions (native/src/predictions.rs): a min-heap of expiry records, one per expiry set,
        # not per block (a 128K-token prompt is 4,096 blocks). Expiries differ per call (a request in
        # flight is predicted until its first token, then for the short TTL), so a FIFO would not be in
        # expiry order. A block lives while any prediction of it does (its table counts them), so the
        # next turn of a conversation, which predicts the earlier turns' blocks again, keeps them alive
        # with no link to the earlier predictions; re-timing one is one record.
        self._predictions = Predictions(max_blocks)
        self._size = 0
        self.evictions = 0
        # endpoint -> ghost hashes, oldest first; at most max_blocks in total (see _remember).
        self._ghosts: dict[str, OrderedDict[int, None]] = {}
        self._ghost_count = 0

    def __len__(self) -> int:
        return self._size

    def endpoints(self) -> list[str]:
        return list(self._eps)

    def blocks_of(self, endpoint: str) -> int:
        table = self._eps.get(endpoint)
        return 0 if table is None else len(table)

    # --- reads -----------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per endpoint with at least one matching leading block: the matched prefix and its tiers
        (the matched blocks become the most recently touched there)."""
        if not hashes:
            return {}
        self._size -= self._predictions.expire(self._clock())  # no entry holds an expired prediction now
        out: dict[str, PrefixMatch] = {}
        for ep, table in self._eps.items():
            n, gpu, cpu, storage, predicted = table.prefix(hashes)
            if n:
                out[ep] = PrefixMatch(n, gpu, cpu, storage, predicted)
        return out

    def history(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the prompt's leading blocks it holds or evicted lately (0s left out)."""
        out: dict[str, int] = {}
        empty: dict[int, None] = {}
        for ep in set(self._eps) | set(self._ghosts):
            table = self._eps.get(ep)
            ghosts = self._ghosts.get(ep, empty)
            n = 0
            for h in hashes:
                if h not in ghosts and not (table is not None and table.mask(h) & REAL):
                    break
                n += 1
            if n:
                out[ep] = n
        return out

    # --- writes ----------------------------------------------------------------------------------
    def apply(self, endpoint: str, event: KVEvent) -> int:
        """Apply one engine event; returns how many of a BlockRemoved's blocks the index held on that
        medium (0 for other events): a removal that matches nothing points at a hash mismatch."""
        if isinstance(event, BlockStored):
            ghosts = self._ghosts.get(endpoint)
            if ghosts:
                for h in event.block_hashes:
                    if h in ghosts:
                        del ghosts[h]
                        self._ghost_count -= 1
            bit = _MEDIUM_BIT.get(event.medium, GPU)
            self._size += self._table(endpoint).store(event.block_hashes, bit)
            self._enforce_bound()
        elif isinstance(event, BlockRemoved):
            table = self._eps.get(endpoint)
            if table is None:
                return 0
            matched, gone = table.remove(event.block_hashes, _MEDIUM_BIT.get(event.medium, GPU))
            self._size -= len(gone)
            self._remember(endpoint, gone)  # gone from every tier; a pending prediction for it is wrong too
            return matched
        elif isinstance(event, AllBlocksCleared):
            self._clear(endpoint)
            self._forget(endpoint)
        return 0

    def predict(
        self, endpoint: str, hashes: Sequence[int], ttl: float, touched: int = 0
    ) -> Prediction | None:
        """Record that ``endpoint`` will hold ``hashes`` (until confirmed, or ``ttl`` from now).
        ``touched``: a lookup just matched that many leading blocks there (they are most recent already)."""
        if not hashes:
            return None
        now = self._clock()
        self._size -= self._predictions.expire(now)
        self._table(endpoint)  # attached to the predictions when made
        pred, added, removed = self._predictions.predict(endpoint, hashes, now + ttl, touched, now)
        self._size += added - removed
        self._enforce_bound()
        return pred

    def ttl_left(self, pred: Prediction) -> float:
        """Seconds until ``pred``'s own expiry (0 once it has passed)."""
        return max(pred.expires - self._clock(), 0.0)

    def retime(self, pred: Prediction, ttl: float) -> None:
        """Give ``pred``'s blocks a new expiry ``ttl`` from now (those other live predictions hold too
        stay while those do): O(1) in the prompt's length. Live predictions past twice the index's bound
        in blocks are ended early, soonest to expire first (their hashes are what a prediction costs)."""
        now = self._clock()
        self._size -= self._predictions.retime(pred, now + ttl, now)

    def drop_endpoint(self, endpoint: str) -> None:
        table = self._eps.pop(endpoint, None)
        if table is not None:
            self._size -= len(table)
            self._predictions.detach(endpoint)
        self._forget(endpoint)

    # --- internals -------------------------------------------------------------------------------
    def _table(self, endpoint: str) -> BlockTable:
        table = self._eps.get(endpoint)
        if table is None:
            table = self._eps[endpoint] = BlockTable()
            self._predictions.attach(endpoint, table)
        return table

    def _clear(self, endpoint: str) -> None:
        table = self._eps.get(endpoint)
        if table is not None:
            self._size -= len(table)
            table.clear()

    def _enforce_bound(self) -> None:
        # The oldest entries of the largest table go first. Evicting from the largest until it is down
        # to the next one's size (or the excess is gone) takes the same entries as one at a time, in one
        # native call: a 4 MB prompt over the bound is 38,000 blocks.
        while (excess := self._size - self.max_blocks) > 0:
            ep, n = _from_largest(self._eps, excess)
            taken, real = self._eps[ep].pop_oldest_many(n)
            assert taken > 0  # the largest table of an over-full index is not empty
            self._size -= taken
            self.evictions += taken
            self._remember(ep, real)

    def _remember(self, endpoint: str, hashes: Sequence[int]) -> None:
        """``hashes`` left ``endpoint``: keep them as ghosts, the last the newest; past the bound the
        oldest ghost of the endpoint with the most ghosts goes (like the live entries, so no engine's
        history crowds out the rest)."""
        if not hashes:
            return
        ghosts = self._ghosts.get(endpoint)
        if ghosts is None:
            ghosts = self._ghosts[endpoint] = OrderedDict()
        for h in hashes:
            if h in ghosts:
                ghosts.move_to_end(h)
            else:
                ghosts[h] = None
                self._ghost_count += 1
        while (excess := self._ghost_count - self.max_blocks) > 0:
            ep, n = _from_largest(self._ghosts, excess)
            largest = self._ghosts[ep]
            for _ in range(n):
                largest.popitem(last=False)
            self._ghost_count -= n

    def _forget(self, endpoint: str) -> None:
        ghosts = self._ghosts.pop(endpoint, None)
        if ghosts is not None:
            self._ghost_count -= len(ghosts)


def _from_largest(tables: Mapping[str, Sized], excess: int) -> tuple[str, int]:
    """The largest of ``tables`` (the first of equals) and how many of its oldest entries to drop:
    as many as dropping one at a time from whichever is largest would drop from it in a row, and no
    more than ``excess``."""
    ep = max(tables, key=lambda e: len(tables[e]))
    largest = len(tables[ep])
    runner_up = max((len(t) for e, t in tables.items() if e != ep), default=0)
    return ep, min(excess, max(largest - runner_up, 1))
