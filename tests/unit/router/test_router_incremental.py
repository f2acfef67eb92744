"""Incremental tokenization (router/incremental.py, and its native twin router/incremental_native.py): a
prompt cut into chunks and reused across prompts gives exactly the ids and block hashes of a whole
encode, for every tokenizer family the project generates or ships in tests, and for families it cannot
prove it falls back to whole encodes. Every test that does not look inside the Python encoder runs on
both encoders."""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kvstrata.router.hashing import block_hashes
from kvstrata.router.incremental import (
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    SELF_TEST_TEXTS,
    IncrementalEncoder,
    prove,
)
from kvstrata.router.incremental_native import NativeIncrementalEncoder, make_encoder
from kvstrata.router.prompts import LocalTokenizer

BLOCK = 4  # small blocks: many block boundaries fall near the cuts

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "and",
    "then",
    "some",
    "more",
    "words",
    "follow",
    "here",
    "numbers",
    "1",
    "22",
    "333",
    "4444",
    "55555",
    "it's",
    "they're",
    "we'll",
    "I'd",
    "you've",
    "I'm",
    "Ünïcödé",
    "wörds",
    "café",
    "naïve",
    "日本語",
    "テキスト",
    "emoji",
    "😀",
    "🚀",
    "Привет",
    "мир",
    "UPPER",
    "lower",
    "MiXeD",
    "snake_case",
    "kebab-case",
    "path/to/file.py",
    "x=f(y)+42;",
]
_SEPS = (" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", " \n ", "   ")


def _text(rng: random.Random, n_words: int, specials: tuple[str, ...] = ()) -> str:
    out = []
    for _ in range(n_words):
        out.append(rng.choice(_WORDS))
        if specials and rng.random() < 0.03:
            out.append(rng.choice(specials))
        out.append(rng.choice(_SEPS))
    return "".join(out)


def _corpus_for_training() -> list[str]:
    rng = random.Random(7)
    return [_text(rng, 200) for _ in range(60)]


def _bpe(pre: pre_tokenizers.PreTokenizer, *, byte_level: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    tok.pre_tokenizer = pre
    if byte_level:
        tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_for_training(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def gpt2_prefix_space() -> Tokenizer:
    return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True), byte_level=True)


def llama3_split() -> Tokenizer:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _bpe(pre, byte_level=True)


def qwen2_split() -> Tokenizer:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _bpe(pre, byte_level=True)


def metaspace_bpe() -> Tokenizer:
    return _bpe(pre_tokenizers.Metaspace(prepend_scheme="first"), byte_level=False)


def metaspace_unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_corpus_for_training(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def wordlevel_whitespace_split() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in " ".join(_corpus_for_training()).split():
        vocab.setdefault(w, len(vocab))
        if len(vocab) > 300:
            break
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    return tok


def wordpiece_whitespace() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus_for_training(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return tok


def tiny_model() -> Tokenizer:
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    return Tokenizer.from_file(str(ensure_tiny_model(default_tiny_model_dir()) / "tokenizer.json"))


PROVEN: dict[str, Callable[[], Tokenizer]] = {
    "byte-level-bpe/gpt2+bpe": tiny_model,  # the tiny model the project generates
    "byte-level-bpe/gpt2+bpe prefix space": gpt2_prefix_space,
    "byte-level-bpe/llama3+bpe": llama3_split,
    "byte-level-bpe/qwen2+bpe": qwen2_split,
    "metaspace+bpe": metaspace_bpe,
    "metaspace+unigram": metaspace_unigram,
    "whitespacesplit+wordlevel": wordlevel_whitespace_split,  # the router tests' fixture family
    "whitespace+wordpiece": wordpiece_whitespace,
}


def _unproven_nfc() -> Tokenizer:
    tok = _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), byte_level=True)
    tok.normalizer = normalizers.NFC()
    return tok


def _unproven_no_pre() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"], show_progress=False)
    tok.train_from_iterator(_corpus_for_training(), trainer=trainer)
    return tok


UNPROVEN: dict[str, Callable[[], Tokenizer]] = {"nfc": _unproven_nfc, "no pre-tokenizer": _unproven_no_pre}


def _prompts(specials: tuple[str, ...]) -> list[str]:
    """Multi-turn conversations (each turn extends the last), unicode, whitespace edges, and
    prefixes ending anywhere: inside a word, right after a multi-byte character, in a space run."""
    rng = random.Random(11)
    out: list[str] = []
    for _ in range(4):
        conv = _text(rng, 30, specials)
        for _turn in range(5):
            conv += _text(rng, rng.randint(5, 60), specials)
            out.append(conv)
    base = _text(rng, 80, specials)
    for k in range(len(base) // 3, len(base), 7):  # every 7th prefix of one long prompt
        out.append(base[:k])
    out.append(base + "   ")
    out.append(base + " \n\n\t ")
    out += ["", " ", "a", "  leading", "trailing  ", "😀😀 😀", "word " * 50, "\n" * 30 + "x"]
    return out


Encoder = IncrementalEncoder | NativeIncrementalEncoder
# Both encoders take the same arguments.
ENCODERS: dict[str, Callable[..., Encoder]] = {
    "python": IncrementalEncoder,
    "native": NativeIncrementalEncoder,
}


def _check_family(make: Callable[..., Encoder], tok: Tokenizer, *, chunk: int) -> Encoder:
    specials = tuple(t.content for t in tok.get_added_tokens_decoder().values())
    enc: Encoder | None = None
    for add_special in (True, False):
        enc = make(tok, add_special_tokens=add_special, block_size=BLOCK, chunk_chars=chunk)
        if isinstance(enc, NativeIncrementalEncoder):
            # The router takes the native encoder only where it gives the engine's ids (else Python's).
            assert enc.agrees(SELF_TEST_TEXTS)
        probes = 0
        for text in _prompts(specials):
            want = tok.encode(text, add_special_tokens=add_special).ids
            assert enc.chunked_ids(text, step=1) == want, text[:60]
            probes += _check_probes(tok, enc, text, want)
            got = enc.encode(text)  # the trie is warm with the earlier prompts
            assert (got.tokens, got.hashes) == (len(want), block_hashes(want, BLOCK)), text[:60]
        assert probes > 50 if enc.enabled else probes == 0
    assert enc is not None
    return enc


def _check_probes(tok: Tokenizer, enc: Encoder, text: str, want: list[int]) -> int:
    """A probe after the walk gives the whole encode's leading tokens and hashes, up to a safe cut,
    and changes neither the walk nor the cache."""
    walked = enc.walk(text)
    assert walked is not None
    before, chunks = walked.hashes[:], enc.stats()["chunks"]
    made = 0
    for chars in (1, 7, 40):
        probe = enc.probe(text, walked, chars)
        if not enc.enabled:
            assert probe is None
            continue
        if probe is None:  # no safe cut that far: the caller encodes the rest
            continue
        assert walked.pos < probe.chars < len(text)
        head = tok.encode(text[: probe.chars], add_special_tokens=False).ids
        assert want[: probe.tokens] == list(enc.prefix) + head, text[:60]
        assert len(probe.hashes) == probe.tokens // BLOCK
        assert probe.hashes == block_hashes(want, BLOCK)[: len(probe.hashes)], text[:60]
        made += 1
    assert walked.hashes == before and enc.stats()["chunks"] == chunks
    return made


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("family", sorted(PROVEN))
def test_incremental_equals_whole_encode(family: str, encoder: str) -> None:
    tok = PROVEN[family]()
    proof = prove(tok)
    assert proof.family == family.split(" ")[0], proof.reason
    enc = _check_family(ENCODERS[encoder], tok, chunk=16)
    assert enc.enabled and enc.stats()["chunks"] > 0


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("name", sorted(UNPROVEN))
def test_unproven_tokenizers_are_encoded_whole(name: str, encoder: str) -> None:
    tok = UNPROVEN[name]()
    assert prove(tok).family is None
    enc = _check_family(ENCODERS[encoder], tok, chunk=16)
    assert not enc.enabled and enc.stats()["chunks"] == 0


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_an_extending_prompt_tokenizes_only_its_tail(encoder: str) -> None:
    tok = tiny_model()
    enc = ENCODERS[encoder](tok, add_special_tokens=True, block_size=32, chunk_chars=256)
    rng = random.Random(3)
    prompt = _text(rng, 3000)
    first = enc.encode(prompt)
    assert first.reused_chars == 0
    turn = prompt + " and the next question is here, with a few more words."
    second = enc.encode(turn)
    ids = tok.encode(turn).ids
    assert (second.tokens, second.hashes) == (len(ids), block_hashes(ids, 32))
    # All but the last chunk or two of the earlier prompt came from the cache.
    assert second.reused_chars > len(prompt) - 3 * 256 - 64
    # A prompt that shares only the first half reuses that half and no more.
    fork = prompt[: len(prompt) // 2] + " something else entirely."
    third = enc.encode(fork)
    ids = tok.encode(fork).ids
    assert (third.tokens, third.hashes) == (len(ids), block_hashes(ids, 32))
    assert len(prompt) // 2 - 3 * 256 - 64 < third.reused_chars <= len(prompt) // 2


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_the_cache_is_bounded(encoder: str) -> None:
    tok = tiny_model()
    enc = ENCODERS[encoder](
        tok, add_special_tokens=True, block_size=32, chunk_chars=64, max_cached_chars=5000
    )
    rng = random.Random(5)
    for _ in range(20):
        text = _text(rng, 300)
        got = enc.encode(text)
        ids = tok.encode(text).ids
        assert got.hashes == block_hashes(ids, 32)
        stats = enc.stats()
        assert stats["cachedBytes" if encoder == "native" else "cachedChars"] <= 5000


def test_the_cache_is_out_of_the_garbage_collectors_sight() -> None:
    """A full chunk cache is ~30,000 chunks: kept as objects the collector tracks, every full collection
    walked them (~55 ms with every thread held, the event loop too). Its entries are plain tuples of ints
    and bytes, which a few collections untrack for good (a nested tuple after the ones inside it); a
    prompt walked from them is still encoded right."""
    tok = tiny_model()
    enc = IncrementalEncoder(tok, add_special_tokens=True, block_size=32, chunk_chars=64)
    rng = random.Random(8)
    texts = [_text(rng, 400) for _ in range(5)]
    for text in texts:
        enc.encode(text)
    for _ in range(3):  # the chain state's tuples, then the state, then the entry
        gc.collect()
    trie = enc._trie
    assert len(trie.nodes) > 100
    tracked = [k for k, node in trie.nodes.items() if gc.is_tracked(node) or gc.is_tracked(k)]
    assert tracked == []
    assert not any(gc.is_tracked(lens) for lens in trie.key_lens.values())
    for text in texts:  # walked from the cache now
        got = enc.encode(text + " one more")
        ids = tok.encode(text + " one more").ids
        assert got.reused_chars > 0 and (got.tokens, got.hashes) == (len(ids), block_hashes(ids, 32))


def test_chat_turns_reuse_the_rendered_conversation(tmp_path: Path) -> None:
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    lt = LocalTokenizer(ensure_tiny_model(default_tiny_model_dir()))
    enc = lt.incremental(False, 32, "sha256")
    assert isinstance(enc, NativeIncrementalEncoder)  # the router's, for the model it is tested with
    rng = random.Random(9)
    messages = [{"role": "system", "content": _text(rng, 400)}]
    reused = []
    for turn in range(4):
        messages.append({"role": "user", "content": _text(rng, 30)})
        rendered = lt.render_chat(messages)
        got = enc.encode(rendered)
        ids = lt.encode_chat(messages)
        assert (got.tokens, got.hashes) == (len(ids), block_hashes(ids, 32))
        reused.append(got.reused_chars)
        messages.append({"role": "assistant", "content": _text(rng, 20 + turn)})
    assert reused[0] == 0 and all(r > 1000 for r in reused[1:])


def _remembered(enc: Any) -> int:
    """How many long prompts ``enc`` remembers the chunk ends of."""
    if isinstance(enc, NativeIncrementalEncoder):
        return int(enc.stats()["recentPrompts"])
    return sum(len(entries) for entries in enc._recent.values())


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_a_long_prompts_next_turn_starts_where_its_chunks_ended(encoder: str) -> None:
    """Long prompts remember where their chunks end; a prompt extending one starts there, prompts that
    diverge at or right after its last cut walk the trie instead, and all are exact."""
    tok = tiny_model()
    enc = ENCODERS[encoder](tok, add_special_tokens=True, block_size=32)
    rng = random.Random(21)
    prompt = _text(rng, 6000)
    assert len(prompt) > 20_000
    enc.encode(prompt)
    assert _remembered(enc) == 1
    walked = enc.walk(prompt)  # from the remembered prompt: to its last cut
    assert walked is not None
    cut = walked.pos
    assert len(prompt) - 200 < cut < len(prompt)
    variants = [
        prompt + " and one more turn here.",  # extends it
        prompt[:cut] + "<s>" + prompt[cut:],  # an added token right at the last cut
        prompt[:cut] + "X" + prompt[cut + 1 :],  # not a space at the cut any more
        prompt[: cut + 1] + "1" + prompt[cut + 2 :],  # a digit after the space: no cut there
        prompt[: cut // 2] + " a fork.",  # shares only the first half
    ]
    for text in variants:
        got = enc.encode(text)
        ids = tok.encode(text).ids
        assert (got.tokens, got.hashes) == (len(ids), block_hashes(ids, 32)), text[cut - 20 : cut + 20]
    assert enc.encode(variants[0] + " more.").reused_chars >= cut


def test_the_router_takes_the_native_encoder_only_where_it_gives_the_engines_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native encoder tokenizes with the crate, not the engine's package: where the two disagree on
    the self-test corpus (a crate release that tokenizes differently, made to happen here), the router
    encodes in Python, and still gives the engine's ids."""
    tok = tiny_model()
    proof = prove(tok)
    native = make_encoder(tok, add_special_tokens=True, block_size=BLOCK, algo="sha256", proof=proof)
    assert isinstance(native, NativeIncrementalEncoder) and native.stats()["native"] is True
    real_agrees = NativeIncrementalEncoder.agrees

    def differs(self: NativeIncrementalEncoder, texts: Any) -> bool:
        self._core = _OffByOne(self._core)  # a crate that encodes one self-test text differently
        return real_agrees(self, texts)

    monkeypatch.setattr(NativeIncrementalEncoder, "agrees", differs)
    enc = make_encoder(tok, add_special_tokens=True, block_size=BLOCK, algo="sha256", proof=proof)
    assert isinstance(enc, IncrementalEncoder) and enc.stats()["native"] is False
    text = "the quick brown fox and then some more words follow here"
    ids = tok.encode(text).ids
    got = enc.encode(text)
    assert (got.tokens, got.hashes) == (len(ids), block_hashes(ids, BLOCK))


class _OffByOne:
    """The native encoder, its whole encodes of one text off by one id."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def full_ids(self, text: str) -> list[int]:
        ids = list(self._core.full_ids(text))
        return [*ids[:-1], ids[-1] + 1] if "fox" in text and ids else ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_threads_sharing_one_encoder_get_exact_ids(encoder: str) -> None:
    """The router's tokenizer threads and its event loop share one encoder (its chunk trie and remembered
    long prompts): four threads encoding conversations that share system prompts, all at once, walking
    and caching over each other's chunks (non-blocking walks too, as the loop does), each get a whole
    encode's tokens and hashes."""
    tok = tiny_model()
    enc = ENCODERS[encoder](tok, add_special_tokens=True, block_size=BLOCK, chunk_chars=64)
    systems = [_text(random.Random(s), 3000) for s in range(2)]
    assert min(map(len, systems)) > 16_384  # long prompts: remembered where their chunks end
    errors: list[str] = []
    start = threading.Barrier(4)

    def converse(seed: int) -> None:
        rng = random.Random(seed)
        text = systems[seed % 2]
        start.wait()
        for _ in range(6):
            text += _text(rng, rng.randint(3, 40))
            walked = enc.walk(text, blocking=rng.random() < 0.5)
            got = enc.encode(text) if walked is None else enc.finish(text, walked)
            ids = tok.encode(text).ids
            if (got.tokens, got.hashes) != (len(ids), block_hashes(ids, BLOCK)):
                errors.append(f"thread {seed}: {text[-60:]!r}")

    threads = [threading.Thread(target=converse, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert enc.stats()["chunks"] > 0 and _remembered(enc) > 0


def test_a_short_prompt_never_waits_for_a_long_ones_cache_and_keeps_exact_ids() -> None:
    """A short prompt is encoded holding the GIL (on the event loop), so the native encoder never makes
    it wait for the chunk cache's lock, which another thread walking or caching a long prompt may hold
    for milliseconds: when it is busy, the short prompt is encoded whole, uncached. Those encodes must
    still give the engine's ids and hashes; the run goes on until some of them happened."""
    tok = tiny_model()
    enc = NativeIncrementalEncoder(tok, add_special_tokens=True, block_size=BLOCK)
    rng = random.Random(3)
    long_text = _text(rng, 60_000)  # ~400K characters: thousands of chunks cached per encode
    done = threading.Event()

    def long_ones() -> None:
        for i in range(40):
            if done.is_set():
                return
            enc.encode(f"{i} {long_text}")

    worker = threading.Thread(target=long_ones)
    worker.start()
    try:
        n = 0
        while worker.is_alive() and enc.stats()["encodedWhileBusy"] < 3:
            text = f"short prompt number {n} " + _text(rng, 20)
            want = tok.encode(text).ids
            got = enc.encode(text)
            assert (got.tokens, got.hashes) == (len(want), block_hashes(want, BLOCK)), text
            n += 1
    finally:
        done.set()
        worker.join()
    assert enc.stats()["encodedWhileBusy"] >= 3
