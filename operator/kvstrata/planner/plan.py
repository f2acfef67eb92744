"""spec → Plan: tier capacities, concurrency, verdict with reasons and fixes. Pure: no I/O, no clock.

Sizing follows vLLM 0.32: the engine's own pool must hold at least one sequence of maxModelLen (vLLM refuses to
start otherwise); CPU and NVMe tiers hold blocks evicted from that pool for later prefix hits — they never
hold a running sequence, so they cannot rescue a maxModelLen that does not fit the engine pool.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstrata.api.models import InferenceClusterSpec, PlanStatus, TierPlan
from kvstrata.api.quantity import GIB, gib, quantity_bytes
from kvstrata.planner import flags
from kvstrata.planner.arch import Architecture, UnknownModel, resolve_architecture
from kvstrata.planner.constants import LMCACHE_PORT, NVME_MOUNT
from kvstrata.planner.kv import (
    blocks_per_request,
    kv_bytes_per_token,
    layer_bytes_per_token,
    longest_sequence,
    pool_layout,
    sequence_bytes,
    tokens_in,
)
from kvstrata.planner.problem import Fix, Problem

Verdict = Literal["fits", "fits-with-offload", "infeasible"]

DEFAULT_BLOCK_SIZE = {"gpu": 16, "cpu": 128}
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"gpu": 8192, "cpu": 2048}
# Memory vLLM needs beside weights and KV on each GPU: CUDA context, NCCL, activations at the default
# batch, sampler. vLLM measures the real figure at start; the planner reserves a conservative estimate.
ACTIVATION_RESERVE_FLOOR = 2 * GIB
ACTIVATION_RESERVE_SHARE = 0.04
# vLLM's native CPU offload pins about 1.9x its size in shared memory (vllm#53042): size /dev/shm for 2x.
NATIVE_OFFLOAD_SHM_FACTOR = 2.0
GPU_POD_HOST_MEMORY = 16 * GIB
LMCACHE_SIDECAR_OVERHEAD = 2 * GIB
LMCACHE_STAGING_CPU = 1 * GIB
# LMCache's disk tier gets 90% of the PVC: filesystem metadata and in-flight temp files need the rest.
NVME_USABLE_SHARE = 0.9


@dataclass(frozen=True)
class Tier:
    name: Literal["gpu", "cpu", "nvme"]
    bytes: int
    tokens: int
    blocks: int


@dataclass(frozen=True)
class LmcacheSidecar:
    """The standalone LMCache server vLLM's LMCacheMPConnector talks to (tcp://localhost:5555)."""

    args: tuple[str, ...]
    memory_bytes: int


@dataclass
class Plan:
    verdict: Verdict
    architecture: Architecture | None
    block_size: int
    max_num_batched_tokens: int = 0
    kv_bytes_per_token: int = 0  # all layers, all TP ranks
    kv_bytes_per_token_per_rank: int = 0
    tiers: list[Tier] = field(default_factory=list)
    max_concurrency: float = 0.0
    sequence_bytes: int = 0
    weights_bytes_per_rank: int = 0
    offload_backend: str | None = None
    offload_reason: str = ""
    engine_args: list[str] = field(default_factory=list)
    engine_env: dict[str, str] = field(default_factory=dict)
    memory_bytes: int = 0
    shm_bytes: int = 0
    pvc_bytes: int = 0
    gpus: int = 0
    lmcache: LmcacheSidecar | None = None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.verdict != "infeasible"

    @property
    def flags_digest(self) -> str:
        """Changes whenever the engine command line or env changes: the pod template carries it."""
        text = "\0".join([*self.engine_args, *(f"{k}={v}" for k, v in sorted(self.engine_env.items()))])
        if self.lmcache:
            text += "\0" + "\0".join(self.lmcache.args)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def tier_names(self) -> str:
        return "+".join(t.name for t in self.tiers) or "-"

    def summary(self) -> str:
        if not self.feasible:
            return "; ".join(p.message() for p in self.problems)
        parts = [f"{t.name} {t.tokens:,} tokens ({gib(t.bytes)})" for t in self.tiers]
        return (
            f"{self.verdict}: " + ", ".join(parts) + f"; {self.max_concurrency:.2f}x sequences at maxModelLen"
        )

    def to_status(self) -> PlanStatus:
        return PlanStatus(
            verdict=self.verdict,
            kv_bytes_per_token=self.kv_bytes_per_token,
            tiers=[
                TierPlan(name=t.name, bytes=t.bytes, tokens=t.tokens, blocks=t.blocks) for t in self.tiers
            ],
            max_concurrency=round(self.max_concurrency, 2),
            offload_backend=self.offload_backend,
            flags_digest=self.flags_digest if self.feasible else "",
            summary=self.summary()[:1000],
        )


def _tier(name: Literal["gpu", "cpu", "nvme"], nbytes: int, per_token: int, block_size: int) -> Tier:
    tokens = tokens_in(nbytes, per_token, block_size)
    return Tier(name=name, bytes=nbytes, tokens=tokens, blocks=tokens // block_size)


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _structural_problems(spec: InferenceClusterSpec, arch: Architecture) -> list[Problem]:
    """What vLLM would refuse at start, whatever the memory."""
    out: list[Problem] = []
    eng, kv = spec.engine, spec.kv_cache
    tp = eng.tensor_parallel_size
    if arch.num_attention_heads % tp:
        divisors = [d for d in range(1, arch.num_attention_heads + 1) if arch.num_attention_heads % d == 0]
        ok = [d for d in divisors if d <= 16]
        out.append(
            Problem(
                "spec.engine.tensorParallelSize",
                f"{tp} does not divide the model's {arch.num_attention_heads} attention heads",
                (f"use one of {ok}",),
            )
        )
    if arch.max_position_embeddings and eng.max_model_len > arch.max_position_embeddings:
        out.append(
            Problem(
                "spec.engine.maxModelLen",
                f"{_fmt_int(eng.max_model_len)} exceeds the model's context of "
                f"{_fmt_int(arch.max_position_embeddings)} tokens (max_position_embeddings)",
                (f"set maxModelLen to at most {_fmt_int(arch.max_position_embeddings)}",),
            )
        )
    block = kv.block_size or DEFAULT_BLOCK_SIZE[eng.device]
    if eng.device == "cpu":
        if block % 32:
            out.append(
                Problem(
                    "spec.kvCache.blockSize",
                    f"{block} is not a multiple of 32, which vLLM's CPU attention backend requires",
                    (
                        f"use {', '.join(str(n) for n in sorted({max(32, block // 32 * 32), (block // 32 + 1) * 32}))}",
                    ),
                )
            )
        # Offload tiers on device cpu run vLLM's native tiering with kvstrata's host-copy worker
        # (kvstrata.engine.cpu_offload); LMCache ships CUDA ops only.
        if kv.offload.backend == "lmcache" and (kv.tiers.cpu or kv.tiers.nvme):
            out.append(
                Problem(
                    "spec.kvCache.offload.backend",
                    "lmcache needs CUDA (its 0.5.6 wheel ships CUDA ops); device cpu offloads with vLLM's native tiering",
                    ("set backend native", "set backend auto"),
                )
            )
        if kv.tiers.gpu.size is not None and quantity_bytes(kv.tiers.gpu.size) % GIB:
            out.append(
                Problem(
                    "spec.kvCache.tiers.gpu.size",
                    f"{kv.tiers.gpu.size} is not whole GiB; device cpu sizes KV with VLLM_CPU_KVCACHE_SPACE (GiB)",
                    (f"use {max(1, round(quantity_bytes(kv.tiers.gpu.size) / GIB))}Gi",),
                )
            )
    if arch.attention == "mla" and (kv.tiers.cpu or kv.tiers.nvme):
        out.append(
            Problem(
                "spec.kvCache.tiers",
                "MLA models cannot use offload tiers (vLLM's KV connectors do not support MLA)",
                ("remove spec.kvCache.tiers.cpu and spec.kvCache.tiers.nvme",),
            )
        )
    if arch.attention == "mla" and kv.dtype in {"fp8_e5m2"}:
        out.append(
            Problem("spec.kvCache.dtype", "MLA supports fp8 (e4m3) KV only", ("use dtype fp8 or auto",))
        )
    if kv.offload.backend == "lmcache" and eng.device == "gpu" and not (kv.tiers.cpu or kv.tiers.nvme):
        out.append(
            Problem(
                "spec.kvCache.offload.backend",
                "lmcache needs a cpu or nvme tier to offload to",
                ("add spec.kvCache.tiers.cpu or .nvme", "set backend auto"),
            )
        )
    return out


def _engine_pool_bytes(spec: InferenceClusterSpec, arch: Architecture, plan: Plan) -> int:
    """KV bytes of the engine's own pool on one rank (HBM on GPU, host RAM on device cpu)."""
    eng, gpu_tier = spec.engine, spec.kv_cache.tiers.gpu
    if eng.device == "cpu":
        return flags.cpu_kv_space_bytes(spec)
    tp = eng.tensor_parallel_size
    gpu_mem = quantity_bytes(eng.gpu_memory)
    plan.weights_bytes_per_rank = math.ceil(arch.params_billions * 1e9 * arch.weight_bytes_per_param / tp)
    reserve = max(ACTIVATION_RESERVE_FLOOR, int(gpu_mem * ACTIVATION_RESERVE_SHARE))
    budget = int(gpu_mem * gpu_tier.memory_utilization)
    if gpu_tier.size is not None:
        kv_bytes = quantity_bytes(gpu_tier.size)
        if plan.weights_bytes_per_rank + kv_bytes + reserve > gpu_mem:
            room = gpu_mem - plan.weights_bytes_per_rank - reserve
            plan.problems.append(
                Problem(
                    "spec.kvCache.tiers.gpu.size",
                    f"{gib(kv_bytes)} of KV plus {gib(plan.weights_bytes_per_rank)} of weights per GPU and "
                    f"{gib(reserve)} for activations exceed the GPU's {gib(gpu_mem)}",
                    (f"set size to at most {max(0, room) // GIB}Gi", "raise spec.engine.tensorParallelSize"),
                )
            )
        return kv_bytes
    kv_bytes = budget - plan.weights_bytes_per_rank - reserve
    if kv_bytes <= 0:
        need_tp = tp
        while need_tp < 64 and budget - plan.weights_bytes_per_rank * tp / need_tp - reserve <= 0:
            need_tp *= 2
        plan.problems.append(
            Problem(
                "spec.engine.tensorParallelSize",
                f"weights need {gib(plan.weights_bytes_per_rank)} per GPU but {gpu_tier.memory_utilization:.2f} "
                f"of {gib(gpu_mem)} leaves {gib(budget - reserve)} after the activation reserve",
                (
                    f"raise tensorParallelSize to {need_tp}",
                    "use GPUs with more memory (spec.engine.gpuMemory)",
                    "raise spec.kvCache.tiers.gpu.memoryUtilization",
                ),
            )
        )
    return kv_bytes


def _offload(spec: InferenceClusterSpec, plan: Plan, per_token_all_ranks: int) -> None:
    kv = spec.kv_cache
    if kv.tiers.cpu is None and kv.tiers.nvme is None:
        return
    backend = kv.offload.backend
    if backend == "auto":
        if spec.engine.device == "cpu":
            backend = "native"
            plan.offload_reason = (
                "auto: device cpu, so vLLM's native tiering (CPU tier, fs tier on the PVC) with kvstrata's "
                "CPU-platform copy worker; the fs tier is bounded by the kvstrata janitor sidecar"
            )
        elif kv.tiers.nvme is not None:
            backend = "lmcache"
            plan.offload_reason = (
                "auto: nvme tier present, so LMCache server sidecar (bounded CPU tier with LRU eviction and a "
                "disk tier on the PVC); vLLM's native fs tier neither bounds nor evicts its directory"
            )
        else:
            backend = "native"
            plan.offload_reason = (
                "auto: CPU tier only, so vLLM's native OffloadingConnector (no extra process)"
            )
    else:
        plan.offload_reason = f"{backend}: set in spec.kvCache.offload.backend"
    plan.offload_backend = backend
    block = plan.block_size
    if kv.tiers.cpu is not None:
        cpu_bytes = quantity_bytes(kv.tiers.cpu.size)
        plan.tiers.append(_tier("cpu", cpu_bytes, per_token_all_ranks, block))
        gpu = plan.tier("gpu")
        if gpu and cpu_bytes * 1 < gpu.bytes * spec.engine.tensor_parallel_size:
            plan.warnings.append(
                f"spec.kvCache.tiers.cpu: {gib(cpu_bytes)} is smaller than the GPU pool "
                f"({gib(gpu.bytes * spec.engine.tensor_parallel_size)}); offloaded blocks will churn"
            )
    if kv.tiers.nvme is not None:
        pvc = quantity_bytes(kv.tiers.nvme.size)
        plan.pvc_bytes = pvc
        usable = int(pvc * NVME_USABLE_SHARE)
        plan.tiers.append(_tier("nvme", usable, per_token_all_ranks, block))
        if backend == "native" and spec.engine.device == "gpu":
            plan.warnings.append(
                "spec.kvCache.offload.backend native: vLLM's fs tier does not bound or evict its directory; "
                "writes fail once the PVC is full. Prefer backend auto/lmcache for an NVMe tier"
            )


def native_cpu_tier_bytes(spec: InferenceClusterSpec) -> int:
    """The CPU tier vLLM's native tiering allocates: the spec's, or a 1 GiB staging tier when only an NVMe
    tier is asked for (the CPU tier is the only path between the engine pool and the fs tier)."""
    cpu = spec.kv_cache.tiers.cpu
    return quantity_bytes(cpu.size) if cpu else GIB


def _plan_memory(spec: InferenceClusterSpec, plan: Plan, pool_bytes: int) -> None:
    eng, kv = spec.engine, spec.kv_cache
    cpu_tier = quantity_bytes(kv.tiers.cpu.size) if kv.tiers.cpu else 0
    if eng.device == "cpu":
        weights = math.ceil(plan.architecture.params_billions * 1e9 * 2) if plan.architecture else 0
        plan.memory_bytes = weights + pool_bytes + 4 * GIB
        plan.shm_bytes = 1 * GIB
        if plan.offload_backend == "native":
            # The CPU tier is one /dev/shm region (scheduler and worker map the same file), charged to
            # the pod's memory; sized like the GPU path's native offload.
            host = native_cpu_tier_bytes(spec)
            plan.shm_bytes += int(host * NATIVE_OFFLOAD_SHM_FACTOR)
            plan.memory_bytes += int(host * NATIVE_OFFLOAD_SHM_FACTOR)
        return
    plan.gpus = eng.tensor_parallel_size
    plan.shm_bytes = 2 * GIB if eng.tensor_parallel_size > 1 else 1 * GIB
    plan.memory_bytes = GPU_POD_HOST_MEMORY
    if plan.offload_backend == "native" and cpu_tier:
        plan.shm_bytes += int(cpu_tier * NATIVE_OFFLOAD_SHM_FACTOR)
        plan.memory_bytes += int(cpu_tier * NATIVE_OFFLOAD_SHM_FACTOR)


def _lmcache_sidecar(spec: InferenceClusterSpec, plan: Plan) -> LmcacheSidecar:
    kv = spec.kv_cache
    cpu_bytes = quantity_bytes(kv.tiers.cpu.size) if kv.tiers.cpu else LMCACHE_STAGING_CPU
    args = [
        "lmcache",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(LMCACHE_PORT),
        "--l1-size-gb",
        f"{cpu_bytes / GIB:g}",
        "--eviction-policy",
        "LRU",
        "--chunk-size",
        "256",
    ]
    if kv.tiers.nvme is not None:
        args += ["--l2-adapter", json.dumps({"type": "fs", "base_path": NVME_MOUNT}, separators=(",", ":"))]
    return LmcacheSidecar(args=tuple(args), memory_bytes=cpu_bytes + LMCACHE_SIDECAR_OVERHEAD)


def plan(spec: InferenceClusterSpec, *, suggest_fixes: bool = True) -> Plan:
    """The whole plan for one InferenceCluster spec. Never raises for a bad spec: problems are the verdict."""
    eng, kv = spec.engine, spec.kv_cache
    block = kv.block_size or DEFAULT_BLOCK_SIZE[eng.device]
    try:
        arch = resolve_architecture(spec.model)
    except UnknownModel as err:
        return Plan(verdict="infeasible", architecture=None, block_size=block, problems=[err.problem])
    out = Plan(verdict="fits", architecture=arch, block_size=block)
    out.max_num_batched_tokens = eng.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[eng.device]
    out.problems += _structural_problems(spec, arch)
    tp = eng.tensor_parallel_size if eng.device == "gpu" else 1
    layer_bytes = layer_bytes_per_token(arch, kv.dtype, spec.model.dtype, tp)
    out.kv_bytes_per_token_per_rank = kv_bytes_per_token(arch, kv.dtype, spec.model.dtype, tp)
    out.kv_bytes_per_token = out.kv_bytes_per_token_per_rank * (1 if arch.attention == "mla" else tp)
    pool = max(_engine_pool_bytes(spec, arch, out), 0)
    layout = pool_layout(arch)
    # One pool block = block_size tokens of `group_size` layers (all layers unless the model mixes
    # sliding-window and full attention).
    block_bytes = layout.group_size * block * layer_bytes
    num_blocks = pool // block_bytes
    if kv.tiers.gpu.num_blocks is not None:
        if kv.tiers.gpu.num_blocks > num_blocks:
            out.problems.append(
                Problem(
                    "spec.kvCache.tiers.gpu.numBlocks",
                    f"{kv.tiers.gpu.num_blocks:,} blocks need {gib(kv.tiers.gpu.num_blocks * block_bytes)} "
                    f"but the engine pool has {gib(pool)}",
                    (f"lower numBlocks to {num_blocks:,}", "grow the pool (spec.kvCache.tiers.gpu.size)"),
                )
            )
        num_blocks = min(num_blocks, kv.tiers.gpu.num_blocks)
        pool = num_blocks * block_bytes
    in_flight = out.max_num_batched_tokens * (2 if eng.device == "gpu" and eng.async_scheduling else 1)
    seq_blocks = blocks_per_request(arch, eng.max_model_len, block, in_flight)
    out.max_concurrency = num_blocks / seq_blocks if seq_blocks else 0.0
    tokens = num_blocks * block if layout.uniform else int(out.max_concurrency * eng.max_model_len)
    out.tiers.append(Tier(name="gpu", bytes=pool, tokens=tokens, blocks=num_blocks))
    out.sequence_bytes = sequence_bytes(arch, eng.max_model_len, layer_bytes, block, in_flight)
    # One max-length sequence must fit in the pool minus the null block vLLM's BlockPool holds back
    # (check_enough_kv_cache_memory), or vLLM refuses to start.
    usable_pool = pool - block_bytes
    if pool > 0 and out.sequence_bytes > usable_pool:
        if suggest_fixes:
            problem = _max_len_problem(spec, arch, out, layer_bytes, usable_pool, in_flight)
        else:
            problem = Problem("spec.engine.maxModelLen", "one sequence does not fit the engine pool")
        out.problems.append(problem)
    per_token_all_ranks = out.kv_bytes_per_token
    _offload(spec, out, per_token_all_ranks)
    if out.problems:
        out.verdict = "infeasible"
        return out
    if out.max_concurrency < eng.max_num_seqs:
        out.warnings.append(
            f"at maxModelLen the engine pool holds {out.max_concurrency:.2f} sequences, fewer than "
            f"maxNumSeqs {eng.max_num_seqs}: longer requests queue (shorter ones share the pool)"
        )
    out.verdict = "fits-with-offload" if out.offload_backend else "fits"
    _plan_memory(spec, out, pool)
    if out.offload_backend == "lmcache":
        out.lmcache = _lmcache_sidecar(spec, out)
    out.engine_args = flags.engine_args(spec, out)
    out.engine_env = flags.engine_env(spec, out)
    return out


def _max_len_problem(
    spec: InferenceClusterSpec, arch: Architecture, plan: Plan, layer_bytes: int, pool: int, in_flight: int
) -> Problem:
    """vLLM's own start-up refusal, predicted, with fixes that each verifiably make the plan fit."""
    eng, kv = spec.engine, spec.kv_cache
    block = plan.block_size
    candidates: list[Fix] = []
    if kv.dtype not in {"fp8", "fp8_e4m3", "fp8_e5m2"}:
        candidates.append(
            Fix(
                "spec.kvCache.dtype",
                "fp8",
                "use spec.kvCache.dtype fp8 (halves bytes per token)",
                {"kvCache": {"dtype": "fp8"}},
            )
        )
    if eng.device == "gpu" and kv.tiers.gpu.size is None:
        for util in (0.92, 0.95):
            if util > kv.tiers.gpu.memory_utilization:
                candidates.append(
                    Fix(
                        "spec.kvCache.tiers.gpu.memoryUtilization",
                        util,
                        f"raise spec.kvCache.tiers.gpu.memoryUtilization to {util}",
                        {"kvCache": {"tiers": {"gpu": {"memoryUtilization": util}}}},
                    )
                )
    if eng.device == "gpu" and arch.attention != "mla":
        tp = eng.tensor_parallel_size * 2
        while tp <= 16 and arch.num_attention_heads % tp == 0:
            candidates.append(
                Fix(
                    "spec.engine.tensorParallelSize",
                    tp,
                    f"raise spec.engine.tensorParallelSize to {tp} (shards KV heads)",
                    {"engine": {"tensorParallelSize": tp}},
                )
            )
            tp *= 2
    if eng.device == "cpu":
        need = -(-plan.sequence_bytes // GIB)
        candidates.append(
            Fix(
                "spec.kvCache.tiers.gpu.size",
                f"{need}Gi",
                f"set spec.kvCache.tiers.gpu.size to at least {need}Gi",
                {"kvCache": {"tiers": {"gpu": {"size": f"{need}Gi"}}}},
            )
        )
    fixes: list[str] = []
    taken: set[str] = set()
    for fix in candidates:
        # The smallest working value of each knob only: candidates come in increasing order.
        if fix.field in taken:
            continue
        if plan_fits(_merged(spec, fix.change)):
            fixes.append(fix.text)
            taken.add(fix.field)
    longest = longest_sequence(arch, pool, layer_bytes, block, eng.max_model_len, in_flight)
    if longest >= block:
        fixes.append(f"lower spec.engine.maxModelLen to {_fmt_int(longest)}")
    return Problem(
        "spec.engine.maxModelLen",
        f"maxModelLen {_fmt_int(eng.max_model_len)} needs {gib(plan.sequence_bytes)} of KV per sequence but the "
        f"engine pool holds {gib(pool)} per {'GPU' if eng.device == 'gpu' else 'engine'} "
        "(vLLM refuses to start; offload tiers cannot hold a running sequence)",
        tuple(fixes),
    )


def _merged(spec: InferenceClusterSpec, change: dict[str, Any]) -> InferenceClusterSpec:
    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) else v
        return out

    return InferenceClusterSpec.model_validate(merge(spec.wire(), change))


def plan_fits(spec: InferenceClusterSpec) -> bool:
    """Whether a spec plans feasibly, without suggesting fixes (used to verify each suggested fix)."""
    return plan(spec, suggest_fixes=False).feasible
