"""Real vLLM CPU engines, started with the planner's own flags and env, size their KV pool as planned.

Each engine runs the command line the planner rendered for a CPU InferenceCluster (only the model path,
address and ports are rebound to this machine), and its own sizing log line
``CPU KV cache size: N tokens, Maximum concurrency for M tokens per request: C x`` is compared with the
plan. Note what vLLM logs: N is ``int(C * M)`` (v1/core/kv_cache_utils.py, get_kv_cache_capacity), which
is the pool's token count only when M is a multiple of the block size; the pool itself always holds
whole blocks, which the plan's tier tokens count.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.api import InferenceCluster
from kvstrata.planner import Plan, plan
from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.kv import kv_bytes_per_token, tokens_in
from kvstrata_dev.testing.engines import (
    EngineError,
    VllmEngine,
    engine_dtype,
    free_port,
    rebind_engine_args,
    rebind_engine_env,
    start_all,
    stop_all,
)
from kvstrata_dev.testing.tinymodel import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]
SIZING_LINE = re.compile(
    r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"
)
BLOCK = 32


def tiny_manifest(*, max_model_len: int, gpu_tier: dict[str, Any]) -> dict[str, Any]:
    """examples/tiny-cpu.yaml with the pool and the longest sequence under test."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["spec"]["engine"]["maxModelLen"] = max_model_len
    doc["spec"]["kvCache"]["blockSize"] = BLOCK
    doc["spec"]["kvCache"]["tiers"] = {"gpu": gpu_tier}
    return doc


# name → (maxModelLen, spec.kvCache.tiers.gpu)
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "1GiB": (4096, {"size": "1Gi"}),
    "320-blocks": (4096, {"size": "1Gi", "numBlocks": 320}),
    # maxModelLen not a multiple of the block size: the logged "tokens" is no longer the pool size.
    "320-blocks-len-3000": (3000, {"size": "1Gi", "numBlocks": 320}),
}


def sizing(log: str) -> tuple[int, int, float]:
    match = SIZING_LINE.search(log)
    assert match, "no 'CPU KV cache size' line in the engine log"
    tokens, max_len, concurrency = match.groups()
    return int(tokens.replace(",", "")), int(max_len.replace(",", "")), float(concurrency)


@pytest.fixture(scope="module")
def planned_engines(
    tiny_model: Path, vllm_py: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Plan, VllmEngine]]]:
    log_dir = tmp_path_factory.mktemp("sizing")
    out: dict[str, tuple[Plan, VllmEngine]] = {}
    for name, (max_len, gpu_tier) in CASES.items():
        ic = InferenceCluster.model_validate(tiny_manifest(max_model_len=max_len, gpu_tier=gpu_tier))
        p = plan(ic.spec)
        assert p.feasible, p.summary()
        args = rebind_engine_args(
            p.engine_args,
            model_dir=tiny_model,
            host="127.0.0.1",
            port=free_port(),
            kv_events_port=free_port(),
            kv_replay_port=free_port(),
        )
        engine = VllmEngine.from_argv(args, rebind_engine_env(p.engine_env), log_path=log_dir / f"{name}.log")
        out[name] = (p, engine)
    # An engine whose port was taken before it bound comes back rebound: keep what start_all returns.
    engines = start_all([e for _, e in out.values()], timeout=900)
    out = {name: (p, e) for (name, (p, _)), e in zip(out.items(), engines, strict=True)}
    try:
        yield out
    finally:
        stop_all(engines)


def test_tiny_example_matches_the_tiny_model(tiny_model: Path) -> None:
    """The manifest's architecture overrides describe the model directory the engines serve."""
    ic = InferenceCluster.model_validate(tiny_manifest(max_model_len=4096, gpu_tier={"size": "1Gi"}))
    from_config = architecture_from_hf_config(json.loads((tiny_model / "config.json").read_text()))
    declared = ic.spec.model.architecture
    assert declared is not None
    for field in ("attention", "num_layers", "num_kv_heads", "head_dim"):
        assert getattr(declared, field) == getattr(from_config, field), field


def test_one_gib_pool(planned_engines: dict[str, tuple[Plan, VllmEngine]], tiny_model: Path) -> None:
    p, engine = planned_engines["1GiB"]
    assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    tokens, max_len, concurrency = sizing(engine.log_text())
    arch = architecture_from_hf_config(json.loads((tiny_model / "config.json").read_text()))
    expected = tokens_in(1 << 30, kv_bytes_per_token(arch), BLOCK)
    assert tokens == expected == p.tier("gpu").tokens
    assert max_len == 4096
    assert concurrency == round(p.max_concurrency, 2) == round(expected / 4096, 2)


def test_block_override(planned_engines: dict[str, tuple[Plan, VllmEngine]]) -> None:
    p, engine = planned_engines["320-blocks"]
    assert "--num-gpu-blocks-override" in engine.argv
    tokens, max_len, concurrency = sizing(engine.log_text())
    assert max_len == 4096
    assert tokens == 320 * BLOCK == p.tier("gpu").tokens
    assert concurrency == round(p.max_concurrency, 2) == 2.5


def test_block_override_with_ragged_max_len(planned_engines: dict[str, tuple[Plan, VllmEngine]]) -> None:
    p, engine = planned_engines["320-blocks-len-3000"]
    tokens, max_len, concurrency = sizing(engine.log_text())
    assert max_len == 3000
    # A 3000-token sequence takes 94 whole blocks, so 320 blocks hold 320/94 of them.
    assert concurrency == round(p.max_concurrency, 2) == round(320 / 94, 2)
    assert p.tier("gpu").tokens == 320 * BLOCK
    assert tokens == int(p.max_concurrency * 3000) < 320 * BLOCK


def test_engines_serve_with_rendered_flags(planned_engines: dict[str, tuple[Plan, VllmEngine]]) -> None:
    for _, engine in planned_engines.values():
        out = engine.complete("the quick brown fox jumps over the lazy dog", max_tokens=3)
        assert out["usage"]["completion_tokens"] == 3


# A model whose KV is wide enough that 1 GiB holds only 128 blocks of 32 tokens (8 layers x 32 KV heads x
# 256 x 2 x 2 B = 256 KiB per token), so long sequences do not fit and vLLM refuses to start.
WIDE = {
    "num_layers": 8,
    "num_heads": 32,
    "num_kv_heads": 32,
    "head_dim": 256,
    "max_position_embeddings": 8192,
}
VLLM_REFUSAL = re.compile(
    r"To serve at least one request with the model's max seq len \((\d+)\), \(([\d.]+) GiB KV cache is needed, "
    r"which is larger than the available KV cache memory \(([\d.]+) GiB\)\. Based on the available memory, "
    r"the estimated maximum model length is (\d+)\."
)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("wide") / "m", vocab_size=1024, **WIDE)


@pytest.fixture(scope="module")
def refusing_engines(
    wide_model: Path, vllm_py: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, VllmEngine]:
    """Engines that must refuse to start, by maxModelLen; run together, each until it exits."""
    log_dir = tmp_path_factory.mktemp("refusal")
    out = {
        max_len: VllmEngine(
            wide_model,
            port=free_port(),
            max_model_len=max_len,
            kv_cache_space_gib=1,
            extra_args=["--enforce-eager"],
            log_path=log_dir / f"max-len-{max_len}.log",
        )
        for max_len in (8192, 4096)
    }
    for engine in out.values():
        engine.start()
    try:
        for engine in out.values():
            with pytest.raises(EngineError, match="exited with code"):
                engine.wait_ready(timeout=900)
    finally:
        stop_all(list(out.values()))
    return out


@pytest.mark.parametrize("max_len", [8192, 4096])
def test_refusal_predicted_before_the_engine_starts(
    refusing_engines: dict[int, VllmEngine], max_len: int
) -> None:
    """vLLM's start-up refusal, its numbers, and the maxModelLen it suggests, as the planner predicts them.

    vLLM 0.32.0 checks a max-length sequence against the pool minus the null block BlockPool holds back
    (kv_cache_utils.py, check_enough_kv_cache_memory / get_kv_cache_configs), so 128 blocks admit
    127 x 32 = 4,064 tokens, not 4,096."""
    match = VLLM_REFUSAL.search(refusing_engines[max_len].log_text())
    assert match, refusing_engines[max_len].log_tail()
    logged_len, needed_gib, available_gib, estimated = match.groups()
    assert int(logged_len) == max_len

    doc = tiny_manifest(max_model_len=max_len, gpu_tier={"size": "1Gi"})
    # The engine ran in the harness's dtype (float32 where the CPU has no native bfloat16).
    doc["spec"]["model"]["dtype"] = engine_dtype()
    doc["spec"]["model"]["architecture"].update(
        numLayers=8,
        numAttentionHeads=32,
        numKvHeads=32,
        headDim=256,
        maxPositionEmbeddings=8192,
        vocabSize=1024,
    )
    p = plan(InferenceCluster.model_validate(doc).spec)
    gpu = p.tier("gpu")
    assert gpu is not None
    block_bytes = BLOCK * p.kv_bytes_per_token_per_rank
    assert float(needed_gib) == round(p.sequence_bytes / (1 << 30), 2)
    assert float(available_gib) == round((gpu.bytes - block_bytes) / (1 << 30), 2)
    assert not p.feasible, f"vLLM refuses maxModelLen {max_len} but the plan says: {p.summary()}"
    (problem,) = [pr for pr in p.problems if pr.field == "spec.engine.maxModelLen"]
    assert f"lower spec.engine.maxModelLen to {int(estimated):,}" in problem.fixes, problem.fixes


def cpu_examples() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc and doc["spec"].get("engine", {}).get("device") == "cpu":
                out[f"{path.name}#{i}"] = doc
    return out


@pytest.mark.parametrize("name", sorted(cpu_examples()))
def test_cpu_example_boots_real_vllm(name: str, tiny_model: Path, vllm_py: Path, tmp_path: Path) -> None:
    """What a user starts from must boot: the example's rendered flags and env, on the tiny model."""
    p = plan(InferenceCluster.model_validate(cpu_examples()[name]).spec)
    assert p.feasible, p.summary()
    args = rebind_engine_args(
        p.engine_args,
        model_dir=tiny_model,
        host="127.0.0.1",
        port=free_port(),
        kv_events_port=free_port(),
        kv_replay_port=free_port(),
        kv_cache_dir=tmp_path / "kv-cache",
    )
    with VllmEngine.from_argv(
        args, rebind_engine_env(p.engine_env), log_path=tmp_path / "engine.log"
    ) as engine:
        try:
            engine.wait_ready(timeout=900)
        except EngineError as exc:
            raise AssertionError(f"{name}: the planner's flags do not boot vLLM: {exc}") from None
        assert engine.complete("a b c d", max_tokens=2)["usage"]["completion_tokens"] == 2
