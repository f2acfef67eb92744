"""One ZMQ SUB per engine: KV events into the index, with gap detection, replay and reconnects.

Sequence rules (the publisher numbers batches 0, 1, 2, ... from its start):
- next expected seq: apply;
- a jump ahead: a gap (the SUB socket dropped messages or we were slow to join) — ask the engine's
  replay ROUTER for the missing batches, then continue;
- a seq not above the last one: a duplicate right after a replay (live and replayed batches overlap),
  otherwise the engine restarted with an empty cache, so its index entries are dropped.
On start the subscriber replays from 0 to learn what the engine cached before the router came up
(the engine keeps ``buffer_steps`` batches); ``synced`` is set once that first replay is over, whatever
its result, so the service can hold traffic until the index reflects the engine. ZMQ reconnects TCP on
its own with exponential backoff (RECONNECT_IVL → RECONNECT_IVL_MAX); socket errors recreate the socket
with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvstrata.api.router_config import KV_EVENTS_TOPIC
from kvstrata.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_frames,
    decode_seq,
)
from kvstrata.router.index import PrefixIndex
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint

log = logging.getLogger("kvstrata.router.events")

END_SEQ = -1
_DUPLICATE_WINDOW_S = 5.0
_TYPE_NAMES = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}


class KvEventSubscriber:
    def __init__(
        self,
        endpoint: Endpoint,
        index: PrefixIndex,
        metrics: RouterMetrics,
        ctx: zmq.asyncio.Context,
        topic: str = KV_EVENTS_TOPIC,
        replay_timeout: float = 3.0,
        on_batch: Callable[[EventBatch], None] | None = None,
    ) -> None:
        if endpoint.spec.kv_events is None:
            raise ValueError(f"endpoint {endpoint.url} has no KV events socket")
        self.endpoint = endpoint
        self.url = endpoint.url
        self.events_addr: str = endpoint.spec.kv_events
        self.replay_addr = endpoint.spec.kv_replay
        self.index = index
        self.metrics = metrics
        self.ctx = ctx
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.on_batch = on_batch
        self.last_seq: int | None = None
        self.applied_batches = 0
        self._replayed_at = 0.0
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.url}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            try:
                sock.connect(self.events_addr)
                # Learn history first; live batches meanwhile wait in the SUB queue and the
                # duplicates among them are skipped.
                if self.last_seq is None and self.replay_addr:
                    began = time.monotonic()
                    await self._replay(0, None)  # never raises: failures are counted and logged
                    log.info(
                        "KV events %s: history replayed up to seq %s in %.2fs",
                        self.url,
                        self.last_seq,
                        time.monotonic() - began,
                    )
                self.synced.set()
                while True:
                    frames = await sock.recv_multipart()
                    await self.handle(frames)
                    backoff = 0.1
            except zmq.ZMQError as exc:
                log.warning("KV events %s: %s; reconnecting in %.1fs", self.events_addr, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                sock.close(linger=0)

    async def handle(self, frames: list[bytes]) -> None:
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            self.metrics.kv_event_errors.labels(self.url).inc()
            log.warning("KV events %s: undecodable message: %s", self.url, exc)
            return
        seq, last = batch.seq, self.last_seq
        if last is not None and seq <= last:
            if time.monotonic() - self._replayed_at < _DUPLICATE_WINDOW_S:
                return
            log.info("KV events %s: sequence restarted (%d after %d): engine restarted", self.url, seq, last)
            self.metrics.engine_restarts.labels(self.url).inc()
            self.index.drop_endpoint(self.url)
            self.last_seq = last = None
        if last is None:
            # First batch since start or restart: anything before it is history the replay buffer has.
            if seq > 0 and self.replay_addr:
                await self._replay(0, seq)
        elif seq > last + 1:
            self.metrics.kv_event_gaps.labels(self.url).inc()
            log.info("KV events %s: gap %d..%d", self.url, last + 1, seq - 1)
            if self.replay_addr:
                await self._replay(last + 1, seq)
        self.apply(batch)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            self.index.apply(self.url, event)
            kind = _TYPE_NAMES.get(type(event), "Unknown")
            self.metrics.kv_events.labels(self.url, kind).inc()
            if isinstance(event, BlockStored | BlockRemoved):
                self.metrics.kv_event_blocks.labels(self.url, kind, event.medium).inc(len(event.block_hashes))
        self.last_seq = batch.seq
        self.applied_batches += 1
        self.endpoint.extra["kvEventSeq"] = batch.seq
        self.endpoint.extra["kvEventBatches"] = self.applied_batches
        self.metrics.kv_event_lag.labels(self.url).set(max(0.0, time.time() - batch.ts))
        if self.on_batch:
            self.on_batch(batch)

    async def _replay(self, start: int, stop: int | None) -> None:
        """Apply buffered batches ``start <= seq < stop`` (all when stop is None) from the replay socket."""
        assert self.replay_addr is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        result, first = "timeout", None
        try:
            sock.connect(self.replay_addr)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(self.replay_timeout * 1000):
                    break
                frames = await sock.recv_multipart()
                if len(frames) >= 3 and decode_seq(frames[-2]) == END_SEQ:
                    result = "ok"
                    break
                batch = decode_frames(frames)
                first = batch.seq if first is None else first
                if (stop is None or batch.seq < stop) and (
                    self.last_seq is None or batch.seq > self.last_seq
                ):
                    self.apply(batch)
        except (zmq.ZMQError, EventDecodeError) as exc:
            log.warning("KV events %s: replay failed: %s", self.url, exc)
            result = "error"
        finally:
            sock.close(linger=0)
        if result == "ok" and first is not None and first > start:
            result = "partial"  # the engine's buffer no longer held the start of the gap
        self.metrics.kv_event_replays.labels(self.url, result).inc()
        self._replayed_at = time.monotonic()
