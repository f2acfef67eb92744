"""The tiny model directory: deterministic, idempotent, exact vocabulary, loadable by tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvstrata_dev.testing.tinymodel import STAMP_FILE, ensure_tiny_model, main


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = ensure_tiny_model(tmp_path / "a", vocab_size=1024)
    b = ensure_tiny_model(tmp_path / "b", vocab_size=1024)
    assert _tree(a) == _tree(b)
    mtime = (a / "tokenizer.json").stat().st_mtime_ns
    ensure_tiny_model(tmp_path / "a", vocab_size=1024)
    assert (a / "tokenizer.json").stat().st_mtime_ns == mtime


def test_parameters_change_rewrites(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    ensure_tiny_model(dest, vocab_size=1024, num_layers=2)
    ensure_tiny_model(dest, vocab_size=2048, num_layers=3, num_kv_heads=2)
    cfg = json.loads((dest / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (3, 2, 2048)
    assert json.loads((dest / STAMP_FILE).read_text())["vocab_size"] == 2048
    assert Tokenizer.from_file(str(dest / "tokenizer.json")).get_vocab_size() == 2048


def test_tokenizer_matches_config(tmp_path: Path) -> None:
    dest = ensure_tiny_model(tmp_path / "m")
    cfg = json.loads((dest / "config.json").read_text())
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"] == 4096
    assert tok.token_to_id("<s>") == cfg["bos_token_id"]
    assert tok.token_to_id("</s>") == cfg["eos_token_id"]
    text = "The quick brown fox, 42 times."
    enc = tok.encode(text)
    assert enc.ids[0] == cfg["bos_token_id"]
    assert tok.decode(enc.ids) == text
    tcfg = json.loads((dest / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "add_generation_prompt" in tcfg["chat_template"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 8, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"arch": "gpt2"}, "unsupported arch"),
    ],
)
def test_bad_parameters_are_clear_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ensure_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "m"), "--vocab-size", "1024"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert main([str(tmp_path / "n"), "--num-kv-heads", "3"]) == 2
    assert "num_kv_heads" in capsys.readouterr().err
