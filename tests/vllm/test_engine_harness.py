"""The engine harness drives a real vLLM CPU engine: OpenAI API, metrics, KV events, clean stop."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata_dev.testing import engines as harness
from kvstrata_dev.testing.engines import (
    KV_EVENTS_TOPIC,
    EngineError,
    VllmEngine,
    engines,
    free_port,
    group_alive,
)


def _counter(metrics: str, name: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _event_types(payload: bytes) -> list[str]:
    _ts, events, _dp_rank = msgspec.msgpack.decode(payload)
    # 0.32.0 sends maps with a "type" key; older engines sent tagged arrays.
    return [ev["type"] if isinstance(ev, dict) else ev[0] for ev in events]


def test_engine_serves_counts_and_publishes_events(engine: VllmEngine) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
    sub.setsockopt(zmq.LINGER, 0)
    assert engine.kv_events_endpoint is not None
    sub.connect(engine.kv_events_endpoint)
    try:
        before = _counter(engine.metrics(), "vllm:prefix_cache_queries_total")
        # Long enough to fill whole 32-token blocks: only full blocks are stored and announced.
        prompt = " ".join(f"word{i}" for i in range(120))
        deadline = time.monotonic() + 60
        frames: list[bytes] = []
        while not frames and time.monotonic() < deadline:
            # PUB/SUB drops messages sent before the subscription lands, so retry until one arrives.
            out = engine.complete(prompt, max_tokens=4)
            assert out["usage"]["prompt_tokens"] > 64
            assert out["choices"][0]["text"]
            if sub.poll(timeout=5000):
                frames = sub.recv_multipart()
        assert frames, "no KV event received within 60 s"
        topic, seq, payload = frames
        assert topic == KV_EVENTS_TOPIC.encode()
        assert int.from_bytes(seq, "big") >= 0
        assert "BlockStored" in _event_types(payload)
        after = _counter(engine.metrics(), "vllm:prefix_cache_queries_total")
        assert after >= before + out["usage"]["prompt_tokens"]
    finally:
        sub.close()


def test_log_reports_kv_cache_size(engine: VllmEngine) -> None:
    assert re.search(r"CPU KV cache size: [\d,]+ tokens", engine.log_text())


def test_stop_leaves_no_process(tiny_model: Path, vllm_py: Path, tmp_path: Path) -> None:
    eng = VllmEngine(tiny_model, port=free_port(), log_path=tmp_path / "e.log").start()
    pgid = eng.pid
    assert pgid is not None
    # Stopping while still booting is the hard case: the engine-core child is mid-start.
    time.sleep(5)
    assert group_alive(pgid)
    eng.stop()
    assert not group_alive(pgid)
    assert not eng.running()


def test_crashed_engine_fails_fast_with_log(tiny_model: Path, vllm_py: Path, tmp_path: Path) -> None:
    # The CPU attention backend needs block sizes that are multiples of 32, so 16 kills the engine.
    eng = VllmEngine(tiny_model, port=free_port(), block_size=16, log_path=tmp_path / "bad.log")
    with (
        eng,
        pytest.raises(
            EngineError,
            match=r"exited with code 1 before it was ready: ValueError: No common block size for 16",
        ),
    ):
        eng.wait_ready(timeout=600)
    assert not eng.running()


def test_engines_start_together_replace_one_whose_port_was_taken_and_stop_all(
    tiny_model: Path, vllm_py: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first engine's KV-event port is handed out while something else listens on it, as when
    # another engine's vLLM took it between the pick and the bind.
    squatter = socket.socket()
    squatter.bind(("", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    handed = iter([free_port(), taken])
    monkeypatch.setattr(harness, "free_port", lambda: next(handed, None) or free_port())
    try:
        with engines(
            2, tiny_model, log_dir=tmp_path, kv_replay=True, extra_args=["--enforce-eager"]
        ) as started:
            assert len({e.port for e in started}) == 2
            assert len({e.kv_events_endpoint for e in started}) == 2
            assert all(e.kv_replay_endpoint for e in started)
            assert not any(str(taken) in (e.kv_events_endpoint or "") for e in started)
            for eng in started:
                assert eng.complete("one two three", max_tokens=2)["usage"]["completion_tokens"] == 2
            groups = [e.pid for e in started]
    finally:
        squatter.close()
    failed = [f for f in tmp_path.glob("engine-0-*.log") if "Address already in use" in f.read_text()]
    assert len(failed) == 1 and failed[0] != started[0].log_path
    assert not any(group_alive(g) for g in groups if g is not None)
