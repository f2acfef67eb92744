"""The KV-event subscriber against a loopback ZMQ publisher speaking vLLM's wire protocol
(PUB frames [topic, seq, payload]; ROUTER replay: 8-byte start seq in, buffered batches then seq -1 out),
fed with the recorded vLLM 0.32.0 payloads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.events import decode_payload
from kvstrata.router.index import BlockIndex
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.service import RouterService
from kvstrata.router.subscriber import KvEventSubscriber
from kvstrata_dev.testing.engines import free_port

TOPIC = b"kv-events"
URL = "http://engine"


class FakePublisher:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        # XPUB (a PUB that also hears subscriptions): the test knows when the SUB has joined, instead of
        # sleeping for it and losing messages when the machine is slow.
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.events_addr = f"tcp://127.0.0.1:{free_port()}"
        self.replay_addr = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.events_addr)
        self.router.bind(self.replay_addr)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.replay_delay = 0.0  # a slow replay: an engine with a long history on a busy machine
        self._task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            await asyncio.sleep(self.replay_delay)
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def subscribed(self) -> None:
        frame = await asyncio.wait_for(self.pub.recv(), 10)
        assert frame == b"\x01" + TOPIC, frame

    async def publish(self, seq: int, payload: bytes, *, send: bool = True) -> None:
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)  # closes what a failed test left open; term() would wait for it forever


@pytest.fixture
async def pub(ctx: zmq.asyncio.Context) -> AsyncIterator[FakePublisher]:
    p = FakePublisher(ctx)
    yield p
    await p.close()


def expected_blocks(payloads: list[bytes]) -> int:
    idx = BlockIndex(10**6)
    for i, p in enumerate(payloads):
        for ev in decode_payload(i, p).events:
            idx.apply(URL, ev)
    return len(idx)


async def wait_for(cond: object, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def start_sub(
    ctx: zmq.asyncio.Context, pub: FakePublisher, index: BlockIndex, metrics: RouterMetrics
) -> KvEventSubscriber:
    ep = Endpoint(EndpointSpec(URL, pub.events_addr, pub.replay_addr))
    sub = KvEventSubscriber(ep, index, metrics, ctx, topic="kv-events", replay_timeout=1.0)
    sub.start()
    return sub


async def test_history_gap_and_restart(
    ctx: zmq.asyncio.Context, pub: FakePublisher, kv_messages: list[tuple[bytes, int, bytes]]
) -> None:
    payloads = [p for _, _, p in kv_messages]
    index, metrics = BlockIndex(10**6), RouterMetrics()
    # History from before the router started: learnt through the start-up replay.
    for seq in range(3):
        await pub.publish(seq, payloads[seq])
    sub = await start_sub(ctx, pub, index, metrics)
    await wait_for(lambda: sub.last_seq == 2)
    assert pub.replay_requests == [0]
    assert len(index) == expected_blocks(payloads[:3])
    await pub.subscribed()
    await pub.publish(3, payloads[3])
    await wait_for(lambda: sub.last_seq == 3)
    # Seq 4..6 never reach the SUB socket: the jump to 7 is a gap, filled by replay from 4.
    for seq in range(4, 7):
        await pub.publish(seq, payloads[seq], send=False)
    await pub.publish(7, payloads[7])
    await wait_for(lambda: sub.last_seq == 7)
    assert pub.replay_requests == [0, 4]
    assert metrics.kv_event_gaps.labels(URL)._value.get() == 1
    assert metrics.kv_event_replays.labels(URL, "ok")._value.get() == 2
    assert len(index) == expected_blocks(payloads[:8])
    for seq in range(8, len(payloads)):
        await pub.publish(seq, payloads[seq])
    await wait_for(lambda: sub.last_seq == len(payloads) - 1)
    assert len(index) == expected_blocks(payloads)
    # The engine restarts: its sequence starts again at 0, and its old blocks are gone.
    sub._replayed_at = 0.0  # outside the post-replay duplicate window
    pub.buffer.clear()
    await pub.publish(0, payloads[0])
    await wait_for(lambda: sub.last_seq == 0)
    assert metrics.engine_restarts.labels(URL)._value.get() == 1
    assert len(index) == expected_blocks(payloads[:1])
    await sub.stop()


async def test_undecodable_messages_are_counted_not_fatal(
    ctx: zmq.asyncio.Context, pub: FakePublisher, kv_messages: list[tuple[bytes, int, bytes]]
) -> None:
    index, metrics = BlockIndex(10**6), RouterMetrics()
    sub = await start_sub(ctx, pub, index, metrics)
    await wait_for(lambda: pub.replay_requests == [0])
    await pub.subscribed()
    await pub.pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), b"\xc1not msgpack"])
    await pub.publish(0, kv_messages[0][2])
    await wait_for(lambda: sub.last_seq == 0)
    assert metrics.kv_event_errors.labels(URL)._value.get() == 1
    assert len(index) == expected_blocks([kv_messages[0][2]])
    await sub.stop()


async def test_synced_only_after_the_startup_replay(
    ctx: zmq.asyncio.Context, pub: FakePublisher, kv_messages: list[tuple[bytes, int, bytes]]
) -> None:
    payloads = [p for _, _, p in kv_messages]
    pub.replay_delay = 0.5
    index, metrics = BlockIndex(10**6), RouterMetrics()
    for seq in range(3):
        await pub.publish(seq, payloads[seq])
    sub = await start_sub(ctx, pub, index, metrics)
    await wait_for(lambda: pub.replay_requests == [0])
    assert not sub.synced.is_set()
    assert len(index) == 0
    await asyncio.wait_for(sub.synced.wait(), 5)
    assert len(index) == expected_blocks(payloads[:3])
    await sub.stop()


def _service(pub: FakePublisher, timeout: float) -> RouterService:
    settings = RouterSettings.model_validate(
        {
            "model": "tiny",
            "blockSize": 16,
            "remoteTokenize": False,
            "indexSyncTimeoutSeconds": timeout,
            "discovery": {"static": [{"url": URL, "kvEvents": pub.events_addr, "kvReplay": pub.replay_addr}]},
        }
    )
    return RouterService(settings, scrape=False)


async def test_service_serves_only_once_the_index_is_replayed(
    pub: FakePublisher, kv_messages: list[tuple[bytes, int, bytes]]
) -> None:
    """A router (re)started next to engines with history must not route on half of it."""
    payloads = [p for _, _, p in kv_messages]
    pub.replay_delay = 0.5
    for seq in range(5):
        await pub.publish(seq, payloads[seq])
    async with _service(pub, timeout=10) as svc:
        assert svc.router is not None
        assert len(svc.router.index) == expected_blocks(payloads[:5]) > 0


async def test_service_serves_anyway_when_the_replay_is_late(
    pub: FakePublisher, kv_messages: list[tuple[bytes, int, bytes]]
) -> None:
    pub.replay_delay = 30.0  # never in time
    await pub.publish(0, kv_messages[0][2])
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with _service(pub, timeout=0.3) as svc:
        assert loop.time() - began < 5
        assert svc.router is not None and len(svc.router.index) == 0
