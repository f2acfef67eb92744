"""KV-cache arithmetic, mirroring vLLM 0.32's KV cache specs (v1/kv_cache_interface.py)."""

from __future__ import annotations

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


def sequence_bytes(arch: Architecture, seq_len: int, layer_bytes: int, block_size: int) -> int:
    """KV bytes one sequence of `seq_len` tokens pins on one rank; sliding-window layers keep only the window."""
    blocks_full = -(-seq_len // block_size)
    sliding = arch.sliding_window_layers if arch.sliding_window else 0
    full_layers = arch.num_layers - sliding
    total = full_layers * blocks_full * block_size * layer_bytes
    if sliding:
        assert arch.sliding_window is not None
        # vLLM keeps the window plus the block being written for sliding layers.
        window_blocks = min(blocks_full, -(-arch.sliding_window // block_size) + 1)
        total += sliding * window_blocks * block_size * layer_bytes
    return total


def longest_sequence(
    arch: Architecture, pool_bytes: int, layer_bytes: int, block_size: int, limit: int
) -> int:
    """Largest seq_len (multiple of block_size, ≤ limit) whose KV fits in pool_bytes: what vLLM suggests."""
    lo, hi = 0, limit // block_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sequence_bytes(arch, mid * block_size, layer_bytes, block_size) <= pool_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size
