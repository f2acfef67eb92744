"""GPU pools without GPUs: the planner's verdict, tokens and concurrency equal vLLM's own pool sizing.

For a pool given in bytes (``spec.kvCache.tiers.gpu.size`` → ``--kv-cache-memory-bytes``, per rank),
vLLM's ``get_kv_cache_configs`` (run by the probe exactly as the engine core runs it after profiling)
either sizes the pool — blocks, logged capacity, concurrency at maxModelLen — or refuses to start with
its estimated maximum model length. The planner must agree on every one of these, including at the
edge where one sequence of maxModelLen exactly fills the pool (vLLM holds one null block back).
The same probe reproduces the real CPU engines' figures in test_planner_sizing_vs_engine.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvstrata.api import InferenceCluster
from kvstrata.planner import Plan, plan
from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.catalog import CATALOG
from kvstrata.planner.kv import kv_bytes_per_token
from kvstrata_dev.testing.hfconfig import hf_config_for_vllm
from kvstrata_dev.testing.vllm_probe_client import kv_spec_case, vllm_kv_capacities

BLOCK = 16
# model id → tensor-parallel sizes (MLA replicates its latent KV on every rank; Qwen 0.5B has 2 KV heads,
# so TP 4 replicates them).
MODELS: dict[str, tuple[int, ...]] = {
    "meta-llama/Llama-3.1-8B": (1, 2),
    "meta-llama/Llama-3.1-70B": (4, 8),
    "Qwen/Qwen2.5-0.5B-Instruct": (1, 4),
    "mistralai/Mistral-7B-Instruct-v0.3": (1,),
    "deepseek-ai/DeepSeek-V2-Lite": (1, 2),
    "deepseek-ai/DeepSeek-V3": (8,),
    "google/gemma-2-9b-it": (1, 2),
}
MAX_LENS = (8192, 8000)
KV_DTYPES = ("auto", "fp8")
# Pool per rank relative to one maxModelLen sequence: exactly one sequence's whole blocks, one block
# more, and about half a sequence.
POOLS = ("exact", "exact+1block", "half")


def pool_bytes(bytes_per_token: int, max_len: int, pool: str) -> int:
    blocks = -(-max_len // BLOCK)
    return {
        "exact": blocks * BLOCK * bytes_per_token,
        "exact+1block": (blocks + 1) * BLOCK * bytes_per_token,
        "half": blocks * BLOCK * bytes_per_token // 2,
    }[pool]


def manifest(
    model_id: str, tp: int, kv_dtype: str, max_len: int, pool: int, batched: int, async_sched: bool
) -> dict[str, Any]:
    return {
        "apiVersion": "kvstrata.io/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": "capacity"},
        "spec": {
            "model": {"name": model_id, "source": f"hf://{model_id}"},
            # Room for any catalog model's weights: this test is about the KV pool only.
            "engine": {
                "device": "gpu",
                "gpuMemory": "2Ti",
                "tensorParallelSize": tp,
                "maxModelLen": max_len,
                "maxNumSeqs": 1,
                "maxNumBatchedTokens": batched,
                "asyncScheduling": async_sched,
            },
            "kvCache": {"dtype": kv_dtype, "blockSize": BLOCK, "tiers": {"gpu": {"size": str(pool)}}},
        },
    }


# Sliding-window layers hold the window plus every in-flight token (max_concurrent_batches x
# max_num_batched_tokens), so for them the scheduler settings matter: vLLM's config default (2048, no async
# scheduling) and what a GPU server typically runs with (8192, async scheduling: two batches in flight).
SCHEDULING = {"sched2048": (2048, False), "sched8192async": (8192, True)}
SLIDING = {
    m
    for m in MODELS
    if CATALOG[m].get("sliding_window") and CATALOG[m].get("use_sliding_window") is not False
}

CASES = [
    (model_id, tp, kv, max_len, pool, sched)
    for model_id, tps in MODELS.items()
    for tp, kv, max_len, pool, sched in itertools.product(
        tps, KV_DTYPES, MAX_LENS, POOLS, SCHEDULING if model_id in SLIDING else ["sched2048"]
    )
]
IDS = ["-".join(map(str, c)).replace("/", "_") for c in CASES]


def _pool(model_id: str, tp: int, kv: str, max_len: int, pool: str) -> int:
    arch = architecture_from_hf_config(CATALOG[model_id])
    return pool_bytes(kv_bytes_per_token(arch, kv, "bfloat16", tp), max_len, pool)


@pytest.fixture(scope="module")
def vllm_capacity() -> dict[tuple[Any, ...], dict[str, Any]]:
    cases = [
        {
            **kv_spec_case(hf_config_for_vllm(CATALOG[m]), kv, BLOCK, tensor_parallel=tp),
            "max_model_len": max_len,
            "available_bytes": _pool(m, tp, kv, max_len, pool),
        }
        for m, tp, kv, max_len, pool, _ in CASES
    ]
    for case, (*_, sched) in zip(cases, CASES, strict=True):
        case["max_num_batched_tokens"], case["async_scheduling"] = SCHEDULING[sched]
    return dict(zip(CASES, vllm_kv_capacities(cases), strict=True))


def _plan(model_id: str, tp: int, kv: str, max_len: int, pool: str, sched: str) -> Plan:
    doc = manifest(model_id, tp, kv, max_len, _pool(model_id, tp, kv, max_len, pool), *SCHEDULING[sched])
    return plan(InferenceCluster.model_validate(doc).spec)


@pytest.mark.parametrize(("model_id", "tp", "kv", "max_len", "pool", "sched"), CASES, ids=IDS)
def test_planner_sizes_the_pool_as_vllm(
    vllm_capacity: dict[tuple[Any, ...], dict[str, Any]],
    model_id: str,
    tp: int,
    kv: str,
    max_len: int,
    pool: str,
    sched: str,
) -> None:
    got = vllm_capacity[(model_id, tp, kv, max_len, pool, sched)]
    p = _plan(model_id, tp, kv, max_len, pool, sched)
    if not got["ok"]:
        # vLLM rejects the configuration itself (e.g. TP not dividing the attention heads).
        assert not p.feasible, f"vLLM rejects it ({got['error'][:200]}) but the plan says: {p.summary()}"
        return
    other = [pr.message() for pr in p.problems if pr.field != "spec.engine.maxModelLen"]
    assert not other, other
    if got["refused"]:
        assert not p.feasible, f"vLLM refuses ({got['error'][:160]}) but the plan says: {p.summary()}"
        (problem,) = p.problems
        if got["estimated_max_model_len"] >= BLOCK:
            fix = f"lower spec.engine.maxModelLen to {got['estimated_max_model_len']:,}"
            assert fix in problem.fixes, problem.fixes
        return
    assert p.feasible, f"vLLM starts with {got['num_blocks']} blocks but the plan says: {p.summary()}"
    assert p.max_concurrency == pytest.approx(got["max_concurrency"], rel=1e-9), (
        f"concurrency at maxModelLen: plan {p.max_concurrency:.4f}, vLLM {got['max_concurrency']:.4f} "
        f"({got['num_groups']} KV cache group(s), {got['max_in_flight_tokens']} tokens in flight)"
    )
    gpu = p.tier("gpu")
    assert gpu is not None
    if got["num_groups"] == 1:
        # With one group a vLLM block is block_size tokens of every layer, as the planner counts.
        assert (gpu.blocks, gpu.tokens) == (got["num_blocks"], got["num_blocks"] * BLOCK)


def test_matrix_has_both_outcomes(vllm_capacity: dict[tuple[Any, ...], dict[str, Any]]) -> None:
    outcomes = {r["refused"] for r in vllm_capacity.values() if r["ok"]}
    assert outcomes == {True, False}
