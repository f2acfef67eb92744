"""KV-cache arithmetic, mirroring vLLM 0.32's KV cache specs (v1/kv_cache_interface.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.planner.arch import Architecture

_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str = "bfloat16") -> int:
    """`auto` stores KV in the model's dtype, as vLLM does."""
    name = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if name == "auto":
        name = "bfloat16"
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {kv_cache_dtype!r}") from None


def kv_heads_per_rank(arch: Architecture, tensor_parallel: int) -> int:
    """vLLM shards KV heads over TP ranks and replicates them when TP exceeds the head count."""
    assert arch.num_kv_heads is not None
    return max(1, arch.num_kv_heads // tensor_parallel)


def layer_bytes_per_token(
    arch: Architecture, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16", tensor_parallel: int = 1
) -> int:
    """One layer's KV bytes for one token on one TP rank (vLLM's page_size_bytes / block_size)."""
    nbytes = kv_dtype_bytes(kv_cache_dtype, model_dtype)
    if arch.attention == "mla":
        # MLA caches one latent vector (plus the rope key) per token, replicated on every rank.
        assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
        return (arch.kv_lora_rank + arch.qk_rope_head_dim) * nbytes
    assert arch.head_dim is not None
    return 2 * kv_heads_per_rank(arch, tensor_parallel) * arch.head_dim * nbytes


def kv_bytes_per_token(
    arch: Architecture, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16", tensor_parallel: int = 1
) -> int:
    """All layers' KV bytes for one token on one TP rank: what a block of the engine's pool costs per token."""
    return arch.num_layers * layer_bytes_per_token(arch, kv_cache_dtype, model_dtype, tensor_parallel)


def tokens_in(nbytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens a pool of `nbytes` holds: whole blocks only, as vLLM allocates."""
    if nbytes <= 0:
        return 0
    return (nbytes // (bytes_per_token * block_size)) * block_size


@dataclass(frozen=True)
class PoolLayout:
    """How vLLM's hybrid allocator groups layers: one pool block holds `group_size` layers of one group."""

    group_size: int
    full_groups: int
    sliding_groups: int

    @property
    def uniform(self) -> bool:
        return self.full_groups + self.sliding_groups == 1


def _sliding_layers(arch: Architecture) -> int:
    return arch.sliding_window_layers if arch.sliding_window else 0


def pool_layout(arch: Architecture) -> PoolLayout:
    """vLLM 0.32 groups layers by attention type with the smaller type's count as group size, or the larger
    count when the two are within 1.5x (kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size)."""
    sliding = _sliding_layers(arch)
    full = arch.num_layers - sliding
    buckets = [n for n in (full, sliding) if n]
    size = min(buckets)
    if max(buckets) < size * 1.5:
        size = max(buckets)
    return PoolLayout(size, -(-full // size) if full else 0, -(-sliding // size) if sliding else 0)


def _full_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def _sliding_blocks(arch: Architecture, seq_len: int, block_size: int, in_flight: int) -> int:
    """A sliding layer keeps the window and every in-flight token, plus one block for a window that does not
    start on a block boundary (SlidingWindowSpec.max_admission_blocks_per_request)."""
    assert arch.sliding_window is not None
    return -(-min(arch.sliding_window - 1 + in_flight, seq_len) // block_size) + 1


def blocks_per_request(arch: Architecture, seq_len: int, block_size: int, in_flight: int) -> int:
    """Pool blocks one sequence of `seq_len` takes: the divisor of vLLM's 'Maximum concurrency'."""
    layout = pool_layout(arch)
    out = layout.full_groups * _full_blocks(seq_len, block_size)
    if layout.sliding_groups:
        out += layout.sliding_groups * _sliding_blocks(arch, seq_len, block_size, in_flight)
    return out


def sequence_bytes(
    arch: Architecture, seq_len: int, layer_bytes: int, block_size: int, in_flight: int
) -> int:
    """KV bytes one sequence of `seq_len` pins on one rank, summed over layers (vLLM's max_memory_usage_bytes)."""
    sliding = _sliding_layers(arch)
    full = arch.num_layers - sliding
    page = block_size * layer_bytes
    total = full * _full_blocks(seq_len, block_size) * page
    if sliding:
        total += sliding * _sliding_blocks(arch, seq_len, block_size, in_flight) * page
    return total


def longest_sequence(
    arch: Architecture, pool_bytes: int, layer_bytes: int, block_size: int, limit: int, in_flight: int
) -> int:
    """Largest seq_len (multiple of block_size, ≤ limit) whose KV fits in pool_bytes: what vLLM suggests."""
    lo, hi = 0, limit // block_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sequence_bytes(arch, mid * block_size, layer_bytes, block_size, in_flight) <= pool_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size
