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
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, Protocol, cast

from kvstrata.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

GPU, CPU, STORAGE, PREDICTED = 1, 2, 4, 8
REAL = GPU | CPU | STORAGE
_MEDIUM_BIT = {"GPU": GPU, "CPU": CPU, "STORAGE": STORAGE}
_MASK = itemgetter(0)
_PRED = itemgetter(1)
# Prompts with at most this many known blocks re-point them to the new prediction (cheap); longer ones
# hold the earlier predictions instead (Prediction.keepers).
_REPOINT_BLOCKS = 64
# A prediction held by more later ones than this folds their expiries into its own (bounds the work of
# Prediction.until when many requests share one long, unconfirmed prefix).
_MAX_KEEPERS = 32


class Prediction:
    """One predict() call's expiry, shared by the blocks it predicted: re-timing it (a request's
    prefill ended) is one assignment, not a walk over a long prompt's blocks.

    A later prediction whose prompt holds this one's blocks (the next turn of a conversation) does not
    re-point them: it becomes one of this prediction's *keepers*, and the blocks live while this
    prediction or any keeper does (:meth:`until`). So a turn costs work for its new blocks only."""

    __slots__ = ("dead", "endpoint", "expires", "hashes", "keepers", "kept")

    def __init__(self, endpoint: str, expires: float, hashes: tuple[int, ...]) -> None:
        self.endpoint = endpoint
        self.expires = expires
        self.hashes = hashes
        self.keepers: list[Prediction] = []  # later predictions that hold this one's blocks too
        self.kept: list[Prediction] = []  # earlier predictions this one holds
        self.dead = False

    def hold(self, keeper: Prediction) -> None:
        if len(self.keepers) >= _MAX_KEEPERS:
            self.expires = max(self.expires, *(k.expires for k in self.keepers))
            self.keepers = []
        self.keepers.append(keeper)

    def until(self, now: float) -> float:
        """When this prediction's blocks expire: its own expiry or its latest live keeper's."""
        end = self.expires
        if self.keepers:
            self.keepers = [k for k in self.keepers if k.expires > now]
            for k in self.keepers:
                end = max(end, k.expires)
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
    """The in-memory :class:`PrefixIndex`. Not thread-safe: it lives on the event loop."""

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._clock = clock
        # endpoint -> hash -> [mask, Prediction or None]; order = least recently touched first
        self._eps: dict[str, OrderedDict[int, list[Any]]] = {}
        # Min-heap of (expiry, seq, endpoint, hashes): one record per predict() call, not per block (a
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
        return len(self._eps.get(endpoint, ()))

    # --- reads -----------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per endpoint with at least one matching leading block: the matched prefix and its tiers.

        The per-block work runs in C (``map``, ``list.index``, ``Counter``): a long prompt's walk costs
        tens of nanoseconds per block, not a Python loop iteration."""
        if not hashes:
            return {}
        now = self._clock()
        self._expire(now)  # after this no entry holds an expired prediction
        out: dict[str, PrefixMatch] = {}
        for ep, blocks in self._eps.items():
            if hashes[0] not in blocks:
                continue
            entries = list(map(blocks.get, hashes))
            try:
                n = entries.index(None)
            except ValueError:
                n = len(entries)
            masks = list(map(_MASK, cast("list[list[Any]]", entries[:n])))
            kinds = set(masks)  # one or two kinds as a rule: counted in C, no per-block Python
            gpu = cpu = storage = predicted = 0
            for mask in kinds:
                count = n if len(kinds) == 1 else masks.count(mask)
                m = int(mask)
                if m & GPU:
                    gpu += count
                elif m & CPU:
                    cpu += count
                elif m & STORAGE:
                    storage += count
                else:
                    predicted += count
            deque(map(blocks.move_to_end, hashes[:n]), maxlen=0)  # touched: most recently used
            out[ep] = PrefixMatch(n, gpu, cpu, storage, predicted)
        return out

    def history(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the prompt's leading blocks it holds or evicted lately (0s left out)."""
        out: dict[str, int] = {}
        none: dict[int, Any] = {}
        for ep in set(self._eps) | set(self._ghosts):
            live: Mapping[int, list[Any]] = self._eps.get(ep, none)
            ghosts: Mapping[int, None] = self._ghosts.get(ep, none)
            n = 0
            for h in hashes:
                if h not in ghosts and not self._real(live.get(h)):
                    break
                n += 1
            if n:
                out[ep] = n
        return out

    @staticmethod
    def _real(entry: list[Any] | None) -> bool:
        return entry is not None and bool(int(entry[0]) & REAL)

    # --- writes ----------------------------------------------------------------------------------
    def apply(self, endpoint: str, event: KVEvent) -> int:
        """Apply one engine event; returns how many of a BlockRemoved's blocks the index held on that
        medium (0 for other events): a removal that matches nothing points at a hash mismatch."""
        if isinstance(event, BlockStored):
            bit = _MEDIUM_BIT.get(event.medium, GPU)
            blocks = self._blocks(endpoint)
            ghosts = self._ghosts.get(endpoint)
            for h in event.block_hashes:
                if ghosts is not None and h in ghosts:
                    del ghosts[h]
                    self._ghost_count -= 1
                entry = blocks.get(h)
                if entry is None:
                    blocks[h] = [bit, None]
                    self._size += 1
                else:
                    # Confirmed: the prediction (if any) is now a fact.
                    entry[0] = (int(entry[0]) | bit) & REAL
                    entry[1] = None
                    blocks.move_to_end(h)
            self._enforce_bound()
        elif isinstance(event, BlockRemoved):
            held = self._eps.get(endpoint)
            if held is None:
                return 0
            bit = _MEDIUM_BIT.get(event.medium, GPU)
            matched = 0
            for h in event.block_hashes:
                entry = held.get(h)
                if entry is None:
                    continue
                matched += bool(int(entry[0]) & bit)
                mask = int(entry[0]) & ~bit & REAL
                if mask:
                    entry[0] = mask
                else:
                    # Gone from every tier; a pending prediction for it is wrong too.
                    del held[h]
                    self._size -= 1
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
        ``touched``: a lookup just matched that many leading blocks there (they are most recent already)."""
        if not hashes:
            return None
        now = self._clock()
        self._expire(now)
        pred = Prediction(endpoint, now + ttl, tuple(hashes))
        blocks = self._blocks(endpoint)
        entries = list(map(blocks.get, hashes))
        try:
            known = entries.index(None)
        except ValueError:
            known = len(entries)
        if entries.count(None) == len(entries) - known:
            # The usual shape (a prompt seen before, maybe extended): known blocks, then new ones.
            # Per-block work in C except for the new blocks.
            head = cast("list[list[Any]]", entries[:known])
            if known <= _REPOINT_BLOCKS:  # a short prompt: re-point its few predicted blocks
                for known_entry in head:
                    if known_entry[0] == PREDICTED:
                        known_entry[1] = pred
            else:
                # A long prompt's known blocks keep the predictions they have; each of those is held by
                # this one as long as it lives (one step per earlier prediction, usually one per turn).
                olds = set(map(_PRED, head))
                olds.discard(None)
                for prev in olds:
                    prev.hold(pred)
                    pred.kept.append(prev)
                    if pred.expires > prev.expires:
                        self._push(prev, pred.expires)
            if touched < known:
                deque(map(blocks.move_to_end, hashes[touched:known]), maxlen=0)
            for h in hashes[known:]:
                blocks[h] = [PREDICTED, pred]
            self._size += len(hashes) - known
        else:
            for h, entry in zip(hashes, entries, strict=True):
                if entry is None:
                    blocks[h] = [PREDICTED, pred]
                    self._size += 1
                else:
                    if not int(entry[0]) & REAL:
                        entry[1] = pred
                    blocks.move_to_end(h)
        self._push(pred)
        self._enforce_bound()
        return pred

    def retime(self, pred: Prediction, ttl: float) -> None:
        """Give the blocks still held by ``pred`` (not confirmed, not predicted again since) a new
        expiry ``ttl`` from now: O(1) in the prompt's length (one step per earlier prediction held)."""
        now = self._clock()
        self._expire(now)
        pred.expires = now + ttl
        self._push(pred, pred.until(now))
        for prev in pred.kept:
            if not prev.dead:
                self._push(prev, prev.until(now))

    def _push(self, pred: Prediction, when: float | None = None) -> None:
        heapq.heappush(self._predictions, (pred.expires if when is None else when, next(self._seq), pred))
        self._predicted_hashes += len(pred.hashes)
        if self._predicted_hashes > 2 * self.max_blocks:
            self._compact_predictions()

    def drop_endpoint(self, endpoint: str) -> None:
        blocks = self._eps.pop(endpoint, None)
        if blocks is not None:
            self._size -= len(blocks)
        self._forget(endpoint)

    # --- internals -------------------------------------------------------------------------------
    def _blocks(self, endpoint: str) -> OrderedDict[int, list[Any]]:
        blocks = self._eps.get(endpoint)
        if blocks is None:
            blocks = self._eps[endpoint] = OrderedDict()
        return blocks

    def _clear(self, endpoint: str) -> None:
        blocks = self._eps.get(endpoint)
        if blocks is not None:
            self._size -= len(blocks)
            blocks.clear()

    def _compact_predictions(self) -> None:
        """Rebuild the heap from live predictions: refreshed ones leave stale records behind."""
        now = self._clock()
        live: dict[int, tuple[Prediction, list[int]]] = {}
        for blocks in self._eps.values():
            for h, entry in blocks.items():
                pred = entry[1]
                if entry[0] == PREDICTED and pred is not None:
                    live.setdefault(id(pred), (pred, []))[1].append(h)
        self._predictions = []
        for pred, hs in live.values():
            pred.hashes = tuple(hs)
            self._predictions.append((pred.until(now), next(self._seq), pred))
        self._predicted_hashes = sum(len(p.hashes) for _, _, p in self._predictions)
        heapq.heapify(self._predictions)

    def _expire(self, now: float) -> None:
        preds = self._predictions
        while preds and preds[0][0] <= now:
            _, _, pred = heapq.heappop(preds)
            self._predicted_hashes -= len(pred.hashes)
            if pred.dead:
                continue
            end = pred.until(now)
            if end > now:  # re-timed, or held by a later prediction: a record at its new end
                heapq.heappush(preds, (end, next(self._seq), pred))
                self._predicted_hashes += len(pred.hashes)
                continue
            pred.dead = True
            pred.keepers, pred.kept = [], []
            blocks = self._eps.get(pred.endpoint)
            if blocks is None:
                continue
            # Only the prediction that set this expiry may remove it; confirmed entries have mask bits.
            for h, entry in zip(pred.hashes, map(blocks.get, pred.hashes), strict=True):
                if entry is not None and entry[0] == PREDICTED and entry[1] is pred:
                    del blocks[h]
                    self._size -= 1

    def _enforce_bound(self) -> None:
        while self._size > self.max_blocks:
            ep = max(self._eps, key=lambda e: len(self._eps[e]))
            h, entry = self._eps[ep].popitem(last=False)
            self._size -= 1
            self.evictions += 1
            if self._real(entry):
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
