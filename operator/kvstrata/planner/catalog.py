"""Published config.json values of popular open models, so a manifest can name a model and get a plan.

Values are copied from each model's config.json on its hub page (only the keys the planner reads), plus
`params_billions` and the weights' bytes per parameter from the model card. The planner reads these through
`architecture_from_hf_config`, exactly as it reads a user's own config.json.
"""

from __future__ import annotations

from typing import Any


def _llama(
    layers: int, heads: int, kv: int, hidden: int, head_dim: int, params: float, **extra: Any
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "params_billions": params,
        **extra,
    }


def _qwen(
    model_type: str, layers: int, heads: int, kv: int, hidden: int, params: float, max_pos: int, vocab: int
) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
        "head_dim": 128 if model_type == "qwen3" or model_type == "qwen3_moe" else hidden // heads,
        "max_position_embeddings": max_pos,
        "vocab_size": vocab,
        "sliding_window": max_pos,
        "use_sliding_window": False,
        "params_billions": params,
    }


CATALOG: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": _llama(32, 32, 8, 4096, 128, 8.03),
    "meta-llama/Llama-3.1-70B": _llama(80, 64, 8, 8192, 128, 70.6),
    "meta-llama/Llama-3.1-405B": _llama(126, 128, 8, 16384, 128, 405.9),
    "meta-llama/Llama-3.2-1B": _llama(16, 32, 8, 2048, 64, 1.24),
    "meta-llama/Llama-3.2-3B": _llama(28, 24, 8, 3072, 128, 3.21),
    "meta-llama/Llama-3.3-70B-Instruct": _llama(80, 64, 8, 8192, 128, 70.6),
    "Qwen/Qwen2.5-0.5B-Instruct": _qwen("qwen2", 24, 14, 2, 896, 0.49, 32768, 151936),
    "Qwen/Qwen2.5-7B-Instruct": _qwen("qwen2", 28, 28, 4, 3584, 7.62, 32768, 152064),
    "Qwen/Qwen2.5-72B-Instruct": _qwen("qwen2", 80, 64, 8, 8192, 72.7, 32768, 152064),
    "Qwen/Qwen3-8B": _qwen("qwen3", 36, 32, 8, 4096, 8.19, 40960, 151936),
    "Qwen/Qwen3-32B": _qwen("qwen3", 64, 64, 8, 5120, 32.8, 40960, 151936),
    "Qwen/Qwen3-30B-A3B": _qwen("qwen3_moe", 48, 32, 4, 2048, 30.5, 40960, 151936),
    "mistralai/Mistral-7B-Instruct-v0.3": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "vocab_size": 32768,
        "params_billions": 7.25,
    },
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "vocab_size": 32000,
        "params_billions": 46.7,
    },
    "google/gemma-2-9b-it": {
        "model_type": "gemma2",
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 3584,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "vocab_size": 256000,
        "params_billions": 9.24,
    },
    "google/gemma-2-27b-it": {
        "model_type": "gemma2",
        "num_hidden_layers": 46,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "hidden_size": 4608,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "vocab_size": 256000,
        "params_billions": 27.2,
    },
    "deepseek-ai/DeepSeek-V3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "vocab_size": 129280,
        "params_billions": 671.0,
        "weight_bytes_per_param": 1.0,
    },
    "deepseek-ai/DeepSeek-V2-Lite": {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_size": 2048,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "vocab_size": 102400,
        "params_billions": 15.7,
    },
}

# Instruct and base variants share an architecture: accept either id.
ALIASES: dict[str, str] = {
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-405B-Instruct": "meta-llama/Llama-3.1-405B",
    "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B-Instruct": "meta-llama/Llama-3.2-3B",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1": "deepseek-ai/DeepSeek-V3",
}


def lookup(model_id: str) -> dict[str, Any] | None:
    """The catalog entry for a model id (case-insensitive), or None."""
    wanted = ALIASES.get(model_id, model_id).lower()
    for key, value in CATALOG.items():
        if key.lower() == wanted:
            return value
    for alias, key in ALIASES.items():
        if alias.lower() == wanted:
            return CATALOG[key]
    return None
