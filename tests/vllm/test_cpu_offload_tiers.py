"""vLLM's CPU DRAM and NVMe (fs) KV tiers on a real CPU engine, through kvstrata's CPU-platform worker.

One engine with a 64-block pool, a CPU tier of 96 chunks of 32 tokens (24 MiB in bfloat16) and an fs
tier in a temp directory. A prompt pushed out of the pool comes back from the CPU tier
(source="host"); pushed out of the CPU tier too, it comes back from the fs tier (source="disk"). KV
events carry medium CPU and STORAGE. The module the engine loads is `kvstrata.engine.cpu_offload`, on
PYTHONPATH as in the engine image.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata.controller.hitrate import HitRates
from kvstrata.controller.promtext import parse_engine
from kvstrata.planner import plan
from kvstrata_dev.testing.engines import KV_EVENTS_TOPIC, VllmEngine, engine_spec, free_port

REPO = Path(__file__).resolve().parents[2]
# The CPU tier holds this many blocks of 32 tokens: 24 MiB in bfloat16, 48 MiB in float32 (the harness
# runs the engine in float32 where the CPU has no native bfloat16: engine_dtype).
CPU_TIER_BLOCKS = 96
BLOCK_SIZE = 32
POOL_BLOCKS = 64


def cpu_tier_bytes(tiny_model: Path) -> int:
    """``CPU_TIER_BLOCKS`` of the engine's blocks, at the KV bytes per token the planner prices its spec at."""
    spec = engine_spec(tiny_model, block_size=BLOCK_SIZE, num_gpu_blocks_override=POOL_BLOCKS)
    return CPU_TIER_BLOCKS * BLOCK_SIZE * plan(spec, suggest_fixes=False).kv_bytes_per_token


def transfer_config(root: Path, cpu_bytes: int) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "CpuTieringOffloadingSpec",
                "spec_module_path": "kvstrata.engine.cpu_offload",
                "cpu_bytes_to_use": cpu_bytes,
                "secondary_tiers": [
                    {
                        "type": "fs",
                        "root_dir": str(root),
                        "n_read_threads": 2,
                        "n_write_threads": 2,
                        "enable_kv_events": True,
                    }
                ],
            },
        },
        separators=(",", ":"),
    )


def by_source(metrics: str, source: str) -> float:
    pattern = re.compile(
        r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="' + source + r'"[^}]*\} (\S+)$', re.M
    )
    return sum(float(v) for v in pattern.findall(metrics))


def prompt(n: int) -> str:
    # Distinct from its first token on, 530-700 tokens with the tiny model's tokenizer (checked below).
    return f"doc{n} " + " ".join(f"w{n}x{i}" for i in range(125))


class Events:
    """KV events of one engine, counted by (type, medium) on a background-free poll."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seen: Counter[tuple[str, str]] = Counter()

    def drain(self, wait_ms: int = 200) -> None:
        while self.sock.poll(timeout=wait_ms):
            _topic, _seq, payload = self.sock.recv_multipart()
            _ts, events, _rank = msgspec.msgpack.decode(payload)
            for ev in events:
                if isinstance(ev, dict):
                    self.seen[(ev["type"], str(ev.get("medium")))] += len(ev.get("block_hashes") or [1])

    def close(self) -> None:
        self.sock.close()


def tiered_engine(tiny_model: Path, base: Path, root: Path, log: str) -> VllmEngine:
    return VllmEngine(
        tiny_model,
        port=free_port(),
        kv_events_port=free_port(),
        num_gpu_blocks_override=POOL_BLOCKS,
        max_model_len=1024,
        max_num_seqs=4,
        extra_args=["--kv-transfer-config", transfer_config(root, cpu_tier_bytes(tiny_model))],
        env={"PYTHONPATH": str(REPO / "operator")},
        log_path=base / log,
    )


@pytest.fixture(scope="module")
def tiered(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmEngine, Path]]:
    base = tmp_path_factory.mktemp("tiers")
    root = base / "kv-cache"
    root.mkdir()
    eng = tiered_engine(tiny_model, base, root, "engine.log")
    with eng:
        eng.wait_ready(timeout=600)
        yield eng, root


def test_blocks_come_back_from_cpu_then_disk(tiered: tuple[VllmEngine, Path]) -> None:
    eng, root = tiered
    assert "Loading out-of-tree offloading spec 'CpuTieringOffloadingSpec'" in eng.log_text()
    assert eng.kv_events_endpoint is not None
    events = Events(eng.kv_events_endpoint)
    try:
        time.sleep(1)  # let the subscription land before the first event
        first = eng.complete(prompt(0), max_tokens=1)
        assert 512 <= first["usage"]["prompt_tokens"] <= 900
        # 5 more prompts (~19 blocks each) overflow the 64-block pool but not the 96-chunk CPU tier.
        for n in range(1, 6):
            eng.complete(prompt(n), max_tokens=1)
        host0 = by_source(eng.metrics(), "host")
        eng.complete(prompt(0), max_tokens=1)
        host1 = by_source(eng.metrics(), "host")
        assert host1 - host0 >= 512, f"prompt 0 did not come back from the CPU tier: {host0} -> {host1}"
        # 10 more prompts overflow the CPU tier too; the fs tier keeps everything.
        for n in range(6, 16):
            eng.complete(prompt(n), max_tokens=1)
        time.sleep(2)  # cascade writes to the fs tier are asynchronous
        disk0 = by_source(eng.metrics(), "disk")
        eng.complete(prompt(1), max_tokens=1)
        disk1 = by_source(eng.metrics(), "disk")
        assert disk1 - disk0 >= 512, f"prompt 1 did not come back from the fs tier: {disk0} -> {disk1}"
        assert any(root.rglob("*.bin")), "the fs tier wrote no block files"
        # The operator's status reads the same counters: its cpu/nvme tier hits are the engine's.
        final = eng.metrics()
        counters = parse_engine(final).counters
        assert (counters.cpu_hits, counters.nvme_hits) == (by_source(final, "host"), by_source(final, "disk"))
        rates = HitRates.of(counters).tier_hit_rates
        assert (rates["cpu"] or 0) > 0 and (rates["nvme"] or 0) > 0, rates
        events.drain()
        stored = {medium for (kind, medium), n in events.seen.items() if kind == "BlockStored" and n}
        assert {"GPU", "CPU", "STORAGE"} <= stored, events.seen
    finally:
        events.close()


REGION = re.compile(r"Created mmap file (/dev/shm/vllm_offload_\S+\.mmap)")


def test_killed_engine_leaves_a_region_the_next_start_removes(
    tiered: tuple[VllmEngine, Path], tiny_model: Path
) -> None:
    """Runs last: it kills the module's engine. SIGKILL leaves /dev/shm/vllm_offload_<id>.mmap behind
    (vllm#54002); the restarted engine gets a new engine id (a uuid4 per start), starts, and its spec
    removes the leftover because no process has it open or mapped any more."""
    eng, root = tiered
    (old,) = set(REGION.findall(eng.log_text()))
    eng.kill()
    assert Path(old).exists(), "SIGKILL no longer leaves the region behind: the cleanup may be moot"
    again = tiered_engine(tiny_model, root.parent, root, "engine-restarted.log")
    with again:
        again.wait_ready(timeout=600)
        (new,) = set(REGION.findall(again.log_text()))
        assert new != old
        assert not Path(old).exists()
        assert f"removed stale offload region {old}" in again.log_text()
        # The fs tier survived the restart: a prompt stored before the kill loads from disk now.
        before = by_source(again.metrics(), "disk")
        again.complete(prompt(2), max_tokens=1)
        assert by_source(again.metrics(), "disk") - before >= 512
