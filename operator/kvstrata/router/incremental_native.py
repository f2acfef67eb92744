"""The router's incremental encoder, native: router/incremental.py's walk, cuts, chunk trie and finish,
run in Rust (``native/src/incremental.rs``) with the tokenizer called there, not through Python.

Why: a short prompt extending a known one cost ~22 µs in Python (a walk over dicts, the tokenizer's Python
binding, arrays and tuples per chunk) and costs ~8 µs here, most of it the tokenizer library's own
per-call work on the new tail; and every Python step of a long prompt's walk and finish held the GIL
that the event loop needs.

The proof stays :func:`incremental.prove` and the Python encoder stays the definition (its tests run on
both). The native side tokenizes with the ``tokenizers`` crate the Python package is built from, which
need not be the very release the engine's package is: so before the router uses it, it must give the
engine's ids (the Python package's) on the self-test corpus, whole and cut as finely as it can cut.
Where it does not, the router uses the Python encoder (:func:`make_encoder`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from kvstrata.api.router_config import DEFAULT_HASH_ALGO, HashAlgo
from kvstrata.router import native
from kvstrata.router.hashing import NONE_HASHES, check_algo
from kvstrata.router.incremental import (
    DEFAULT_CHUNK_CHARS,
    DEFAULT_FIRST_CHUNK_CHARS,
    DEFAULT_MAX_CACHED_CHARS,
    SELF_TEST_TEXTS,
    Encoded,
    IncrementalEncoder,
    Probe,
    PromptEncoder,
    Proof,
    prove,
)

log = logging.getLogger("kvstrata.router.incremental")

# Every ASCII character, and the byte-level splits' edges: whitespace runs before a word and at the end,
# \v and \f (whitespace) beside \x1c-\x1f (not), contractions in either case and quotes that are not,
# digit runs, punctuation runs before newlines.
_ASCII_EDGES = (
    "".join(map(chr, range(128))),
    " \t\x0b\x0c\r\n  x\x1c\x1f y  \n\n z\t\tw ",
    "it's they'RE ''s 'x 'll've 12ab34?! a.'s x'",
    '("hi"?!\n\n 1234567 \tb\rc x\'S',
)


class NativeIncrementalEncoder:
    """:class:`incremental.IncrementalEncoder`'s interface over the native encoder. Sizes are in UTF-8
    bytes where the Python encoder counts characters (the same for ASCII); positions read back are in
    characters."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        add_special_tokens: bool,
        block_size: int,
        algo: HashAlgo = DEFAULT_HASH_ALGO,
        proof: Proof | None = None,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        first_chunk_chars: int = DEFAULT_FIRST_CHUNK_CHARS,
        max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS,
    ) -> None:
        check_algo(algo)
        proof = proof if proof is not None else prove(tokenizer)
        self.tokenizer = tokenizer
        self.proof = proof
        self.enabled = proof.family is not None
        self.prefix = proof.prefix if add_special_tokens else ()
        self.suffix = proof.suffix if add_special_tokens else ()
        self._add_special = add_special_tokens
        self._core = native.Encoder(
            tokenizer.to_str(),
            add_special_tokens=add_special_tokens,
            block_size=block_size,
            algo=algo,
            none_hash=NONE_HASHES[algo],
            prefix=proof.prefix,
            suffix=proof.suffix,
            added=proof.added,
            enabled=self.enabled,
            chunk_chars=chunk_chars,
            first_chunk_chars=first_chunk_chars,
            max_cached_chars=max_cached_chars,
        )

    @property
    def reason(self) -> str:
        return self.proof.reason

    def engine_ids(self, text: str) -> list[int]:
        """The ids the engine computes (the Python package's whole encode)."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=self._add_special)[0].ids

    def agrees(self, texts: Sequence[str]) -> bool:
        """Every text gives the engine's ids by a native whole encode and, where prompts may be cut, by
        native chunks cut as finely as possible; and pieces split by hand (``fast_pieces``) give the
        engine's ids on every ASCII character and the splits' edge cases."""
        for text in texts:
            for t in (text, text * 3):
                want = self.engine_ids(t)
                if self._core.full_ids(t) != want or (self.enabled and self._core.chunked_ids(t, 1) != want):
                    log.warning("the native tokenizer differs from the engine's on %r", t[:80])
                    return False
        if self._core.fast_pieces:
            for t in _ASCII_EDGES:
                if self._core.piece_ids(t) != self.tokenizer.encode(t, add_special_tokens=False).ids:
                    log.warning("the native split of ASCII pieces differs from the engine's on %r", t[:80])
                    return False
        return True

    def chunked_ids(self, text: str, step: int | None = None) -> list[int]:
        return self._core.chunked_ids(text, step)

    def walk(self, text: str, blocking: bool = True) -> native.Walk | None:
        return self._core.walk(text, blocking)

    def finish(self, text: str, walked: native.Walk) -> Encoded:
        return Encoded(*self._core.finish(text, walked))

    def probe(self, text: str, walked: native.Walk, chars: int) -> Probe | None:
        got = self._core.probe(text, walked, chars)
        return None if got is None else Probe(*got)

    def encode(self, text: str) -> Encoded:
        return Encoded(*self._core.encode(text))

    def stats(self) -> dict[str, Any]:
        chunks, cached, recent, busy = self._core.stats()
        return {
            "family": self.proof.family,
            "reason": self.proof.reason,
            "enabled": self.enabled,
            "native": True,
            # ASCII pieces split by hand: byte-level BPE with GPT-2's, Llama 3's or Qwen2's split
            # (native/src/bytelevel.rs).
            "fastPieces": self._core.fast_pieces,
            "chunks": chunks,
            "cachedBytes": cached,
            "recentPrompts": recent,
            # Short prompts encoded whole, uncached, rather than wait for the chunk cache's lock while
            # holding the GIL (another thread was walking or caching a long prompt).
            "encodedWhileBusy": busy,
        }


def make_encoder(
    tokenizer: Tokenizer, *, add_special_tokens: bool, block_size: int, algo: HashAlgo, proof: Proof
) -> PromptEncoder[Any]:
    """The native encoder where it gives the engine's ids on the self-test corpus, else the Python one."""
    enc = NativeIncrementalEncoder(
        tokenizer, add_special_tokens=add_special_tokens, block_size=block_size, algo=algo, proof=proof
    )
    if enc.agrees(SELF_TEST_TEXTS):
        return enc
    log.warning("incremental tokenization runs in Python: the native tokenizer differs from the engine's")
    return IncrementalEncoder(
        tokenizer, add_special_tokens=add_special_tokens, block_size=block_size, algo=algo, proof=proof
    )
