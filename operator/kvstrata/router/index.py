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
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from kvstrata.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

GPU, CPU, STORAGE, PREDICTED = 1, 2, 4, 8
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
    def apply(self, endpoint: str, event: KVEvent) -> None: ...
    def predict(self, endpoint: str, hashes: Sequence[int], ttl: float) -> None: ...
    def drop_endpoint(self, endpoint: str) -> None: ...
    def __len__(self) -> int: ...


class BlockIndex:
    """The in-memory :class:`PrefixIndex`. Not thread-safe: it lives on the event loop."""

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._clock = clock
        # endpoint -> hash -> [mask, prediction expiry (0.0 = none)]; order = least recently touched first
        self._eps: dict[str, OrderedDict[int, list[float]]] = {}
        # Min-heap of (expiry, endpoint, hash). Expiries differ per call (a request in flight is predicted
        # until its first token, then for the short TTL), so a FIFO would not be in expiry order. Refreshes
        # leave stale tuples; past 2 × max_blocks the heap is rebuilt from live predictions.
        self._predictions: list[tuple[float, str, int]] = []
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
        """Per endpoint with at least one matching leading block: the matched prefix and its tiers."""
        if not hashes:
            return {}
        now = self._clock()
        self._expire(now)
        out: dict[str, PrefixMatch] = {}
        for ep, blocks in self._eps.items():
            gpu = cpu = storage = predicted = 0
            for h in hashes:
                entry = blocks.get(h)
                if entry is None:
                    break
                mask = int(entry[0])
                if mask & GPU:
                    gpu += 1
                elif mask & CPU:
                    cpu += 1
                elif mask & STORAGE:
                    storage += 1
                elif entry[1] > now:
                    predicted += 1
                else:
                    del blocks[h]
                    self._size -= 1
                    break
                blocks.move_to_end(h)
            n = gpu + cpu + storage + predicted
            if n:
                out[ep] = PrefixMatch(n, gpu, cpu, storage, predicted)
        return out

    def history(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the prompt's leading blocks it holds or evicted lately (0s left out)."""
        out: dict[str, int] = {}
        none: dict[int, Any] = {}
        for ep in set(self._eps) | set(self._ghosts):
            live: Mapping[int, list[float]] = self._eps.get(ep, none)
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
    def _real(entry: list[float] | None) -> bool:
        return entry is not None and bool(int(entry[0]) & REAL)

    # --- writes ----------------------------------------------------------------------------------
    def apply(self, endpoint: str, event: KVEvent) -> None:
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
                    blocks[h] = [bit, 0.0]
                    self._size += 1
                else:
                    # Confirmed: the prediction (if any) is now a fact.
                    entry[0] = (int(entry[0]) | bit) & REAL
                    entry[1] = 0.0
                    blocks.move_to_end(h)
            self._enforce_bound()
        elif isinstance(event, BlockRemoved):
            held = self._eps.get(endpoint)
            if held is None:
                return
            bit = _MEDIUM_BIT.get(event.medium, GPU)
            for h in event.block_hashes:
                entry = held.get(h)
                if entry is None:
                    continue
                mask = int(entry[0]) & ~bit & REAL
                if mask:
                    entry[0] = mask
                else:
                    # Gone from every tier; a pending prediction for it is wrong too.
                    del held[h]
                    self._size -= 1
                    self._remember(endpoint, h)
        elif isinstance(event, AllBlocksCleared):
            self._clear(endpoint)
            self._forget(endpoint)

    def predict(self, endpoint: str, hashes: Sequence[int], ttl: float) -> None:
        if not hashes:
            return
        now = self._clock()
        self._expire(now)
        expires = now + ttl
        blocks = self._blocks(endpoint)
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                blocks[h] = [PREDICTED, expires]
                self._size += 1
            else:
                if not int(entry[0]) & REAL:
                    entry[1] = expires
                blocks.move_to_end(h)
            heapq.heappush(self._predictions, (expires, endpoint, h))
        if len(self._predictions) > 2 * self.max_blocks:
            self._compact_predictions()
        self._enforce_bound()

    def drop_endpoint(self, endpoint: str) -> None:
        blocks = self._eps.pop(endpoint, None)
        if blocks is not None:
            self._size -= len(blocks)
        self._forget(endpoint)

    # --- internals -------------------------------------------------------------------------------
    def _blocks(self, endpoint: str) -> OrderedDict[int, list[float]]:
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
        """Rebuild the heap from live predictions: refreshed ones leave stale tuples behind."""
        self._predictions = [
            (entry[1], ep, h)
            for ep, blocks in self._eps.items()
            for h, entry in blocks.items()
            if entry[0] == PREDICTED
        ]
        heapq.heapify(self._predictions)

    def _expire(self, now: float) -> None:
        preds = self._predictions
        while preds and preds[0][0] <= now:
            expires, ep, h = heapq.heappop(preds)
            blocks = self._eps.get(ep)
            if blocks is None:
                continue
            entry = blocks.get(h)
            # Only the prediction that set this expiry may remove it; confirmed entries have mask bits.
            if entry is not None and entry[0] == PREDICTED and entry[1] == expires:
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
