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

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from kvstrata.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstrata.router.native import CPU, GPU, STORAGE, BlockTable

REAL = GPU | CPU | STORAGE
_MEDIUM_BIT = {"GPU": GPU, "CPU": CPU, "STORAGE": STORAGE}
# Prompts with at most this many known blocks re-point them to the new prediction (cheap); longer ones
# hold the earlier predictions instead (Prediction.keepers).
_REPOINT_BLOCKS = 64


class Prediction:
    """One predict() call's expiry, shared by the blocks it predicted: re-timing it (a request's
    prefill ended) is one assignment, not a walk over a long prompt's blocks.

    A later prediction whose prompt holds this one's blocks (the next turn of a conversation) does not
    re-point them: it becomes one of this prediction's *keepers*, and the blocks live while this
    prediction or any keeper does, transitively (:meth:`until`). A turn holds only the earlier
    predictions no other one it holds already keeps (in a conversation: the previous turn), so each
    prediction has about one keeper per conversation that extends it, and a turn costs work for its
    new blocks, not for every earlier turn."""

    __slots__ = ("dead", "endpoint", "expires", "hashes", "id", "keepers", "kept")

    def __init__(self, id: int, endpoint: str, expires: float, hashes: Sequence[int]) -> None:
        self.id = id  # what the endpoint's BlockTable records for the blocks this prediction set
        self.endpoint = endpoint
        self.expires = expires
        self.hashes = hashes
        self.keepers: list[Prediction] = []  # later predictions that hold this one's blocks too
        self.kept: list[Prediction] = []  # earlier predictions this one holds directly
        self.dead = False

    def until(self) -> float:
        """When this prediction's blocks expire: the latest expiry among it and its live keepers,
        theirs, and so on (iterative: a conversation of thousands of turns is a chain that long)."""
        end = self.expires
        stack = [self]
        seen = {self.id}
        while stack:
            p = stack.pop()
            if p.keepers:
                p.keepers = [k for k in p.keepers if not k.dead]
                for k in p.keepers:
                    if k.id not in seen:
                        seen.add(k.id)
                        end = max(end, k.expires)
                        stack.append(k)
        return end


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
        # endpoint -> its blocks: hash -> (mask, prediction id), least recently touched first
        self._eps: dict[str, BlockTable] = {}
        # Live predictions by id (the tables hold ids): for the earlier predictions a turn holds.
        self._preds: dict[int, Prediction] = {}
        self._pred_ids = itertools.count(1)
        # Min-heap of (expiry, seq, prediction): one record per predict() call, not per block (a
        # 128K-token prompt is 4,096 blocks). Expiries differ per call (a request in flight is predicted
        # until its first token, then for the short TTL), so a FIFO would not be in expiry order. Refreshes
        # leave stale records; past 2 × max_blocks hashes in them the heap is rebuilt from live predictions.
        self._predictions: list[tuple[float, int, Prediction]] = []
        self._predicted_hashes = 0
        self._seq = itertools.count()
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
        self._expire(self._clock())  # after this no entry holds an expired prediction
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
            for h in gone:  # gone from every tier; a pending prediction for it is wrong too
                self._remember(endpoint, h)
            return matched
        elif isinstance(event, AllBlocksCleared):
            self._clear(endpoint)
            self._forget(endpoint)
        return 0

    def predict(
        self, endpoint: str, hashes: Sequence[int], ttl: float, touched: int = 0
    ) -> Prediction | None:
        """Record that ``endpoint`` will hold ``hashes`` (until confirmed, or ``ttl`` from now).
        ``touched``: a lookup just matched that many leading blocks there (they are most recent already).

        A prompt seen before, maybe extended (known blocks, then new ones): with more than
        ``_REPOINT_BLOCKS`` known blocks, those keep the predictions they have, and each of those is held
        by this one as long as it lives (one step per earlier prediction, usually one per turn)."""
        if not hashes:
            return None
        now = self._clock()
        self._expire(now)
        pred = Prediction(next(self._pred_ids), endpoint, now + ttl, hashes)
        added, olds = self._table(endpoint).predict(hashes, pred.id, _REPOINT_BLOCKS, touched)
        self._preds[pred.id] = pred
        held = [p for pid in olds if (p := self._preds.get(pid)) is not None]
        ids = {p.id for p in held}
        for prev in held:
            # Kept already by another prediction this one holds: held through it.
            if not any(k.id in ids for k in prev.keepers):
                prev.keepers.append(pred)
                pred.kept.append(prev)
        self._size += added
        self._push(pred)
        self._enforce_bound()
        return pred

    def ttl_left(self, pred: Prediction) -> float:
        """Seconds until ``pred``'s own expiry (0 once it has passed)."""
        return max(pred.expires - self._clock(), 0.0)

    def retime(self, pred: Prediction, ttl: float) -> None:
        """Give the blocks still held by ``pred`` (not confirmed, not predicted again since) a new
        expiry ``ttl`` from now: O(1) in the prompt's length and in the predictions it holds (those
        are looked at again when it dies, see _expire)."""
        now = self._clock()
        self._expire(now)
        pred.expires = now + ttl
        self._push(pred)

    def _push(self, pred: Prediction, when: float | None = None) -> None:
        heapq.heappush(self._predictions, (pred.expires if when is None else when, next(self._seq), pred))
        self._predicted_hashes += len(pred.hashes)
        if self._predicted_hashes > 2 * self.max_blocks:
            self._compact_predictions()

    def drop_endpoint(self, endpoint: str) -> None:
        table = self._eps.pop(endpoint, None)
        if table is not None:
            self._size -= len(table)
        self._forget(endpoint)

    # --- internals -------------------------------------------------------------------------------
    def _table(self, endpoint: str) -> BlockTable:
        table = self._eps.get(endpoint)
        if table is None:
            table = self._eps[endpoint] = BlockTable()
        return table

    def _clear(self, endpoint: str) -> None:
        table = self._eps.get(endpoint)
        if table is not None:
            self._size -= len(table)
            table.clear()

    def _compact_predictions(self) -> None:
        """Rebuild the heap from live predictions: refreshed ones leave stale records behind."""
        live: dict[int, list[int]] = {}
        for table in self._eps.values():
            for h, pid in table.predicted():
                live.setdefault(pid, []).append(h)
        self._predictions = []
        for pid, hs in live.items():
            pred = self._preds.get(pid)
            if pred is None:
                continue
            pred.hashes = tuple(hs)
            self._predictions.append((pred.until(), next(self._seq), pred))
        self._predicted_hashes = sum(len(p.hashes) for _, _, p in self._predictions)
        heapq.heapify(self._predictions)

    def _expire(self, now: float) -> None:
        preds = self._predictions
        while preds and preds[0][0] <= now:
            _, _, pred = heapq.heappop(preds)
            self._predicted_hashes -= len(pred.hashes)
            if pred.dead:
                continue
            end = pred.until()
            if end > now:  # re-timed, or held by a later prediction: a record at its new end
                heapq.heappush(preds, (end, next(self._seq), pred))
                self._predicted_hashes += len(pred.hashes)
                continue
            pred.dead = True
            # What it held may have had a later record from when it was in flight: look again now.
            for prev in pred.kept:
                if not prev.dead:
                    heapq.heappush(preds, (now, next(self._seq), prev))
                    self._predicted_hashes += len(prev.hashes)
            pred.keepers, pred.kept = [], []
            self._preds.pop(pred.id, None)
            table = self._eps.get(pred.endpoint)
            if table is not None:
                # Only the prediction that set this expiry may remove it; confirmed entries have mask bits.
                self._size -= table.expire(pred.hashes, pred.id)

    def _enforce_bound(self) -> None:
        while self._size > self.max_blocks:
            ep = max(self._eps, key=lambda e: len(self._eps[e]))
            oldest = self._eps[ep].pop_oldest()
            assert oldest is not None  # the largest table of an over-full index is not empty
            h, mask = oldest
            self._size -= 1
            self.evictions += 1
            if mask & REAL:
                self._remember(ep, h)

    def _remember(self, endpoint: str, h: int) -> None:
        """``h`` left ``endpoint``: keep it as a ghost; past the bound the oldest ghost of the endpoint
        with the most ghosts goes (like the live entries, so no engine's history crowds out the rest)."""
        ghosts = self._ghosts.get(endpoint)
        if ghosts is None:
            ghosts = self._ghosts[endpoint] = OrderedDict()
        if h in ghosts:
            ghosts.move_to_end(h)
            return
        ghosts[h] = None
        self._ghost_count += 1
        while self._ghost_count > self.max_blocks:
            ep = max(self._ghosts, key=lambda e: len(self._ghosts[e]))
            self._ghosts[ep].popitem(last=False)
            self._ghost_count -= 1

    def _forget(self, endpoint: str) -> None:
        ghosts = self._ghosts.pop(endpoint, None)
        if ghosts is not None:
            self._ghost_count -= len(ghosts)
