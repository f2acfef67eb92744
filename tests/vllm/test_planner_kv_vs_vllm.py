"""The planner's KV bytes per token equal vLLM 0.32.0's own KV-cache specs, model by model.

vLLM's side comes from the probe: its ModelConfig reads each config.json (head counts per TP rank, head
size, MLA, layers, sliding windows) and its FullAttentionSpec / SlidingWindowSpec / MLAAttentionSpec give
page_size_bytes / block_size per layer. Nothing on vLLM's side is re-derived here.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.catalog import CATALOG
from kvstrata.planner.kv import kv_bytes_per_token, layer_bytes_per_token
from kvstrata_dev.testing.hfconfig import hf_config_for_vllm
from kvstrata_dev.testing.vllm_probe_client import kv_spec_case, vllm_kv_specs

# Configs the catalog does not cover: plain MHA (the tiny test model's shape) and a Mistral-7B-v0.1-style
# model where every layer slides (no layer_types), the case vLLM handles through CacheConfig.
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    "synthetic/tiny-mha": {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "hidden_size": 512,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "vocab_size": 4096,
    },
    "synthetic/mistral-7b-v0.1-sliding": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "vocab_size": 32000,
    },
}

KV_DTYPES = ("auto", "fp8", "fp8_e5m2", "float16")
TP_SIZES = (1, 2, 8, 16)
BLOCK_SIZE = 16


def hf_config(model_id: str) -> dict[str, Any]:
    return hf_config_for_vllm(CATALOG.get(model_id) or EXTRA_CONFIGS[model_id])


MODELS = sorted(CATALOG) + sorted(EXTRA_CONFIGS)
CASES = list(itertools.product(MODELS, KV_DTYPES, TP_SIZES))


@pytest.fixture(scope="module")
def vllm_specs() -> dict[tuple[str, str, int], dict[str, Any]]:
    # One probe run for every case: vLLM's import dominates the cost.
    results = vllm_kv_specs(
        [kv_spec_case(hf_config(m), kv, BLOCK_SIZE, tensor_parallel=tp) for m, kv, tp in CASES]
    )
    return dict(zip(CASES, results, strict=True))


def test_matrix_covers_every_attention_kind() -> None:
    kinds = {architecture_from_hf_config(hf_config(m)).attention for m in MODELS}
    assert kinds == {"mha", "gqa", "mla"}
    assert any(architecture_from_hf_config(hf_config(m)).sliding_window for m in MODELS)


@pytest.mark.parametrize(("model_id", "kv_dtype", "tp"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_bytes_per_token_equal_vllm(
    vllm_specs: dict[tuple[str, str, int], dict[str, Any]], model_id: str, kv_dtype: str, tp: int
) -> None:
    got = vllm_specs[(model_id, kv_dtype, tp)]
    assert got["ok"], got.get("error")
    arch = architecture_from_hf_config(hf_config(model_id))
    planner = kv_bytes_per_token(arch, kv_dtype, "bfloat16", tp)
    per_layer = layer_bytes_per_token(arch, kv_dtype, "bfloat16", tp)
    assert (planner, arch.num_layers) == (got["bytes_per_token"], got["num_layers"]), (
        f"{model_id} kv={kv_dtype} tp={tp}: planner {planner} B/token over {arch.num_layers} layers, "
        f"vLLM {got['bytes_per_token']} over {got['num_layers']} "
        f"(kv heads/rank {got['num_kv_heads']}, head size {got['head_size']}, mla {got['use_mla']})"
    )
    assert set(got["bytes_per_token_per_layer"]) == {per_layer}
    assert (arch.attention == "mla") == got["use_mla"]


@pytest.mark.parametrize("model_id", MODELS)
def test_sliding_window_layers_equal_vllm(
    vllm_specs: dict[tuple[str, str, int], dict[str, Any]], model_id: str
) -> None:
    """The planner caps what sliding layers pin per sequence; it must agree on which layers slide."""
    got = vllm_specs[(model_id, "auto", 1)]
    assert got["ok"], got.get("error")
    arch = architecture_from_hf_config(hf_config(model_id))
    vllm_windows = [w for w in got["sliding_windows"] if w is not None]
    planner_layers = arch.sliding_window_layers if arch.sliding_window else 0
    assert planner_layers == len(vllm_windows)
    assert set(vllm_windows) == ({arch.sliding_window} if vllm_windows else set())
