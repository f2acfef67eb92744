"""Whole plans: verdicts, tier capacities, the exact fixes, and the flags that realise them."""

from __future__ import annotations

import json

from helpers import example, with_changes

from kvstrata.api.manifest import validate
from kvstrata.planner import plan

GIB = 1 << 30


def plan_of(doc):
    return plan(validate(doc).spec)


def test_tiny_cpu_example_fits_with_exact_block_capacity() -> None:
    p = plan_of(example("tiny-cpu.yaml"))
    assert p.verdict == "fits"
    gpu = p.tier("gpu")
    assert gpu is not None and gpu.blocks == 96 and gpu.tokens == 96 * 32
    assert p.engine_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # Unbound OpenMP, one thread per requested CPU: engine pods on one node must not pin the same cores.
    assert (p.engine_env["VLLM_CPU_OMP_THREADS_BIND"], p.engine_env["OMP_NUM_THREADS"]) == ("nobind", "1")
    assert "--num-gpu-blocks-override" in p.engine_args
    assert "--tensor-parallel-size" not in p.engine_args  # device cpu


def test_cpu_threads_follow_the_cpu_request_and_engine_env_wins() -> None:
    assert (
        plan_of(with_changes(example("tiny-cpu.yaml"), {"spec.engine.resources.cpu": "2500m"})).engine_env[
            "OMP_NUM_THREADS"
        ]
        == "3"
    )
    default = plan_of(with_changes(example("tiny-cpu.yaml"), {"spec.engine.resources": ...}))
    assert default.engine_env["OMP_NUM_THREADS"] == "2"  # the rendered default request
    own = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}]
    assert (
        plan_of(with_changes(example("tiny-cpu.yaml"), {"spec.engine.env": own})).engine_env[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "0-3"
    )


def test_cpu_pool_from_kv_space_when_no_block_override() -> None:
    doc = with_changes(example("tiny-cpu.yaml"), {"spec.kvCache.tiers.gpu.numBlocks": ...})
    p = plan_of(doc)
    # 1 GiB / (8192 B/token · 32 tokens/block) = 4096 blocks: what vLLM logs as "CPU KV cache size".
    assert p.tier("gpu").tokens == 4096 * 32
    assert p.max_concurrency == 4096 * 32 / 2048


def test_70b_tiered_example_plans_all_three_tiers_with_lmcache() -> None:
    p = plan_of(example("llama-70b-h100-tiered.yaml"))
    assert p.verdict == "fits-with-offload"
    assert [t.name for t in p.tiers] == ["gpu", "cpu", "nvme"]
    assert p.offload_backend == "lmcache" and "nvme" in p.offload_reason
    assert p.tier("cpu").tokens == (256 * GIB) // (327_680 * 16) * 16
    assert p.lmcache is not None and "--l2-adapter" in p.lmcache.args
    assert p.pvc_bytes == 2 * 1024 * GIB
    assert p.gpus == 4
    i = p.engine_args.index("--kv-offloading-backend")
    assert p.engine_args[i + 1] == "lmcache"


def test_cpu_tier_alone_uses_native_offloading_and_sizes_shm() -> None:
    doc = with_changes(example("llama-70b-h100-tiered.yaml"), {"spec.kvCache.tiers.nvme": ...})
    p = plan_of(doc)
    assert p.offload_backend == "native"
    args = p.engine_args
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    assert args[args.index("--kv-offloading-size") + 1] == "256"
    # Native offload pins ~1.9x its size in shared memory: /dev/shm and the pod limit grow by 2x.
    assert p.shm_bytes >= 512 * GIB
    assert p.memory_bytes >= 512 * GIB


def test_native_backend_with_nvme_renders_tiering_connector_and_warns() -> None:
    doc = with_changes(example("llama-70b-h100-tiered.yaml"), {"spec.kvCache.offload.backend": "native"})
    p = plan_of(doc)
    cfg = json.loads(p.engine_args[p.engine_args.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    assert cfg["kv_connector_extra_config"]["secondary_tiers"][0]["root_dir"] == "/kv-cache"
    assert any("does not bound or evict" in w for w in p.warnings)


def test_128k_context_on_one_gpu_is_refused_with_the_fixes() -> None:
    doc = with_changes(
        example("llama-70b-h100-tiered.yaml"),
        {
            "spec.model.name": "meta-llama/Llama-3.1-8B-Instruct",
            "spec.model.source": "hf://meta-llama/Llama-3.1-8B-Instruct",
            "spec.engine.tensorParallelSize": 1,
            "spec.engine.gpuMemory": "24Gi",
            "spec.kvCache.tiers": {"gpu": {"memoryUtilization": 0.9}},
        },
    )
    p = plan_of(doc)
    assert p.verdict == "infeasible"
    msg = p.problems[0].message()
    # 8B bf16: 131,072 B/token · 131,072 tokens = 16 GiB per sequence.
    assert msg.startswith("spec.engine.maxModelLen: maxModelLen 131,072 needs 16.0 GiB")
    # 4.6 GiB left after 15 GiB of weights: fp8 (8 GiB) or a higher utilization still would not fit, so
    # they are not offered; two GPUs would.
    assert "fp8" not in msg and "memoryUtilization" not in msg
    assert "raise spec.engine.tensorParallelSize to 2" in msg
    # 4 GPUs would fit too, but each knob is offered once, at its first working value.
    assert msg.count("tensorParallelSize") == 1
    assert "lower spec.engine.maxModelLen to" in msg


def test_fix_suggested_max_model_len_really_fits() -> None:
    base = with_changes(
        example("llama-8b-single-gpu.yaml"),
        {"spec.engine.gpuMemory": "24Gi", "spec.engine.maxModelLen": 131072},
    )
    p = plan_of(base)
    msg = p.problems[0].message()
    suggested = int(msg.rsplit("lower spec.engine.maxModelLen to ", 1)[1].replace(",", "").split(";")[0])
    fixed = plan_of(with_changes(base, {"spec.engine.maxModelLen": suggested}))
    assert fixed.verdict == "fits"
    too_long = plan_of(with_changes(base, {"spec.engine.maxModelLen": suggested + 16}))
    assert too_long.verdict == "infeasible"


def test_fp8_doubles_gpu_tier_tokens() -> None:
    base = example("llama-8b-single-gpu.yaml")
    p16 = plan_of(base)
    p8 = plan_of(with_changes(base, {"spec.kvCache.dtype": "fp8"}))
    assert (
        p8.tier("gpu").tokens == p16.tier("gpu").tokens * 2
        or abs(p8.tier("gpu").tokens - 2 * p16.tier("gpu").tokens) <= 16
    )
    assert p8.engine_args[p8.engine_args.index("--kv-cache-dtype") + 1] == "fp8"


def test_weights_that_do_not_fit_ask_for_more_tensor_parallelism() -> None:
    p = plan_of(example("infeasible-405b-one-gpu.yaml"))
    assert p.verdict == "infeasible"
    assert p.problems[0].field == "spec.engine.tensorParallelSize"
    assert "raise tensorParallelSize to 16" in p.problems[0].message()
    assert p.engine_args == []


def test_flags_digest_changes_with_the_tier_budget() -> None:
    a = plan_of(example("tiny-cpu.yaml"))
    b = plan_of(with_changes(example("tiny-cpu.yaml"), {"spec.kvCache.tiers.gpu.numBlocks": 128}))
    assert a.flags_digest != b.flags_digest
    assert plan_of(example("tiny-cpu.yaml")).flags_digest == a.flags_digest


def test_kv_events_are_always_on_for_the_router() -> None:
    p = plan_of(example("llama-8b-single-gpu.yaml"))
    cfg = json.loads(p.engine_args[p.engine_args.index("--kv-events-config") + 1])
    assert cfg["enable_kv_cache_events"] is True and cfg["endpoint"] == "tcp://*:5557"
    assert p.engine_args[p.engine_args.index("--prefix-caching-hash-algo") + 1] == "sha256"


def test_extra_args_come_last_so_users_can_override() -> None:
    doc = with_changes(
        example("llama-8b-single-gpu.yaml"), {"spec.engine.extraArgs": ["--max-num-batched-tokens", "4096"]}
    )
    assert plan_of(doc).engine_args[-2:] == ["--max-num-batched-tokens", "4096"]


def test_every_suggested_fix_really_fits() -> None:
    doc = with_changes(
        example("llama-8b-single-gpu.yaml"),
        {"spec.engine.gpuMemory": "32Gi", "spec.engine.maxModelLen": 131072},
    )
    msg = plan_of(doc).problems[0].message()
    # 16 GiB per sequence against an ~11.8 GiB pool: fp8 (8 GiB) fits, and so does a second GPU.
    assert "use spec.kvCache.dtype fp8" in msg
    assert "raise spec.engine.tensorParallelSize to 2" in msg
    assert plan_of(with_changes(doc, {"spec.kvCache.dtype": "fp8"})).verdict == "fits"
    assert plan_of(with_changes(doc, {"spec.engine.tensorParallelSize": 2})).verdict == "fits"


def test_one_max_length_sequence_must_fit_beside_the_null_block() -> None:
    # vLLM's BlockPool holds one null block back: 64 blocks of 32 admit 63 x 32 = 2,016 tokens, not 2,048.
    exact = with_changes(example("tiny-cpu.yaml"), {"spec.kvCache.tiers.gpu.numBlocks": 64})
    p = plan_of(exact)
    assert p.verdict == "infeasible"
    assert "lower spec.engine.maxModelLen to 2,016" in p.problems[0].message()
    assert plan_of(with_changes(exact, {"spec.kvCache.tiers.gpu.numBlocks": 65})).verdict == "fits"


def test_unknown_model_is_a_problem_on_the_model_name() -> None:
    doc = with_changes(example("tiny-cpu.yaml"), {"spec.model.architecture": ..., "spec.model.name": "nope"})
    p = plan_of(doc)
    assert p.verdict == "infeasible"
    (problem,) = p.problems
    assert problem.field == "spec.model.name"
    assert problem.reason.startswith("'nope' is not in the planner's catalog")
