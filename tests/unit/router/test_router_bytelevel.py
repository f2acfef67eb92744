"""The native encoder's hand-split pieces (native/src/bytelevel.rs): for byte-level BPE tokenizers that
split by GPT-2's, Llama 3's or Qwen2's regex, ASCII pieces free of added tokens are split by hand
instead of by the tokenizer's pipeline. They must give the ids the engine's tokenizer (the Python
package) gives, on any ASCII text, and every other piece must still go through the pipeline."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_router_incremental import (
    PROVEN,
    gpt2_prefix_space,
    llama3_split,
    qwen2_split,
    tiny_model,
    wordlevel_whitespace_split,
)
from tokenizers import Tokenizer

from kvstrata.router.incremental import IncrementalEncoder, prove
from kvstrata.router.incremental_native import NativeIncrementalEncoder, make_encoder

# Every ASCII character, and more often the ones the GPT-2 regex treats apart: contractions, the space
# before a word, whitespace runs (\v and \f are \s; \x1c-\x1f are not), digits, punctuation runs.
_ASCII = [chr(c) for c in range(128)]
_TRICKY = [" ", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x7f", "'", "'s", "'t"]
_TRICKY += ["'re", "'ve", "'m", "'ll", "'d", "'S", "''", "12", "3", "ab", "Zq", "?!", ".", "-", "_"]


def _random_ascii(rng: random.Random) -> str:
    parts = [
        rng.choice(_TRICKY) if rng.random() < 0.6 else rng.choice(_ASCII) for _ in range(rng.randint(1, 40))
    ]
    return "".join(parts)


def _core(tok: Tokenizer) -> object:
    return NativeIncrementalEncoder(tok, add_special_tokens=False, block_size=4)._core


_FAST = {
    "byte-level-bpe/gpt2+bpe": tiny_model,
    "byte-level-bpe/gpt2+bpe prefix space": gpt2_prefix_space,
    "byte-level-bpe/llama3+bpe": llama3_split,
    "byte-level-bpe/qwen2+bpe": qwen2_split,
}


@pytest.mark.parametrize("make", list(_FAST.values()), ids=list(_FAST))
def test_hand_split_pieces_give_the_engines_ids_on_any_ascii(make: object) -> None:
    tok = make()  # type: ignore[operator]
    core = _core(tok)
    assert core.fast_pieces  # type: ignore[attr-defined]
    rng = random.Random(5)
    texts = [_random_ascii(rng) for _ in range(4000)] + ["".join(_ASCII), " " * 9, "x'", "'", "a '"]
    for text in texts:
        want = tok.encode(text, add_special_tokens=False).ids
        assert core.piece_ids(text) == want, repr(text)  # type: ignore[attr-defined]


_OTHER = [
    "café",
    "naïve",
    "’",
    "“quoted”",
    "—",
    "日本語",
    "😀",
    "Привет",
    "x²",
    "ﬁ",
    "\u00a0",
    "\u2028",
    "é'",
    "ü12",
]


@pytest.mark.parametrize("make", list(_FAST.values()), ids=list(_FAST))
def test_pieces_with_other_characters_are_cut_and_still_give_the_engines_ids(make: object) -> None:
    """A piece with a few characters that are not ASCII is cut at the safe cuts inside it: its ASCII
    stretches are split by hand, the rest go through the pipeline; together, the engine's ids."""
    tok = make()  # type: ignore[operator]
    core = _core(tok)
    rng = random.Random(9)
    words = ["the", "quick", "brown", "fox", "it's", "12", "a", "Zq", "?!", "x"]
    seps = [" ", " ", " ", "  ", "\n", "\t", ", ", ". "]
    for _ in range(1500):
        parts = []
        for _ in range(rng.randint(1, 30)):
            parts.append(rng.choice(_OTHER) if rng.random() < 0.15 else rng.choice(words))
            parts.append(rng.choice(seps))
        text = "".join(parts)
        assert core.piece_ids(text) == tok.encode(text, add_special_tokens=False).ids, repr(text)  # type: ignore[attr-defined]


def test_pieces_with_an_added_token_or_other_characters_go_through_the_pipeline() -> None:
    tok = tiny_model()
    tok.add_special_tokens(["<|user|>"])
    tok.add_tokens(["ticket"])  # a plain added token: matched in the text before any split
    core = _core(tok)
    for text in ["hello <|user|> there", "my ticket 12", "tickets", "café au lait", "日本 x", "😀 a", ""]:
        assert core.piece_ids(text) == tok.encode(text, add_special_tokens=False).ids, text  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(set(PROVEN) - set(_FAST)))
def test_other_families_keep_the_pipeline(name: str) -> None:
    tok = PROVEN[name]()
    core = _core(tok)
    assert not core.fast_pieces  # type: ignore[attr-defined]
    text = "it's 12 o'clock,  then\tmore"
    assert core.piece_ids(text) == tok.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]


def test_a_normalizer_or_dropout_keeps_the_pipeline() -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    tok = tiny_model()
    tok.normalizer = normalizers.Lowercase()
    assert not _core(tok).fast_pieces  # type: ignore[attr-defined]
    tok = llama3_split()
    tok.pre_tokenizer = pre_tokenizers.Sequence(  # a Split on a pattern not known to the shortcut
        [
            pre_tokenizers.Split(Regex(r"\p{L}+|\s+|."), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert not _core(tok).fast_pieces  # type: ignore[attr-defined]
    tok = tiny_model()
    tok.model.dropout = 0.5  # random merges: only the pipeline may apply them
    assert not _core(tok).fast_pieces  # type: ignore[attr-defined]
    assert _core(wordlevel_whitespace_split()).fast_pieces is False  # type: ignore[attr-defined]


class _SplitsVerticalTabApart:
    """The native encoder, its hand-split pieces wrong on \\v (as a split that forgot it is \\s would be)."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def piece_ids(self, text: str) -> list[int]:
        ids = list(self._core.piece_ids(text))
        return ids[::-1] if "\x0b" in text and len(ids) > 1 else ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def test_the_router_takes_the_python_encoder_where_the_hand_split_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start-up self-check also holds the hand-split pieces to the engine's ids: where they differ,
    the router encodes in Python."""
    tok = tiny_model()
    proof = prove(tok)
    real_agrees = NativeIncrementalEncoder.agrees

    def differs(self: NativeIncrementalEncoder, texts: Any) -> bool:
        self._core = _SplitsVerticalTabApart(self._core)
        return real_agrees(self, texts)

    assert isinstance(
        make_encoder(tok, add_special_tokens=False, block_size=4, algo="sha256", proof=proof),
        NativeIncrementalEncoder,
    )
    monkeypatch.setattr(NativeIncrementalEncoder, "agrees", differs)
    enc = make_encoder(tok, add_special_tokens=False, block_size=4, algo="sha256", proof=proof)
    assert isinstance(enc, IncrementalEncoder)
