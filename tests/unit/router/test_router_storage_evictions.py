"""The router drops the fs tier's blocks the janitor evicted (vLLM never reports them): fetched from a
real janitor eviction log over HTTP, the janitor's own handler in a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import aiohttp
import pytest
from test_router_proxy import free_port

from kvstrata.engine.fsjanitor import EvictionLog, _handler
from kvstrata.router.events import BlockStored
from kvstrata.router.index import BlockIndex
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.storage_evictions import StorageEvictions, parse_evicted

ENGINE = "http://engine"


class Janitor:
    """The janitor's HTTP side on a free port; ``restart`` swaps in a fresh log (a new process)."""

    def __init__(self) -> None:
        self.log = EvictionLog()
        self.port = free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self.log))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        self.log = EvictionLog()
        self._server.RequestHandlerClass = _handler(self.log)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def janitor() -> Iterator[Janitor]:
    j = Janitor()
    yield j
    j.close()


def _stored(hashes: list[int]) -> BlockStored:
    """What vLLM's fs tier publishes when it writes block files."""
    return BlockStored(tuple(hashes), None, (), 16, "STORAGE")


def _storage_blocks(index: BlockIndex, hashes: list[int]) -> int:
    match = index.lookup(hashes).get(ENGINE)
    return 0 if match is None else match.storage


async def test_evicted_block_files_leave_the_index(janitor: Janitor) -> None:
    index, metrics = BlockIndex(1000), RouterMetrics()
    chain = [11, 12, 13, 14]
    index.apply(ENGINE, _stored(chain))
    assert _storage_blocks(index, chain) == 4
    ep = Endpoint(EndpointSpec(ENGINE, fs_janitor=janitor.url))
    async with aiohttp.ClientSession() as session:
        storage = StorageEvictions(index, metrics, session, timeout=2)
        await storage.poll(ep)
        assert _storage_blocks(index, chain) == 4  # nothing evicted yet
        janitor.log.add([13])
        await storage.poll(ep)
        assert _storage_blocks(index, chain) == 2  # the prefix now ends before block 13
        await storage.poll(ep)  # each eviction is read once
        # The janitor restarts: its numbering starts over, and the router reads the new log from 0.
        janitor.restart()
        janitor.log.add([12])
        await storage.poll(ep)
        await storage.poll(ep)
        assert _storage_blocks(index, chain) == 1
    sample = metrics.registry.get_sample_value(
        "kvstrata_router_kv_event_blocks_total",
        {"endpoint": ENGINE, "type": "BlockRemoved", "medium": "STORAGE"},
    )
    assert sample == 2
    held = metrics.registry.get_sample_value("kvstrata_router_fs_evictions_held_total", {"endpoint": ENGINE})
    assert held == 2


async def test_a_janitor_that_does_not_answer_changes_nothing() -> None:
    index = BlockIndex(1000)
    index.apply(ENGINE, _stored([1, 2]))
    ep = Endpoint(EndpointSpec(ENGINE, fs_janitor=f"http://127.0.0.1:{free_port()}"))
    async with aiohttp.ClientSession() as session:
        await StorageEvictions(index, RouterMetrics(), session, timeout=1).poll(ep)
    assert _storage_blocks(index, [1, 2]) == 2


def test_only_an_eviction_log_answer_is_applied() -> None:
    ok = parse_evicted({"epoch": "e", "next": 2, "hashes": [1, 2], "missed": False})
    assert ok is not None and ok.hashes == (1, 2) and not ok.missed
    assert parse_evicted({"epoch": "e", "next": 2, "hashes": [-1]}) is None
    assert parse_evicted({"epoch": "e", "next": "2", "hashes": []}) is None
    assert parse_evicted(["not", "a", "map"]) is None
