"""Recorded vLLM 0.32.0 data for the router's unit tests (see fixtures/ at the repo root)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from kvstrata.router.loop import new_loop

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


def recorded_messages() -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every message in the recorded KV-event stream, in order."""
    out = []
    for line in (FIXTURES / "vllm-0.32.0-kv-events.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append((rec["topic"].encode(), int(rec["seq"]), bytes.fromhex(rec["payload_hex"])))
    return out


@pytest.fixture(scope="session")
def kv_messages() -> list[tuple[bytes, int, bytes]]:
    return recorded_messages()


@pytest.fixture(scope="session")
def metrics_text() -> str:
    return (FIXTURES / "vllm-0.32.0-metrics-load.txt").read_text()


# The modules whose tests speak HTTP to a served router: each runs on both data planes, the Python app
# and the native front (router/native_http.py), which needs the event loop of router/loop.py. Their
# `make_router` serves on the plane its loop allows.
_BOTH_PLANES = frozenset({"test_router_proxy", "test_router_hardening", "test_router_huge_prompt"})


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in _BOTH_PLANES:
        return {"python": asyncio.new_event_loop, "native": new_loop}
    return {"asyncio": asyncio.new_event_loop}
