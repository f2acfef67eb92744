"""A tiny Llama-shaped model directory that real vLLM can serve without any download.

vLLM needs only a config.json and a tokenizer to boot with ``--load-format dummy`` (random weights),
so tests and benchmarks get a real engine with a real KV cache in about a minute on a laptop CPU.
The directory is written deterministically and idempotently: a stamp file records the parameters and
a second call with the same parameters does nothing.

CLI: ``python -m kvstrata_dev.testing.tinymodel DEST [--num-layers N ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP_FILE = "kvstrata-tiny-model.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# A deliberately plain template: enough for /v1/chat/completions to render messages into a prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SUPPORTED_ARCHS = ("llama",)
# Corpus size that always yields more merges than the vocabularies tests ask for (up to ~16k).
_CORPUS_WORDS = 60_000


@dataclass(frozen=True)
class TinyModelParams:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    seed: int

    def validate(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        # 256 byte-level symbols + the special tokens are the floor of a byte-level BPE vocabulary.
        if not 512 <= self.vocab_size <= 16_384:
            raise ValueError(f"vocab_size must be within 512..16384, got {self.vocab_size}")
        if self.max_position_embeddings < 64:
            raise ValueError(f"max_position_embeddings must be >= 64, got {self.max_position_embeddings}")


def default_tiny_model_dir() -> Path:
    """``$KVSTRATA_CACHE/models/tiny-llama`` (``KVSTRATA_CACHE`` defaults to ``~/.cache/kvstrata``)."""
    return kvstrata_cache() / "models" / "tiny-llama"


def kvstrata_cache() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE") or Path.home() / ".cache" / "kvstrata").expanduser()


def ensure_tiny_model(
    dest: Path,
    *,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 512,
    num_heads: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 64,
    vocab_size: int = 4096,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the model directory at ``dest`` unless it already holds one with the same parameters."""
    params = TinyModelParams(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
    params.validate()
    dest = Path(dest)
    if _stamp_matches(dest, params):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build next to dest and swap in, so concurrent callers never see a half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _write_model_dir(tmp, params)
        if _stamp_matches(dest, params):  # another process won the race
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def _stamp_matches(dest: Path, params: TinyModelParams) -> bool:
    try:
        return json.loads((dest / STAMP_FILE).read_text()) == asdict(params)
    except (OSError, ValueError):
        return False


def _write_model_dir(root: Path, params: TinyModelParams) -> None:
    files = {
        "config.json": hf_config(params),
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False},
        "tokenizer_config.json": tokenizer_config(params),
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    }
    for name, body in files.items():
        _write_json(root / name, body)
    (root / "tokenizer.json").write_text(train_tokenizer_json(params.vocab_size, params.seed))
    # Written last: its presence means the directory is complete.
    _write_json(root / STAMP_FILE, asdict(params))


def _write_json(path: Path, body: dict) -> None:
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def hf_config(params: TinyModelParams) -> dict:
    """A Llama config.json in the shape published checkpoints use (rope_theta, rope_scaling)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": params.hidden_size,
        "intermediate_size": params.hidden_size * 2,
        "num_hidden_layers": params.num_layers,
        "num_attention_heads": params.num_heads,
        "num_key_value_heads": params.num_kv_heads,
        "head_dim": params.head_dim,
        "vocab_size": params.vocab_size,
        "max_position_embeddings": params.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def tokenizer_config(params: TinyModelParams) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": params.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _corpus(seed: int) -> list[str]:
    """Pseudo-English from a seeded RNG: syllable words, digits and punctuation, so the BPE has
    plenty of distinct pairs to merge and prompts in tests tokenize into many short tokens."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "ch",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "n", "r", "s", "t", "l", "m", "ng", "ck"]
    words = []
    for _ in range(_CORPUS_WORDS):
        word = "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3))
        )
        if rng.random() < 0.1:
            word = word.capitalize()
        if rng.random() < 0.05:
            word = str(rng.randint(0, 9999))
        words.append(word + rng.choice([" ", " ", " ", " ", ", ", ". ", "\n"]))
    text = "".join(words)
    return [text[i : i + 1000] for i in range(0, len(text), 1000)]


def train_tokenizer_json(vocab_size: int, seed: int) -> str:
    """A byte-level BPE tokenizer.json with exactly ``vocab_size`` entries (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # Prepend <s> like Llama tokenizers do, so prompts start with the model's BOS token.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"tokenizer training produced {got} tokens, wanted {vocab_size}")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, wanted {token_id}")
    return tok.to_str(pretty=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvstrata_dev.testing.tinymodel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("dest", nargs="?", type=Path, default=None, help="target directory (default: cache)")
    defaults = TinyModelParams("llama", 4, 512, 8, 8, 64, 4096, 4096, 0)
    for field, value in asdict(defaults).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    dest = args.dest or default_tiny_model_dir()
    kwargs = {field: getattr(args, field) for field in asdict(defaults)}
    try:
        path = ensure_tiny_model(dest, **kwargs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
