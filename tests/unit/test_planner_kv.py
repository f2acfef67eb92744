"""KV arithmetic against published, hand-computed figures."""

from __future__ import annotations

import pytest

from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.catalog import CATALOG, lookup
from kvstrata.planner.kv import kv_bytes_per_token, longest_sequence, sequence_bytes, tokens_in

GIB = 1 << 30


def arch(model_id: str):
    entry = lookup(model_id)
    assert entry is not None, model_id
    return architecture_from_hf_config(entry)


@pytest.mark.parametrize(
    ("model_id", "expected"),
    [
        # 2 (K and V) · layers · kv_heads · head_dim · 2 bytes
        ("meta-llama/Llama-3.1-8B", 2 * 32 * 8 * 128 * 2),  # 131,072
        ("meta-llama/Llama-3.1-70B", 2 * 80 * 8 * 128 * 2),  # 327,680
        ("meta-llama/Llama-3.1-405B", 2 * 126 * 8 * 128 * 2),  # 516,096
        # MLA: layers · (kv_lora_rank + qk_rope_head_dim) · 2 bytes
        ("deepseek-ai/DeepSeek-V3", 61 * (512 + 64) * 2),  # 70,272
        ("Qwen/Qwen2.5-7B-Instruct", 2 * 28 * 4 * 128 * 2),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", 2 * 32 * 8 * 128 * 2),
    ],
)
def test_bf16_bytes_per_token_match_published_figures(model_id: str, expected: int) -> None:
    assert kv_bytes_per_token(arch(model_id)) == expected


def test_published_headline_numbers() -> None:
    assert kv_bytes_per_token(arch("meta-llama/Llama-3.1-8B")) == 131_072
    assert kv_bytes_per_token(arch("meta-llama/Llama-3.1-70B")) == 327_680
    assert kv_bytes_per_token(arch("meta-llama/Llama-3.1-405B")) == 516_096
    assert kv_bytes_per_token(arch("deepseek-ai/DeepSeek-V3")) == 70_272
    # 128K context on Llama 3.1 70B is 40 GiB per sequence, not the ~200 GB often quoted.
    assert 40 * GIB == 131_072 * 327_680


@pytest.mark.parametrize("model_id", sorted(CATALOG))
def test_fp8_halves_every_catalog_model(model_id: str) -> None:
    a = arch(model_id)
    assert kv_bytes_per_token(a, "fp8") * 2 == kv_bytes_per_token(a, "auto")
    assert kv_bytes_per_token(a, "fp8_e4m3") == kv_bytes_per_token(a, "fp8")


def test_catalog_has_at_least_twelve_models_of_all_attention_kinds() -> None:
    kinds = {architecture_from_hf_config(c).attention for c in CATALOG.values()}
    assert len(CATALOG) >= 12
    assert kinds == {"mha", "gqa", "mla"} or kinds >= {"gqa", "mla"}


def test_tensor_parallel_shards_kv_heads_and_replicates_past_the_head_count() -> None:
    a = arch("meta-llama/Llama-3.1-70B")  # 8 KV heads
    assert kv_bytes_per_token(a, tensor_parallel=4) == 327_680 // 4
    assert kv_bytes_per_token(a, tensor_parallel=8) == 327_680 // 8
    # TP 16 > 8 heads: each rank keeps one whole head (replicated), so per-rank bytes stop shrinking.
    assert kv_bytes_per_token(a, tensor_parallel=16) == 327_680 // 8


def test_mla_is_replicated_on_every_rank() -> None:
    a = arch("deepseek-ai/DeepSeek-V3")
    assert kv_bytes_per_token(a, tensor_parallel=8) == 70_272


def test_tokens_in_counts_whole_blocks_only() -> None:
    per_token = 8192  # the tiny demo model
    assert tokens_in(1 << 30, per_token, 32) == (1 << 30) // (per_token * 32) * 32
    assert tokens_in(per_token * 32 - 1, per_token, 32) == 0
    assert tokens_in(0, per_token, 32) == 0


def test_sliding_window_layers_only_pin_the_window() -> None:
    a = arch("google/gemma-2-9b-it")  # 42 layers, 21 of them sliding with a 4096 window
    layer = kv_bytes_per_token(a) // a.num_layers
    in_flight = 2048
    full = sequence_bytes(a, 8192, layer, 16, in_flight)
    assert a.sliding_window_layers == 21
    assert full < 8192 * kv_bytes_per_token(a)
    # Sliding layers keep window - 1 + in-flight tokens (capped at the sequence), plus one block.
    sliding_blocks = -(-min(4096 - 1 + in_flight, 8192) // 16) + 1
    assert full == 21 * 8192 * layer + 21 * sliding_blocks * 16 * layer


def test_longest_sequence_is_the_largest_that_fits() -> None:
    a = arch("meta-llama/Llama-3.1-8B")
    layer = 131_072 // 32
    pool = 10 * GIB
    longest = longest_sequence(a, pool, layer, 16, 131_072, 8192)
    assert sequence_bytes(a, longest, layer, 16, 8192) <= pool
    assert sequence_bytes(a, longest + 16, layer, 16, 8192) > pool


def test_config_json_without_head_dim_uses_hidden_over_heads() -> None:
    a = architecture_from_hf_config(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "vocab_size": 100}
    )
    assert a.head_dim == 64 and a.num_kv_heads == 4 and a.attention == "mha"
