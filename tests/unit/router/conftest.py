"""Recorded vLLM 0.32.0 data for the router's unit tests (see fixtures/ at the repo root)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
