"""The vLLM command line and env that realise a plan (vLLM 0.32.0 flag names, checked by its own parser)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvstrata.api.models import InferenceClusterSpec
from kvstrata.api.quantity import GIB, quantity_bytes, quantity_units
from kvstrata.planner.constants import (
    HF_HOME,
    KV_EVENTS_PORT,
    KV_EVENTS_TOPIC,
    KV_REPLAY_PORT,
    MODEL_MOUNT,
    NVME_MOUNT,
    engine_cpus,
)

DEFAULT_CPU_KV_SPACE = 4 * GIB
# The CPU-platform offloading spec (kvstrata.engine.cpu_offload), importable by vLLM from the engine
# image's ENGINE_PYTHONPATH (images/engine/Dockerfile copies kvstrata's engine package there).
CPU_SPEC_NAME = "CpuTieringOffloadingSpec"
CPU_SPEC_MODULE = "kvstrata.engine.cpu_offload"
ENGINE_PYTHONPATH = "/opt/kvstrata"

if TYPE_CHECKING:
    from kvstrata.planner.plan import Plan


def model_argument(spec: InferenceClusterSpec) -> str:
    """hf://org/name → org/name (downloaded into HF_HOME); pvc://claim/path → /models/path."""
    source = spec.model.source
    if source.startswith("hf://"):
        return source.removeprefix("hf://")
    _, _, path = source.removeprefix("pvc://").partition("/")
    return f"{MODEL_MOUNT}/{path}".rstrip("/")


def kv_events_config() -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
            "topic": KV_EVENTS_TOPIC,
        },
        separators=(",", ":"),
    )


def _offload_args(spec: InferenceClusterSpec, plan: Plan) -> list[str]:
    kv = spec.kv_cache
    cpu_bytes = quantity_bytes(kv.tiers.cpu.size) if kv.tiers.cpu else 0
    if plan.offload_backend == "lmcache":
        # vLLM connects to the LMCache server sidecar, which owns the capacity; the size only switches
        # offloading on and is not passed to LMCache (FACTS.md).
        return ["--kv-offloading-backend", "lmcache", "--kv-offloading-size", f"{max(cpu_bytes / GIB, 1):g}"]
    cpu_device = spec.engine.device == "cpu"
    if kv.tiers.nvme is None and not cpu_device:
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{cpu_bytes / GIB:g}"]
    # Native tiering: CPU tier plus an fs secondary tier on the PVC (v1/kv_offload/tiering). On device cpu
    # vLLM's own specs refuse to build their copy worker; kvstrata's spec subclass supplies one.
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes or GIB}
    if cpu_device:
        extra |= {"spec_name": CPU_SPEC_NAME, "spec_module_path": CPU_SPEC_MODULE}
    else:
        extra["spec_name"] = "TieringOffloadingSpec"
    if kv.tiers.nvme is not None:
        threads = 4 if cpu_device else 16
        # enable_kv_events: the fs tier announces its blocks (medium STORAGE) only when asked (default False).
        extra["secondary_tiers"] = [
            {
                "type": "fs",
                "root_dir": NVME_MOUNT,
                "n_read_threads": threads,
                "n_write_threads": threads,
                "enable_kv_events": True,
            }
        ]
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]


def engine_args(spec: InferenceClusterSpec, plan: Plan) -> list[str]:
    eng, kv, model = spec.engine, spec.kv_cache, spec.model
    args = [
        "--model",
        model_argument(spec),
        "--served-model-name",
        model.served_name or model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(eng.port),
        "--dtype",
        model.dtype,
        "--max-model-len",
        str(eng.max_model_len),
        "--max-num-seqs",
        str(eng.max_num_seqs),
        "--block-size",
        str(plan.block_size),
        "--kv-cache-dtype",
        kv.dtype,
        "--enable-prefix-caching" if kv.prefix_caching else "--no-enable-prefix-caching",
        "--prefix-caching-hash-algo",
        kv.hash_algo,
        "--kv-events-config",
        kv_events_config(),
        # Lets the router compare its predicted cached tokens with what the engine really reused.
        "--enable-prompt-tokens-details",
    ]
    args += ["--max-num-batched-tokens", str(plan.max_num_batched_tokens)]
    if model.load_format != "auto":
        args += ["--load-format", model.load_format]
    if eng.device == "gpu":
        args += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
        args.append("--async-scheduling" if eng.async_scheduling else "--no-async-scheduling")
        if kv.tiers.gpu.size is not None:
            args += ["--kv-cache-memory-bytes", str(quantity_bytes(kv.tiers.gpu.size))]
        else:
            args += ["--gpu-memory-utilization", f"{kv.tiers.gpu.memory_utilization:g}"]
    if kv.tiers.gpu.num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(kv.tiers.gpu.num_blocks)]
    if plan.offload_backend:
        args += _offload_args(spec, plan)
    return args + list(eng.extra_args)


def cpu_kv_space_bytes(spec: InferenceClusterSpec) -> int:
    """What device cpu reserves for KV (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    size = spec.kv_cache.tiers.gpu.size
    return quantity_bytes(size) if size is not None else DEFAULT_CPU_KV_SPACE


def unpinned_omp_env(threads: int) -> dict[str, str]:
    """Environment for a vLLM CPU engine that shares its machine with other engines.

    vLLM binds its OpenMP threads to cores it picks from all the process sees; without the kubelet's
    static CPU manager that is the whole node, so every engine on a node pins the same cores (seen:
    three engines on core 0 of two). Unbound, vLLM no longer lowers torch's thread count, so the count is
    set too: one thread per CPU the engine may use, and the kernel shares the cores."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, threads))}


def engine_env(spec: InferenceClusterSpec, plan: Plan) -> dict[str, str]:
    env: dict[str, str] = {}
    if spec.model.source.startswith("hf://"):
        env["HF_HOME"] = HF_HOME
    if spec.engine.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_bytes(spec) // GIB)
        cpus = engine_cpus("cpu", spec.engine.tensor_parallel_size, spec.engine.resources.cpu)
        env.update(unpinned_omp_env(quantity_units(cpus)))  # engine.env below overrides both
        if plan.offload_backend == "native":
            env["PYTHONPATH"] = ENGINE_PYTHONPATH
    for var in spec.engine.env:
        env[var.name] = var.value
    return env
