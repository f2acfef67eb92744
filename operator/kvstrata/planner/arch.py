"""Model architecture → the numbers KV sizing needs, from the catalog, a config.json, or spec overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstrata.api.models import ArchitectureOverrides, ModelSpec
from kvstrata.planner import catalog
from kvstrata.planner.problem import Problem

# One type for every source: the API's override model already names exactly what sizing needs.
Architecture = ArchitectureOverrides


class UnknownModel(ValueError):
    """The model is neither in the catalog nor described by spec.model.architecture; carries the
    planner's Problem so the plan reports it as is."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message())
        self.problem = problem


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None, 0
    if layer_types := cfg.get("layer_types"):
        return int(window), sum(1 for t in layer_types if t == "sliding_attention")
    model_type = cfg.get("model_type", "")
    if model_type == "gemma2":
        # Gemma 2 alternates: even layers slide, odd layers see the whole context.
        return int(window), (layers + 1) // 2
    if model_type == "gemma3" and (pattern := cfg.get("sliding_window_pattern")):
        return int(window), layers - layers // int(pattern)
    return int(window), layers


def _estimate_params_billions(cfg: dict[str, Any], layers: int, hidden: int, kv_dim: int) -> float:
    """Rough dense parameter count for configs that do not state it (weights sizing only)."""
    vocab = int(cfg.get("vocab_size", 32000))
    inter = int(cfg.get("intermediate_size", 4 * hidden))
    experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 1)) or 1)
    attn = hidden * hidden * 2 + hidden * kv_dim * 2
    mlp = 3 * hidden * inter * experts
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return (embed + layers * (attn + mlp)) / 1e9


def architecture_from_hf_config(cfg: dict[str, Any]) -> Architecture:
    """Read an HF config.json dict the way vLLM's ModelConfig does for KV sizing."""
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    window, sliding = _sliding_layers(cfg, layers)
    common: dict[str, Any] = {
        "num_layers": layers,
        "num_attention_heads": heads,
        "hidden_size": hidden,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "vocab_size": int(cfg.get("vocab_size", 32000)),
        "weight_bytes_per_param": float(cfg.get("weight_bytes_per_param", 2.0)),
        "sliding_window": window,
        "sliding_window_layers": sliding,
    }
    if cfg.get("kv_lora_rank"):
        kv_dim = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        params = cfg.get("params_billions") or _estimate_params_billions(cfg, layers, hidden, kv_dim)
        return Architecture(
            attention="mla",
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            params_billions=float(params),
            **common,
        )
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    params = cfg.get("params_billions") or _estimate_params_billions(cfg, layers, hidden, kv_heads * head_dim)
    return Architecture(
        attention="mha" if kv_heads == heads else "gqa",
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        params_billions=float(params),
        **common,
    )


def load_hf_config(path: Path) -> dict[str, Any]:
    """config.json from a file or a model directory."""
    file = path / "config.json" if path.is_dir() else path
    config: dict[str, Any] = json.loads(file.read_text())
    return config


def resolve_architecture(model: ModelSpec) -> Architecture:
    """Overrides win over the catalog: a user who spells out the architecture means it."""
    if model.architecture is not None:
        return model.architecture
    entry = catalog.lookup(model.name)
    if entry is None and model.source.startswith("hf://"):
        entry = catalog.lookup(model.source.removeprefix("hf://"))
    if entry is None:
        known = ", ".join(sorted(catalog.CATALOG)[:6])
        raise UnknownModel(
            Problem(
                "spec.model.name",
                f"{model.name!r} is not in the planner's catalog; set spec.model.architecture "
                f"(numLayers, numAttentionHeads, numKvHeads, headDim, hiddenSize, paramsBillions from its "
                f"config.json) or use a catalog model such as {known}",
            )
        )
    return architecture_from_hf_config(entry)
