"""The fs tier's evictions, fetched from each engine pod's fs-janitor.

vLLM publishes a STORAGE ``BlockStored`` for every block file its fs tier writes and never a
``BlockRemoved``: it never deletes one; the janitor (kvstrata/engine/fsjanitor.py) does, to keep the NVMe
budget. Without this the index would keep crediting every block the janitor deleted until its own bound
dropped it, and send prompts to an engine that then recomputes them. So, for each engine with a janitor,
each scrape also fetches the hashes evicted since the last one and applies them as the event vLLM would
have sent, ``BlockRemoved(medium="STORAGE")``, counted with the engines' own events in
``kvstrata_router_kv_event_blocks_total{type="BlockRemoved",medium="STORAGE"}``; how many of them the
index held on STORAGE is ``kvstrata_router_fs_evictions_held_total`` (far fewer would mean the janitor's
file-name hashes and the events' hashes disagree, e.g. an offloaded chunk of several blocks, whose file is
named by its last block only).

Order: a block the janitor evicted and vLLM wrote again before the next poll loses its STORAGE entry too
(an under-credit until its next store event); at one poll per scrape interval, rare.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp

from kvstrata.engine.fsjanitor import EVICTIONS_PATH
from kvstrata.router.events import BlockRemoved
from kvstrata.router.index import PrefixIndex
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint

log = logging.getLogger("kvstrata.router.storage")


@dataclass(slots=True)
class _Cursor:
    epoch: str | None = None  # the janitor process whose numbering ``after`` is in
    after: int = 0


@dataclass(frozen=True, slots=True)
class Evicted:
    """One answer of a janitor's ``/evictions``."""

    epoch: str
    next: int
    hashes: tuple[int, ...]
    missed: bool


def parse_evicted(body: object) -> Evicted | None:
    """The janitor's JSON answer, or None when it is not one (another server on that port)."""
    if not isinstance(body, dict):
        return None
    epoch, nxt, hashes = body.get("epoch"), body.get("next"), body.get("hashes")
    if not isinstance(epoch, str) or not isinstance(nxt, int) or not isinstance(hashes, list):
        return None
    if not all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes):
        return None
    return Evicted(epoch, nxt, tuple(hashes), bool(body.get("missed")))


class StorageEvictions:
    """Per engine: where in its janitor's eviction log the router has read up to."""

    def __init__(
        self, index: PrefixIndex, metrics: RouterMetrics, session: aiohttp.ClientSession, timeout: float
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._cursors: dict[str, _Cursor] = {}

    def forget(self, url: str) -> None:
        self._cursors.pop(url, None)

    async def poll(self, ep: Endpoint) -> None:
        base = ep.spec.fs_janitor
        if base is None:
            return
        cur = self._cursors.setdefault(ep.url, _Cursor())
        url = f"{base}{EVICTIONS_PATH}?after={cur.after}"
        try:
            async with self.session.get(url, timeout=self.timeout) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("fs-janitor %s: %r", base, exc)
            return
        got = parse_evicted(body)
        if got is None:
            log.debug("fs-janitor %s: not an eviction log answer", base)
            return
        if got.epoch != cur.epoch and cur.after:
            # The janitor restarted: its numbering starts over. Read its new log from the start.
            cur.epoch, cur.after = got.epoch, 0
            return
        cur.epoch, cur.after = got.epoch, got.next
        if got.missed:
            log.info("fs-janitor %s: evictions dropped from its log before they were read", base)
        if got.hashes:
            held = self.index.apply(ep.url, BlockRemoved(got.hashes, "STORAGE"))
            self.metrics.kv_event_blocks.labels(ep.url, "BlockRemoved", "STORAGE").inc(len(got.hashes))
            self.metrics.fs_evictions_held.labels(ep.url).inc(held)
