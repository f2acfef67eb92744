"""Keeps each InferenceCluster's owned status in line with its children, with few and idempotent writes.

Child watch events mark their owner dirty; one asyncio loop drains the dirty set after a short pause (so a
burst of pod changes becomes one write), computes the owned status and patches the status subresource only
when it differs. Writes to one cluster are at least `min_interval` apart. A status write never bumps
metadata.generation and the reconcile handlers only react to spec changes, so writes cannot loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable

from kvstrata.api.models import API_VERSION, KIND
from kvstrata.controller import metrics
from kvstrata.controller.kube import Kube, KubeError
from kvstrata.controller.status import desired_status, status_patch
from kvstrata.controller.store import Key, Store

log = logging.getLogger("kvstrata.status")


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusSync:
    def __init__(
        self,
        kube: Kube,
        store: Store,
        min_interval: float = 1.0,
        coalesce: float = 0.2,
        concurrency: int = 4,
        now: Callable[[], str] = utc_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.store = store
        self.min_interval = min_interval
        self.coalesce = coalesce
        self.concurrency = concurrency
        self.now = now
        self.clock = clock
        self._dirty: set[Key] = set()
        self._lock = threading.Lock()
        self._key_locks: dict[Key, threading.Lock] = {}
        self._last_write: dict[Key, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # ------------------------------------------------------------------------------- scheduling
    def mark(self, key: Key | None) -> None:
        """Ask for a status refresh of `key`; safe from any thread."""
        if key is None:
            return
        with self._lock:
            self._dirty.add(key)
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed at shutdown
                self._loop.call_soon_threadsafe(self._wake.set)

    def _take_due(self) -> tuple[list[Key], float | None]:
        now = self.clock()
        due, later = [], None
        with self._lock:
            for key in list(self._dirty):
                wait = self._last_write.get(key, -1e9) + self.min_interval - now
                if wait <= 0:
                    due.append(key)
                    self._dirty.discard(key)
                else:
                    later = wait if later is None else min(later, wait)
        return due, later

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._wake.set()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(key: Key) -> None:
            async with gate:
                await asyncio.to_thread(self.sync_safely, key)

        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.coalesce)
            due, later = self._take_due()
            if due:
                await asyncio.gather(*(one(k) for k in due))
            if later is not None:
                self._loop.call_later(later, self._wake.set)

    # ----------------------------------------------------------------------------------- writing
    def _key_lock(self, key: Key) -> threading.Lock:
        with self._lock:
            lock = self._key_locks.get(key)
            if lock is None:
                lock = self._key_locks[key] = threading.Lock()
            return lock

    def sync(self, key: Key) -> bool:
        """Write the owned status of one cluster if it changed; True when a patch was sent."""
        with self._key_lock(key):
            record, observed, previous, alive = self.store.snapshot(key)
            if record is None or not alive:
                # No reconcile yet for this cluster in this process: nothing trustworthy to write.
                return False
            desired = desired_status(record, observed, previous, self.now())
            patch = status_patch(desired, previous)
            if patch is None:
                metrics.STATUS_WRITES.labels("unchanged").inc()
                return False
            namespace, name = key
            resp = self.kube.merge_patch(
                API_VERSION, KIND, namespace, name, {"status": patch}, subresource="status"
            )
            self.store.set_status(
                key, resp.get("status") or {}, resp.get("metadata", {}).get("resourceVersion")
            )
            with self._lock:
                self._last_write[key] = self.clock()
            metrics.STATUS_WRITES.labels("written").inc()
            return True

    def sync_safely(self, key: Key) -> None:
        """The loop's path: API trouble is logged (no traceback) and retried later, never raised."""
        try:
            self.sync(key)
        except KubeError as err:
            metrics.STATUS_WRITES.labels("error").inc()
            if err.not_found:
                return  # the cluster was deleted meanwhile
            log.warning("status of %s/%s not written (will retry): %s", key[0], key[1], err)
            self._retry_later(key)
        except Exception:
            # A bug, not an API hiccup: show it, keep the loop (and every other cluster's status) alive.
            metrics.STATUS_WRITES.labels("error").inc()
            log.exception("status of %s/%s not computed (will retry)", key[0], key[1])
            self._retry_later(key)

    def _retry_later(self, key: Key) -> None:
        with self._lock:
            self._last_write[key] = self.clock()
        self.mark(key)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._dirty.discard(key)
            self._last_write.pop(key, None)
            self._key_locks.pop(key, None)
