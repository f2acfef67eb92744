"""The InferenceCluster API: pydantic v2 models are the single source of truth.

The CRD in `crds/` is generated from these classes (`make crds`); descriptions, defaults, bounds, enums and
CEL rules live here, next to the fields they constrain.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from kvstrata.api.quantity import Quantity
from kvstrata.api.router_config import (
    DATA_PLANE_HELP,
    DEFAULT_DATA_PLANE,
    DEFAULT_HASH_ALGO,
    DEFAULT_POLICY,
    ENGINE_PORT,
    QUEUE_WEIGHT,
    ROUTER_PORT,
    WEIGHT_KV_USAGE,
    WEIGHT_LOAD,
    WEIGHT_PREFILL,
    WEIGHT_PREFIX,
    DataPlane,
    HashAlgo,
)
from kvstrata.api.router_config import Policy as RoutingPolicy

GROUP = "kvstrata.io"
VERSION = "v1alpha1"
KIND = "InferenceCluster"
PLURAL = "inferenceclusters"
SINGULAR = "inferencecluster"
SHORT_NAMES = ["ic"]
API_VERSION = f"{GROUP}/{VERSION}"

Attention = Literal["mha", "gqa", "mla"]
Device = Literal["gpu", "cpu"]
KvDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
OffloadBackend = Literal["auto", "native", "lmcache"]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One `x-kubernetes-validations` entry; fieldPath makes kubectl name the offending field."""
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class Wire(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------- model
class ArchitectureOverrides(Wire):
    """Architecture values from the model's config.json; set them when the model is not in the catalog."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.attention != 'mla' || (has(self.kvLoraRank) && has(self.qkRopeHeadDim))",
                    "attention mla needs kvLoraRank and qkRopeHeadDim (config.json kv_lora_rank, qk_rope_head_dim)",
                ),
                cel(
                    "self.attention == 'mla' || (has(self.numKvHeads) && has(self.headDim))",
                    "attention mha/gqa needs numKvHeads and headDim (config.json num_key_value_heads, head_dim)",
                ),
                cel(
                    "!has(self.numKvHeads) || !has(self.numAttentionHeads) || self.numKvHeads <= self.numAttentionHeads",
                    "numKvHeads cannot exceed numAttentionHeads",
                    ".numKvHeads",
                ),
            ]
        }
    )

    attention: Attention = Field(description="mha, gqa (grouped KV heads) or mla (DeepSeek latent attention)")
    num_layers: int = Field(ge=1, le=1024, description="config.json num_hidden_layers")
    num_attention_heads: int = Field(ge=1, le=1024, description="config.json num_attention_heads")
    num_kv_heads: int | None = Field(None, ge=1, le=1024, description="config.json num_key_value_heads")
    head_dim: int | None = Field(None, ge=1, le=1024, description="config.json head_dim (or hidden/heads)")
    hidden_size: int = Field(ge=1, le=1 << 20, description="config.json hidden_size")
    kv_lora_rank: int | None = Field(None, ge=1, le=8192, description="MLA: config.json kv_lora_rank")
    qk_rope_head_dim: int | None = Field(None, ge=1, le=1024, description="MLA: config.json qk_rope_head_dim")
    sliding_window: int | None = Field(
        None, ge=1, description="Window of the sliding-window layers, in tokens"
    )
    sliding_window_layers: int = Field(0, ge=0, description="How many layers use the sliding window")
    max_position_embeddings: int | None = Field(None, ge=1, description="Longest context the model supports")
    vocab_size: int = Field(32000, ge=1)
    params_billions: float = Field(gt=0, le=10000, description="Parameter count in billions (sizes weights)")
    weight_bytes_per_param: float = Field(2.0, gt=0, le=4, description="2 for bf16/fp16, 1 for fp8 weights")

    @model_validator(mode="after")
    def _same_rules_as_cel(self) -> ArchitectureOverrides:
        # The CRD's CEL rules, repeated so that `kvstrata plan` and the webhook refuse the same manifests.
        if self.attention == "mla" and (self.kv_lora_rank is None or self.qk_rope_head_dim is None):
            raise ValueError(
                "attention mla needs kvLoraRank and qkRopeHeadDim (config.json kv_lora_rank, qk_rope_head_dim)"
            )
        if self.attention != "mla" and (self.num_kv_heads is None or self.head_dim is None):
            raise ValueError(
                "attention mha/gqa needs numKvHeads and headDim (config.json num_key_value_heads, head_dim)"
            )
        if self.num_kv_heads is not None and self.num_kv_heads > self.num_attention_heads:
            raise ValueError("numKvHeads cannot exceed numAttentionHeads")
        return self


class ModelSpec(Wire):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.source.startsWith('hf://') || self.source.startsWith('pvc://')",
                    "source must be hf://ORG/NAME or pvc://CLAIM/PATH",
                    ".source",
                )
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=253,
        description="Model id, e.g. meta-llama/Llama-3.1-8B-Instruct; looked up in the planner's catalog",
    )
    source: str = Field(
        min_length=6,
        max_length=1024,
        pattern=r"^(hf://[A-Za-z0-9._-]+/[A-Za-z0-9._-]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/]+)*/?)$",
        description="Where weights come from: hf://ORG/NAME (Hugging Face cache) or pvc://CLAIM/PATH",
    )
    served_name: str | None = Field(None, min_length=1, max_length=253, description="Name clients send")
    architecture: ArchitectureOverrides | None = Field(None, description="Overrides the catalog entry")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="Weights/activation dtype; float32 for CPU engines whose CPU has no native bfloat16 "
        "(no AVX512-BF16 or AMX), where vLLM emulates bfloat16 matmuls several times slower",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="dummy = random weights (tests and demos without a model download)"
    )


# --------------------------------------------------------------------------------------------- engine
class EnvVar(Wire):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str = Field("", max_length=32768)


class Resources(Wire):
    """Extra container resources; the planner sets memory and GPUs, these add to or override them."""

    cpu: Quantity | None = Field(None, description="CPU request and limit, e.g. 8")
    memory: Quantity | None = Field(None, description="Memory request/limit; default: what the tiers imply")


# vLLM seeds the first block's parent hash from PYTHONHASHSEED when it is set: the engines' block hashes
# would then differ from the router's (router/hashing.py), and prefix routing would never match.
_HASHSEED_MESSAGE = (
    "engine.env cannot set PYTHONHASHSEED: vLLM seeds its block hashes with it, and the router's "
    "hashes would no longer match the engines'"
)


class EngineSpec(Wire):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.device != 'cpu' || self.tensorParallelSize == 1",
                    "device cpu runs one engine process per pod: set tensorParallelSize to 1",
                    ".tensorParallelSize",
                ),
                cel(
                    "!has(self.env) || !self.env.exists(e, e.name == 'PYTHONHASHSEED')",
                    _HASHSEED_MESSAGE,
                    ".env",
                ),
            ]
        }
    )

    image: str = Field("vllm/vllm-openai:v0.32.0", min_length=1, max_length=512, description="Engine image")
    device: Device = Field("gpu", description="gpu (CUDA) or cpu (vLLM's CPU backend)")
    gpu_memory: Quantity = Field("80Gi", description="Memory of one GPU (H100 80Gi, A100 40Gi/80Gi, L4 24Gi)")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs per pod (tensor parallel ranks)")
    max_model_len: int = Field(8192, ge=64, le=10_485_760, description="Longest sequence (prompt + output)")
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Concurrent sequences per engine")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=64,
        le=1_048_576,
        description="Tokens per scheduler step (--max-num-batched-tokens); default 8192 on gpu, 2048 on cpu. "
        "Pinned so sizing does not depend on vLLM's hardware-dependent default",
    )
    async_scheduling: bool = Field(
        True, description="gpu: overlap scheduling with execution (two batches in flight); vLLM's default"
    )
    port: int = Field(ENGINE_PORT, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list, max_length=64, description="Appended to vLLM's flags")
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _no_hash_seed(self) -> EngineSpec:
        # The CRD's CEL rule, repeated so that `kvstrata plan` and the webhook refuse the same manifests.
        if any(var.name == "PYTHONHASHSEED" for var in self.env):
            raise ValueError(_HASHSEED_MESSAGE)
        return self


# ------------------------------------------------------------------------------------------- kv cache
class GpuTier(Wire):
    memory_utilization: float = Field(
        0.9,
        ge=0.05,
        le=0.98,
        description="Share of each GPU's memory vLLM may use (weights + activations + KV)",
    )
    size: Quantity | None = Field(
        None,
        description="Fixed KV pool per engine instead of utilization: --kv-cache-memory-bytes on GPU, "
        "VLLM_CPU_KVCACHE_SPACE (whole GiB) on device cpu",
    )
    num_blocks: int | None = Field(
        None,
        ge=1,
        description="Cap the pool at exactly this many blocks (--num-gpu-blocks-override); must fit size",
    )


class CpuTier(Wire):
    size: Quantity = Field(description="Host DRAM per engine pod for offloaded KV blocks, e.g. 64Gi")


class NvmeTier(Wire):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(oldSelf.storageClassName) || self.storageClassName == oldSelf.storageClassName",
                    "storageClassName is immutable: PVCs cannot move to another class",
                    ".storageClassName",
                )
            ]
        }
    )

    size: Quantity = Field(description="NVMe (PVC) capacity per engine pod for KV blocks, e.g. 500Gi")
    storage_class_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="StorageClass of the PVCs; default: the cluster default",
    )
    retention: Literal["Retain", "Delete"] = Field(
        "Retain", description="Keep the PVCs (warm cache) or delete them when the cluster is deleted"
    )


class Tiers(Wire):
    gpu: GpuTier = Field(
        default_factory=GpuTier, description="The engine's own KV pool (HBM; host RAM on cpu)"
    )
    cpu: CpuTier | None = Field(None, description="Offload tier in host DRAM")
    nvme: NvmeTier | None = Field(None, description="Offload tier on a PVC")


class Offload(Wire):
    backend: OffloadBackend = Field(
        "auto", description="native (vLLM OffloadingConnector), lmcache (LMCache server sidecar) or auto"
    )


class KvCacheSpec(Wire):
    dtype: KvDtype = Field(
        "auto", description="KV cache dtype (--kv-cache-dtype); fp8 halves bytes per token"
    )
    block_size: int | None = Field(
        None, ge=1, le=1024, description="Tokens per KV block; default 16 on gpu, 128 on cpu (multiple of 32)"
    )
    prefix_caching: bool = Field(True, description="Automatic prefix caching (the router depends on it)")
    hash_algo: HashAlgo = Field(
        DEFAULT_HASH_ALGO,
        description="Block hash (--prefix-caching-hash-algo); only algorithms the router reproduces: "
        "vLLM seeds the xxhash variants randomly per engine process",
    )
    tiers: Tiers = Field(default_factory=Tiers)
    offload: Offload = Field(default_factory=Offload)


# --------------------------------------------------------------------------------------------- router
class RouterWeights(Wire):
    prefill: float = Field(
        WEIGHT_PREFILL,
        ge=0,
        le=100,
        description="Weight of the estimated prefill before the first token (uncached prompt tokens + "
        "queued prefill): the cache-aware score",
    )
    prefix: float = Field(
        WEIGHT_PREFIX,
        ge=0,
        le=100,
        description="Weight of the plain cached-prefix share (prefill counts it already)",
    )
    load: float = Field(WEIGHT_LOAD, ge=0, le=100, description="Weight of in-flight/queued request count")
    kv_usage: float = Field(WEIGHT_KV_USAGE, ge=0, le=100, description="Weight of engine KV usage")
    queue: float = Field(
        QUEUE_WEIGHT,
        ge=0,
        le=100,
        description="Queued prefill tokens counted per uncached prompt token; below 1 a request waits "
        "for the engine that holds its prefix rather than recompute it elsewhere",
    )


class RouterTierWeights(Wire):
    """Credit for a cached block by the tier that holds it: the share of its prefill a hit there saves."""

    gpu: float | None = Field(None, ge=0, le=1, description="Engine KV pool hit; default 1")
    cpu: float | None = Field(
        None,
        ge=0,
        le=1,
        description="CPU DRAM tier hit; default 0.99 for device cpu (measured), 0.8 for gpu (assumed: "
        "measure with make bench-tier-credit)",
    )
    nvme: float | None = Field(
        None,
        ge=0,
        le=1,
        description="NVMe (fs) tier hit; default 0.98 for device cpu (measured), 0.5 for gpu (assumed)",
    )


class RouterTimeouts(Wire):
    """The router's deadlines toward engines (docs/router.md, "Timeouts and ejection")."""

    connect_seconds: float = Field(3.0, gt=0, le=300, description="Connecting to an engine")
    first_byte_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Streamed requests: the engine's first streamed byte (queue + prefill); past it the "
        "request is retried on another engine",
    )
    stream_idle_seconds: float = Field(
        60.0, gt=0, le=3600, description="Longest pause between two chunks of a started stream"
    )
    response_seconds: float = Field(
        600.0, gt=0, le=86400, description="Non-streamed requests: the whole answer"
    )


class RouterEjection(Wire):
    """Outlier ejection: engines that keep failing leave rotation for a growing time."""

    consecutive_failures: int = Field(
        3,
        ge=1,
        le=1000,
        description="Failures in a row (connect, first-byte timeout, 5xx, scrape) that eject",
    )
    base_seconds: float = Field(
        10.0, gt=0, le=3600, description="First ejection's length; the n-th in a row lasts n times this"
    )
    max_seconds: float = Field(300.0, gt=0, le=86400, description="Longest ejection")


class RouterAdmission(Wire):
    """Requests held in the router while their engine's KV pool has no room (docs/router.md, "Admit")."""

    enabled: bool = Field(
        True,
        description="Hold a request whose engine's KV pool is full of the router's running requests and "
        "send each engine the held request it serves cheapest when room frees (false: every request "
        "goes to the engine's own first-come queue at once)",
    )
    max_hold_seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Longest a request is held before it goes to its engine's queue anyway; default a "
        "third of timeouts.firstByteSeconds",
    )


class RouterSpec(Wire):
    replicas: int = Field(1, ge=0, le=64)
    policy: RoutingPolicy = Field(DEFAULT_POLICY)
    weights: RouterWeights = Field(default_factory=RouterWeights)
    tier_weights: RouterTierWeights = Field(default_factory=RouterTierWeights)
    image: str = Field("ghcr.io/kvstrata/router:0.1.0", min_length=1, max_length=512)
    port: int = Field(ROUTER_PORT, ge=1, le=65535)
    timeouts: RouterTimeouts = Field(default_factory=RouterTimeouts)
    ejection: RouterEjection = Field(default_factory=RouterEjection)
    admission: RouterAdmission = Field(default_factory=RouterAdmission)
    data_plane: DataPlane = Field(DEFAULT_DATA_PLANE, description=DATA_PLANE_HELP)


class InferenceClusterSpec(Wire):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.engine.device != 'cpu' || !has(self.kvCache.blockSize) || self.kvCache.blockSize % 32 == 0",
                    "device cpu needs kvCache.blockSize to be a multiple of 32 (vLLM's CPU attention backend)",
                    ".kvCache.blockSize",
                ),
                # device cpu may have CPU and NVMe tiers: kvstrata ships the CPU platform's block-copy
                # worker (kvstrata.engine.cpu_offload); what stays refused there (offload.backend lmcache,
                # whose wheel ships CUDA ops) is the planner's call, through the webhook.
                cel(
                    "!has(self.model.architecture) || self.model.architecture.attention != 'mla' || "
                    "(!has(self.kvCache.tiers.cpu) && !has(self.kvCache.tiers.nvme))",
                    "MLA models cannot use offload tiers (vLLM's KV connectors do not support MLA): "
                    "remove kvCache.tiers.cpu and kvCache.tiers.nvme",
                    ".kvCache.tiers",
                ),
                cel(
                    "self.engine.device != 'cpu' || !has(self.kvCache.tiers.gpu.size) || "
                    "quantity(string(self.kvCache.tiers.gpu.size)).asInteger() % 1073741824 == 0",
                    "device cpu sizes its KV pool in whole GiB (VLLM_CPU_KVCACHE_SPACE): use e.g. 1Gi or 4Gi",
                    ".kvCache.tiers.gpu.size",
                ),
                cel(
                    "self.engine.device != 'gpu' || self.kvCache.offload.backend != 'lmcache' || "
                    "has(self.kvCache.tiers.cpu) || has(self.kvCache.tiers.nvme)",
                    "offload.backend lmcache needs a cpu or nvme tier to offload to",
                    ".kvCache.offload.backend",
                ),
            ]
        }
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int = Field(1, ge=0, le=1024, description="Engine pods (the scale subresource owns this)")
    kv_cache: KvCacheSpec = Field(default_factory=KvCacheSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)


# --------------------------------------------------------------------------------------------- status
class Condition(Wire):
    """KEP-1623 condition."""

    model_config = ConfigDict(extra="ignore")

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str
    observed_generation: int | None = None


class TierPlan(Wire):
    model_config = ConfigDict(extra="ignore")

    name: Literal["gpu", "cpu", "nvme"]
    bytes: int = Field(description="KV bytes this tier holds per engine pod")
    tokens: int
    blocks: int


class PlanStatus(Wire):
    model_config = ConfigDict(extra="ignore")

    verdict: Literal["fits", "fits-with-offload", "infeasible"]
    kv_bytes_per_token: int = Field(description="All layers, all TP ranks")
    tiers: list[TierPlan] = Field(default_factory=list)
    max_concurrency: float = Field(0.0, description="Sequences of maxModelLen the engine KV pool holds")
    offload_backend: str | None = None
    flags_digest: str = ""
    summary: str = ""


class PodCache(Wire):
    model_config = ConfigDict(extra="ignore")

    pod: str
    ready: bool = False
    hit_rate: float | None = None
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None


class CacheStatus(Wire):
    model_config = ConfigDict(extra="ignore")

    hit_rate: float | None = Field(None, description="Prefix-cache hit rate over the last window (0-1)")
    hit_rate_total: float | None = Field(None, description="Since the pods started (0-1)")
    hit_rate_percent: int | None = Field(None, description="hitRate as a whole percent, for printing")
    gpu_hit_rate: float | None = None
    external_hit_rate: float | None = Field(None, description="Hits through the CPU/NVMe connector tiers")
    cpu_hit_rate: float | None = Field(None, description="Share of prompt tokens loaded from the CPU tier")
    nvme_hit_rate: float | None = Field(None, description="Share of prompt tokens loaded from the NVMe tier")
    # Whole percents per tier, for the printer columns (GPU% + CPU% + NVMe% ~ Hit%, rounding aside).
    gpu_hit_rate_percent: int | None = Field(None, description="gpuHitRate as a whole percent")
    cpu_hit_rate_percent: int | None = Field(None, description="cpuHitRate as a whole percent")
    nvme_hit_rate_percent: int | None = Field(None, description="nvmeHitRate as a whole percent")
    kv_usage: float | None = Field(None, description="Mean KV usage of ready engines (0-1)")
    kv_usage_percent: int | None = None
    tokens_from_cache: int | None = None
    queried_tokens: int | None = None
    pods: list[PodCache] = Field(default_factory=list, max_length=64)
    last_scrape_time: str | None = None


class RouterStatus(Wire):
    model_config = ConfigDict(extra="ignore")

    requests: int | None = None
    affinity_share: float | None = Field(None, description="Share of decisions won by cached-prefix overlap")
    fallbacks: int | None = None


class InferenceClusterStatus(Wire):
    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanStatus | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    ready: str | None = Field(None, description="readyReplicas/replicas, for printing")
    tiers: str | None = Field(None, description="Tier summary for printing, e.g. gpu+cpu+nvme")
    selector: str | None = Field(None, description="Label selector of engine pods (scale subresource)")
    cache: CacheStatus | None = None
    router: RouterStatus | None = None


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None


class InferenceCluster(BaseModel):
    """A whole manifest, as `kubectl apply` would send it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["kvstrata.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceCluster"]
    metadata: ObjectMeta
    spec: InferenceClusterSpec
    status: InferenceClusterStatus | None = None
