"""Routing cost proportional to what is new: tokenize and hash only the part of a prompt not seen before.

Multi-turn and agent prompts extend an earlier prompt. The encoder cuts every prompt into chunks at
*safe cut points* and keeps, per chunk, the block-hash chain state after it, in a trie keyed by
(parent chunk, chunk text). A prompt that extends a known one walks the trie over its shared chunks
(a slice and a dict lookup per chunk, no tokenization), then tokenizes only the chunks that are new
plus the unfinished tail, and hashes only the blocks those tokens complete. A cold prompt is tokenized
chunk by chunk in ``encode_batch_fast`` calls of at most 16K characters each, on the calling thread.

Exactness, i.e. ``ids(chunk_0) + ids(chunk_1) + ... == ids(prompt)`` for the engine's tokenizer, holds
for tokenizers with this shape, read from tokenizer.json (:func:`prove`):

1. no normalizer (so the text the pre-tokenizer sees is the prompt, character for character);
2. a pre-tokenizer that splits the text into pieces by a known pattern scanned left to right with no
   look-behind: ``ByteLevel`` with its GPT-2 regex, a ``Split`` by the GPT-2, Llama-3 or Qwen2 regex
   (``Isolated``) followed by ``ByteLevel`` without regex, ``Whitespace``, ``WhitespaceSplit``, or
   ``Metaspace`` with ``split``;
3. a model that encodes each piece on its own (``BPE`` without dropout, ``WordLevel``, ``WordPiece``,
   ``Unigram``), and no truncation or padding;
4. a post-processor that only adds fixed special tokens before and after (probed, not assumed).

A safe cut point is a single ASCII space with an ASCII letter or digit before it and an ASCII letter
after it (``word| word``), with no added token (``<s>``, chat markers, ...) within reach of it. For
each pattern above, no piece can contain a space that follows a non-space character, so a piece ends
right before such a space and the next piece (`` word``; for Metaspace ``▁word``, which starts with
the replacement and so gets no second one prepended) starts at it. The piece before the cut was
decided by the text up to the space (the patterns look at most one character past a letter/digit
run), which a prompt extending this one shares. Added tokens are matched before pre-tokenization; with
none overlapping or touching the cut (``lstrip``/``rstrip``/``single_word`` look only at neighbours,
and the neighbours of the cut are not whitespace runs), the matches are the same in the chunks and in
the whole. So the pieces of the whole prompt are the pieces of its chunks, and per-piece models give
the same ids. A cut is only taken at least (longest added token + 2) characters before the end of the
prompt, so everything it depends on is in any prompt that extends this one.

Tokenizers of any other shape (a normalizer such as NFC or Llama-2's ``Prepend``, no pre-tokenizer,
an unknown split pattern, BPE dropout) are not cut at all: every prompt is encoded whole, as before,
and the reason is logged and shown in ``/kvstrata/state``. As a second line of defence the encoder
checks itself at start-up on a corpus of edge cases (unicode, whitespace runs, added tokens, digits),
cutting as finely as it can, and turns chunking off for that tokenizer if any id differs.

Thread safety: the trie is shared by the tokenizer threads; lookups and inserts hold a lock, encoding
and hashing do not.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final, NamedTuple, Protocol, TypeVar

from tokenizers import Tokenizer

from kvstrata.api.router_config import DEFAULT_HASH_ALGO, HashAlgo
from kvstrata.router.hashing import (
    NONE_HASHES,
    block_digests,
    block_hashes,
    chain,
    check_algo,
    to_external,
)

log = logging.getLogger("kvstrata.router.incremental")

# Split patterns whose pieces never hold a space after a non-space (read from published tokenizer.json).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLIT_PATTERNS = {GPT2_PATTERN: "gpt2", LLAMA3_PATTERN: "llama3", QWEN2_PATTERN: "qwen2"}
_PER_PIECE_MODELS = frozenset({"BPE", "WordLevel", "WordPiece", "Unigram"})

# `word| word`: the space is the cut; the characters either side are ASCII, never whitespace.
_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")

DEFAULT_CHUNK_CHARS = 1024
DEFAULT_FIRST_CHUNK_CHARS = 256
_FIRST_CHUNKS_UNTIL = 4096  # characters from the start cut in first-chunk sizes
# A prompt's last cut is at most this far from its end (see finish): a next turn re-tokenizes about this
# many characters of the prompt it extends.
_TAIL_CHUNK_CHARS = 64
# One tokenizer call takes pieces of at most this many characters in all (a millisecond or two): fewer
# calls than one per piece, and a bounded batch of results in memory at once.
_BATCH_MAX_CHARS = 16_384
# Long prompts (over _RECENT_MIN_CHARS) remember where their chunks end, so that the next turn (a prompt
# starting with the whole of one) skips the per-chunk walk: at most _RECENT_PER_KEY per first
# _RECENT_KEY_CHARS characters, _RECENT_MAX_CHARS in all.
_RECENT_MIN_CHARS = 16_384
_RECENT_KEY_CHARS = 256
_RECENT_PER_KEY = 8
_RECENT_MAX_CHARS = 16 << 20
# Distinct chunk lengths tried after one chunk (prompts that diverge there); the newest are kept.
_MAX_KEY_LENS = 32
DEFAULT_MAX_CACHED_CHARS = 32 << 20

# Start-up self-check: each text is encoded whole and in chunks cut as finely as possible.
SELF_TEST_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "Ünïcödé wörds here and 日本語 text with émoji 😀 inside words and here",
    "tabs\tand  double  spaces and\nnew lines\n\n and trailing spaces   and x",
    "numbers 1 22 333 4444 55555 666666 and 3.14159 and a1 b2 c3 d4",
    "<s> a special token and </s> another and <unk> one and the end",
    "<|user|>\nhello there my friend\n<|assistant|>\nhi there how are you\n",
    "aaaaaaaaaa bbbbbbbbbb cccccccccc dddddddddd eeeeeeeeee ffffffffff gg",
    "' quote 's and 're and 'll and 'd and 've and 'm and n't and so on",
    "UPPER lower MiXeD CaSe words Of all KINDS and more Words Here ok",
    "punctuation... ends! here? (parens) [brackets] {braces} and so on ok",
)


class Proof(NamedTuple):
    """Whether prompts of this tokenizer may be cut (``family``), or why not (``reason``)."""

    family: str | None
    reason: str
    prefix: tuple[int, ...] = ()  # special ids the post-processor puts before the text
    suffix: tuple[int, ...] = ()  # ... and after it
    added: tuple[str, ...] = ()  # added-token contents, none of which may touch a cut


def _pre_tokenizer_family(pre: dict[str, Any] | None) -> tuple[str | None, str]:
    if pre is None:
        return None, "no pre-tokenizer: the model sees the whole prompt as one piece"
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("use_regex", True):
            return "byte-level-bpe/gpt2", ""
        return None, "ByteLevel without its regex splits nothing"
    if kind in ("Whitespace", "WhitespaceSplit"):
        return kind.lower(), ""
    if kind == "Metaspace":
        if pre.get("split", True) and pre.get("replacement", "\u2581") == "\u2581":
            return "metaspace", ""
        return None, "Metaspace without split keeps the whole prompt one piece"
    if kind == "Sequence":
        parts = pre.get("pretokenizers") or []
        if (
            len(parts) == 2
            and parts[0].get("type") == "Split"
            and parts[1].get("type") == "ByteLevel"
            and not parts[1].get("use_regex", True)
        ):
            split = parts[0]
            pattern = (split.get("pattern") or {}).get("Regex")
            if split.get("behavior") != "Isolated" or split.get("invert"):
                return None, f"Split behaviour {split.get('behavior')!r} is not proven"
            name = KNOWN_SPLIT_PATTERNS.get(pattern or "")
            if name is None:
                return None, "a Split pattern that is not one of the proven ones"
            return f"byte-level-bpe/{name}", ""
        return None, "a pre-tokenizer sequence that is not Split + ByteLevel"
    return None, f"pre-tokenizer {kind!r} is not proven"


def _specials(tok: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The post-processor's fixed prefix and suffix, if it adds the same ones to every text."""
    found: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for probe in ("hello world", "a", "x y z 1 2"):
        full = tok.encode(probe, add_special_tokens=True).ids
        body = tok.encode(probe, add_special_tokens=False).ids
        extra = len(full) - len(body)
        if extra < 0:
            return None
        got = None
        for p in range(extra + 1):
            if full[p : p + len(body)] == body:
                got = (tuple(full[:p]), tuple(full[p + len(body) :]))
                break
        if got is None or (found is not None and got != found):
            return None
        found = got
    return found


def prove(tok: Tokenizer) -> Proof:
    """Read tokenizer.json: may prompts be cut at safe points with ids identical to a whole encode?"""
    spec = json.loads(tok.to_str())
    added = tuple(t["content"] for t in spec.get("added_tokens") or [] if t.get("content"))
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return Proof(None, "truncation or padding is set in tokenizer.json")
    if spec.get("normalizer") is not None:
        return Proof(None, f"normalizer {spec['normalizer'].get('type')!r} may change text across a cut")
    model = spec.get("model") or {}
    if model.get("type") not in _PER_PIECE_MODELS:
        return Proof(None, f"model {model.get('type')!r} is not proven to encode piece by piece")
    if model.get("dropout"):
        return Proof(None, "BPE dropout makes encoding random")
    family, why = _pre_tokenizer_family(spec.get("pre_tokenizer"))
    if family is None:
        return Proof(None, why)
    specials = _specials(tok)
    if specials is None:
        return Proof(None, "the post-processor does not add a fixed prefix/suffix")
    family = f"{family}+{model['type'].lower()}"
    return Proof(family, f"proven: {family}", specials[0], specials[1], added)


class _State(NamedTuple):
    """The block chain after some tokens: the last full block's digest and the partial block's tokens."""

    tokens: int
    last: bytes
    leftover: tuple[int, ...]


# A cached chunk: (node id, the chunk's length (its key also holds the context after it), the 64-bit
# hashes of the blocks completed within it as the bytes of an array('Q'), the chain state after it as a
# plain tuple). Plain tuples of ints and bytes, not objects (nor arrays, which the collector tracks): the
# garbage collector stops tracking such tuples within a few collections (nested ones after those inside
# them), and a full chunk cache is ~30,000 chunks (as objects, a full collection walked them for ~55 ms,
# every thread and the event loop held meanwhile; as tuples, ~0.1 ms).
_Node = tuple[int, int, bytes, tuple[int, bytes, tuple[int, ...]]]
_ID: Final = 0
_CHARS: Final = 1
_HASHES: Final = 2
_STATE: Final = 3


class Walk(NamedTuple):
    pos: int  # characters covered by cached chunks
    state: _State
    hashes: array[int]
    parent_id: int  # the last cached chunk's node (-1: the tokenizer is not cut)
    base: str | None = None  # the remembered long prompt the walk started from (see _remember)

    @property
    def tokens(self) -> int:
        """Tokens up to ``pos`` (the special tokens before the text included)."""
        return self.state.tokens


class Encoded(NamedTuple):
    tokens: int
    hashes: array[int]
    reused_chars: int  # characters whose tokens and hashes came from the cache


class Probe(NamedTuple):
    """The next stretch after a walk, tokenized and hashed but not cached (:meth:`IncrementalEncoder.probe`)."""

    hashes: array[int]  # the walk's hashes, then the full blocks of the stretch
    tokens: int  # tokens up to the stretch's end (special tokens before the text included)
    chars: int  # characters up to the stretch's end (a safe cut)


class WalkView(Protocol):
    """What the router reads of a walk, from this encoder or the native one."""

    @property
    def pos(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def hashes(self) -> array[int]: ...


W = TypeVar("W", bound=WalkView)


class PromptEncoder(Protocol[W]):
    """Prompt text → (tokens, block hashes) reusing earlier prompts: :class:`IncrementalEncoder`, or
    router/incremental_native.py's (the router's, where its self-check passes)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def suffix(self) -> tuple[int, ...]: ...
    def walk(self, text: str, blocking: bool = True) -> W | None: ...
    def finish(self, text: str, walked: W) -> Encoded: ...
    def probe(self, text: str, walked: W, chars: int) -> Probe | None: ...
    def encode(self, text: str) -> Encoded: ...
    def stats(self) -> dict[str, Any]: ...


@dataclass
class _Trie:
    # (parent id, chunk text + the context its cut depends on) -> node; least recently used first.
    nodes: OrderedDict[tuple[int, str], _Node] = field(default_factory=OrderedDict)
    # parent id -> the key lengths of its children (most often one).
    key_lens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    chars: int = 0
    next_id: int = 1


class IncrementalEncoder:
    """Prompt text → (token count, block hashes), reusing the chunks of earlier prompts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        add_special_tokens: bool,
        block_size: int,
        algo: HashAlgo = DEFAULT_HASH_ALGO,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        first_chunk_chars: int = DEFAULT_FIRST_CHUNK_CHARS,
        max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS,
        proof: Proof | None = None,
        self_test: bool = True,
    ) -> None:
        check_algo(algo)
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.algo = algo
        self.chunk_chars = max(1, chunk_chars)
        self.first_chunk_chars = max(1, min(first_chunk_chars, chunk_chars))
        self.max_cached_chars = max_cached_chars
        self.proof = proof if proof is not None else prove(tokenizer)
        self.prefix = self.proof.prefix if add_special_tokens else ()
        self.suffix = self.proof.suffix if add_special_tokens else ()
        self._add_special = add_special_tokens
        self._added = (
            re.compile("|".join(re.escape(a) for a in sorted(self.proof.added, key=len, reverse=True)))
            if self.proof.added
            else None
        )
        self._reach = max((len(a) for a in self.proof.added), default=0) + 1
        self._lock = threading.Lock()
        self._trie = _Trie()
        # prompt[:_RECENT_KEY_CHARS] -> [(a recent long prompt's chunked prefix, the walk to its end)]
        self._recent: OrderedDict[str, list[tuple[str, Walk]]] = OrderedDict()
        self._recent_chars = 0
        self._root = _State(len(self.prefix), NONE_HASHES[algo], self.prefix)
        self.enabled = self.proof.family is not None
        if self.enabled and self_test and not self.check(SELF_TEST_TEXTS):
            log.warning("incremental tokenization failed its self-test; prompts are encoded whole")
            self.enabled = False
            self.proof = self.proof._replace(family=None, reason="self-test found a difference")

    @property
    def reason(self) -> str:
        return self.proof.reason

    # --- cuts ------------------------------------------------------------------------------------
    def _cut_at_or_after(self, text: str, pos: int, end: int) -> int | None:
        """The first safe cut point in ``[pos, end)``."""
        while pos < end:
            m = _CUT.search(text, pos, end + 1)
            if m is None or m.start() >= end:
                return None
            c = m.start()
            if (
                self._added is None
                or self._added.search(text, max(0, c - self._reach), c + self._reach + 1) is None
            ):
                return c
            pos = c + 1
        return None

    def cuts(self, text: str, start: int = 0, step: int | None = None) -> Iterator[int]:
        """Cut points after ``start``, each at least ``step`` (default: chunk size) after the last."""
        if not self.enabled:
            return
        end = len(text) - self._reach - 1
        pos = start
        while True:
            # Short chunks near the start, where system prompts and templates are shared by many
            # prompts (a ~300-character shared prefix is reused); longer ones after, so a long prompt
            # is few chunks to walk.
            if step is not None:
                size = step
            else:
                size = self.first_chunk_chars if pos < _FIRST_CHUNKS_UNTIL else self.chunk_chars
            c = self._cut_at_or_after(text, max(pos + size, 1), end)
            if c is None:
                return
            yield c
            pos = c

    # --- encoding --------------------------------------------------------------------------------
    def _ids(self, pieces: Sequence[str]) -> list[list[int]]:
        return list(self._each_ids(pieces))

    def _each_ids(self, pieces: Sequence[str]) -> Iterator[list[int]]:
        """Each piece's ids, in order, by calls of at most :data:`_BATCH_MAX_CHARS` characters. In the
        router the library encodes a call's pieces on the calling thread, one after another
        (``workpool.tokenize_on_calling_threads``)."""
        tok = self.tokenizer
        sizes = [len(p) for p in pieces]
        start, chars = 0, 0
        for i, n in enumerate(sizes):
            if chars + n > _BATCH_MAX_CHARS and i > start:
                for e in tok.encode_batch_fast(list(pieces[start:i]), add_special_tokens=False):
                    yield e.ids
                start, chars = i, 0
            chars += n
        for e in tok.encode_batch_fast(list(pieces[start:]), add_special_tokens=False):
            yield e.ids

    def full_ids(self, text: str) -> list[int]:
        """The ids of a whole-prompt encode (what the engine computes)."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=self._add_special)[0].ids

    def chunked_ids(self, text: str, step: int | None = None) -> list[int]:
        """The ids assembled from chunks cut every ``step`` characters (for checks and tests)."""
        if not self.enabled:
            return self.full_ids(text)
        bounds = [0, *self.cuts(text, step=step), len(text)]
        pieces = [text[a:b] for a, b in pairwise(bounds)]
        out = list(self.prefix)
        for ids in self._ids(pieces):
            out += ids
        return out + list(self.suffix)

    def check(self, texts: Sequence[str]) -> bool:
        """Every text gives the same ids whole and cut as finely as possible."""
        for text in texts:
            for t in (text, text * 3):
                if self.chunked_ids(t, step=1) != self.full_ids(t):
                    log.warning("incremental tokenization differs from a whole encode on %r", t[:80])
                    return False
        return True

    def encode(self, text: str) -> Encoded:
        """(tokens, block hashes, characters reused) of ``text``, as a whole encode + hash would give."""
        walked = self.walk(text)
        assert walked is not None  # a blocking walk always gets the lock
        return self.finish(text, walked)

    def walk(self, text: str, blocking: bool = True) -> Walk | None:
        """The cached chunks ``text`` starts with (None if ``blocking`` is off and another thread holds
        the trie). Cheap: a slice and a dict lookup per chunk, no tokenizer, no search for cuts: a
        cached chunk's key is its text plus the characters after it that its cut depended on, so a
        prompt holding that same text at that place has its cut at the same point."""
        if not self.enabled:
            return Walk(0, _State(0, NONE_HASHES[self.algo], ()), chain(), -1)
        nodes, key_lens = self._trie.nodes, self._trie.key_lens
        parent_id, state, pos = 0, self._root, 0
        hashes = chain()
        path: list[tuple[int, str]] = []
        base: str | None = None
        if not self._lock.acquire(blocking):
            return None
        try:
            # A long prompt that extends a recent one starts where that one's chunks ended: one string
            # comparison (C) instead of a lookup per chunk. The longest such prompt: a shorter one that
            # forked off may end on a cut (its tail's finer ones) that the trie cannot walk on from.
            if len(text) > _RECENT_MIN_CHARS:
                best: Walk | None = None
                for prefix, w in self._recent.get(text[:_RECENT_KEY_CHARS], ()):
                    if (best is None or w.pos > best.pos) and text.startswith(prefix):
                        best, base = w, prefix
                if best is not None:
                    parent_id, state, pos, hashes = best.parent_id, best.state, best.pos, best.hashes[:]
            while True:
                node = None
                for n in key_lens.get(parent_id, ()):
                    key = (parent_id, text[pos : pos + n])
                    node = nodes.get(key)
                    if node is not None:
                        break
                if node is None:
                    break
                path.append(key)
                hashes.frombytes(node[_HASHES])
                parent_id, raw_state, pos = node[_ID], node[_STATE], pos + node[_CHARS]
            if path:
                state = _State(*raw_state)
            # Most recently used last, parents after their children: eviction takes leaves first.
            for key in reversed(path):
                nodes.move_to_end(key)
        finally:
            self._lock.release()
        return Walk(pos, state, hashes, parent_id, base)

    def probe(self, text: str, walked: Walk, chars: int) -> Probe | None:
        """Tokenize and hash only the ~``chars`` characters after ``walked`` (to the next safe cut), so
        that a caller can ask whether anyone holds them before paying for the rest. Caches nothing and
        leaves ``walked`` as it was (for :meth:`finish`). None when the prompt cannot be cut there."""
        pos, state, hashes, parent_id, _ = walked
        if parent_id < 0:
            return None
        cut = self._cut_at_or_after(text, pos + max(chars, 1), len(text) - self._reach - 1)
        if cut is None:
            return None
        (ids,) = self._ids([text[pos:cut]])
        tokens = [*state.leftover, *ids]
        bs = self.block_size
        digests = block_digests(tokens[: len(tokens) // bs * bs], bs, parent=state.last, algo=self.algo)
        out = hashes[:]
        out += chain(map(to_external, digests))
        return Probe(out, state.tokens + len(ids), cut)

    def finish(self, text: str, walked: Walk) -> Encoded:
        """Tokenize and hash what :meth:`walk` did not find (the costly part; runs in a thread for long
        remainders), and cache its chunks. Extends ``walked.hashes`` in place: every walk returns a
        fresh array, used by this one call."""
        pos, state, hashes, parent_id, base = walked
        if parent_id < 0:  # not enabled: one whole encode, hashed from the root
            ids = self.full_ids(text)
            return Encoded(len(ids), block_hashes(ids, self.block_size, self.algo), 0)
        reused = pos
        cuts = list(self.cuts(text, pos))
        # The piece after the last cut is what a prompt extending this one tokenizes again: one more cut
        # within _TAIL_CHUNK_CHARS of the end, so the next turn re-tokenizes only that much of this one.
        # (One cut, not a piece every _TAIL_CHUNK_CHARS: each piece costs the tokenizer call ~10 µs.)
        start = cuts[-1] if cuts else pos
        limit = len(text) - self._reach - 1
        near_end = self._cut_at_or_after(text, max(start + 1, limit - _TAIL_CHUNK_CHARS), limit)
        if near_end is not None:
            cuts.append(near_end)
        else:  # no safe cut that near the end: the finer cuts before it
            cuts += self.cuts(text, start, step=_TAIL_CHUNK_CHARS)
        bounds = [pos, *cuts, len(text)]
        pieces = [text[a:b] for a, b in pairwise(bounds)]
        # One digest pass over all the new tokens, not one per piece; each piece's chain state is read
        # off where its tokens end. The tokens go into an array, which the garbage collector does not
        # walk: a million ids in lists made each collection during a 4 MB prompt a pause of 20-180 ms
        # for every thread, the event loop's too.
        bs = self.block_size
        before = state.tokens - len(state.leftover)  # tokens (whole blocks) before the leftover
        tokens = array("q", state.leftover)
        ends: list[int] = []
        for ids in self._each_ids(pieces):
            tokens.extend(ids)
            ends.append(len(tokens))
        ends.pop()  # every piece but the last ends a chunk
        tokens.extend(self.suffix)
        digests = block_digests(tokens[: len(tokens) // bs * bs], bs, parent=state.last, algo=self.algo)
        got = chain(map(to_external, digests))
        ctx = self._reach + 2
        new: list[tuple[str, array[int], _State, int]] = []
        last, done = state.last, 0
        for a, b, stop in zip(bounds, bounds[1:], ends, strict=False):  # every piece but the last
            full = stop // bs
            if full:
                last = digests[full - 1]
            state = _State(before + stop, last, tuple(tokens[full * bs : stop]))
            new.append((text[a : b + ctx], got[done:full], state, b - a))
            done = full
        hashes += got[:done]
        chunked = Walk(bounds[-2], state, hashes[:], parent_id)
        hashes += got[done:]
        if new:
            chunked = chunked._replace(parent_id=self._insert(parent_id, new))
        if chunked.pos > _RECENT_MIN_CHARS:
            # The whole prompt, by reference (slicing a 128K-token prompt copies ~0.5 MB per turn): a
            # prompt that starts with all of it shares the text the last cut depended on (at least
            # ctx characters follow a cut). One that diverges earlier walks the trie instead.
            self._remember(text, chunked, base)
        return Encoded(before + len(tokens), hashes, reused)

    def _remember(self, prefix: str, walked: Walk, base: str | None) -> None:
        """Keep where a long prompt (``prefix``) ends its chunks, for the next turn that extends it.
        ``base``: the remembered prompt its walk started from, which it supersedes (known to be a
        prefix of it: no second comparison of ~0.5 MB per turn)."""
        key = prefix[:_RECENT_KEY_CHARS]
        with self._lock:
            recent = self._recent
            before = recent.pop(key, [])
            entries = [(p, w) for p, w in before if p is not base]
            entries.insert(0, (prefix, walked))
            del entries[_RECENT_PER_KEY:]
            recent[key] = entries
            self._recent_chars += sum(len(p) for p, _ in entries) - sum(len(p) for p, _ in before)
            while self._recent_chars > _RECENT_MAX_CHARS and recent:
                _, old = recent.popitem(last=False)
                self._recent_chars -= sum(len(p) for p, _ in old)

    def _insert(self, parent: int, new: list[tuple[str, array[int], _State, int]]) -> int:
        """Cache the new chunks under ``parent``; the last one's node id."""
        trie = self._trie
        with self._lock:
            for key_text, got, state, chars in new:
                key = (parent, key_text)
                node = trie.nodes.get(key)
                if node is None:
                    node = (trie.next_id, chars, got.tobytes(), (state.tokens, state.last, state.leftover))
                    trie.next_id += 1
                    trie.nodes[key] = node
                    trie.chars += len(key_text)
                    lens = trie.key_lens.get(parent, ())
                    if len(key_text) not in lens:
                        # A tuple, not a list: untracked by the collector like the nodes.
                        trie.key_lens[parent] = (len(key_text), *lens)[:_MAX_KEY_LENS]
                parent = node[_ID]
            while trie.chars > self.max_cached_chars and trie.nodes:
                (_, old_text), _ = trie.nodes.popitem(last=False)
                trie.chars -= len(old_text)
            if len(trie.key_lens) > 2 * len(trie.nodes) + 16:
                live = {p for p, _ in trie.nodes}
                trie.key_lens = {p: v for p, v in trie.key_lens.items() if p in live}
        return parent

    def stats(self) -> dict[str, Any]:
        return {
            "family": self.proof.family,
            "reason": self.proof.reason,
            "enabled": self.enabled,
            "native": False,
            "chunks": len(self._trie.nodes),
            "cachedChars": self._trie.chars,
        }
