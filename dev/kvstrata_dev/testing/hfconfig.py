"""Complete a planner catalog entry into a config.json that vLLM's ModelConfig can read.

The catalog keeps only the keys the planner reads; vLLM also needs the architecture class to pick its model
implementation (MLA detection depends on it) and a dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
PLANNER_ONLY_KEYS = ("params_billions", "weight_bytes_per_param")


def hf_config_for_vllm(entry: Mapping[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    cfg = {k: v for k, v in entry.items() if k not in PLANNER_ONLY_KEYS}
    model_type = cfg.get("model_type")
    if "architectures" not in cfg:
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"no vLLM architecture known for model_type {model_type!r}; add it to ARCHITECTURES"
            )
        cfg["architectures"] = [ARCHITECTURES[model_type]]
    cfg.setdefault("torch_dtype", dtype)
    return cfg
