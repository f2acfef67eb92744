"""The router's block hashes reproduce the hashes vLLM 0.32.0 published in the recorded stream."""

from __future__ import annotations

import pytest

from kvstrata.router.events import BlockStored, decode_payload
from kvstrata.router.hashing import (
    UnsupportedHashAlgo,
    block_digests,
    block_hashes,
    char_block_hashes,
    check_algo,
    to_external,
)


def _stored(kv_messages: list[tuple[bytes, int, bytes]]) -> list[BlockStored]:
    out = []
    for _, seq, payload in kv_messages:
        out += [e for e in decode_payload(seq, payload).events if isinstance(e, BlockStored)]
    return out


def test_every_recorded_block_hash_is_reproduced(kv_messages: list[tuple[bytes, int, bytes]]) -> None:
    # Full digests by their published 64-bit value, so events with a parent can chain from it.
    digests: dict[int, bytes] = {}
    checked = with_parent = 0
    for ev in _stored(kv_messages):
        parent = None
        if ev.parent_block_hash is not None:
            parent = digests[ev.parent_block_hash]  # the parent was stored by an earlier event
            with_parent += 1
        got = block_digests(ev.token_ids, ev.block_size, parent)
        assert [to_external(d) for d in got] == list(ev.block_hashes)
        digests.update({to_external(d): d for d in got})
        checked += len(got)
    assert checked > 500
    assert with_parent >= 5


def test_prompt_hashes_equal_the_engine_prefix(kv_messages: list[tuple[bytes, int, bytes]]) -> None:
    ev = next(e for e in _stored(kv_messages) if e.parent_block_hash is None)
    # A prompt of the stored tokens plus a partial tail: the tail block is not hashed.
    tokens = [*ev.token_ids, 5, 6, 7]
    assert list(block_hashes(tokens, ev.block_size)) == list(ev.block_hashes)
    assert len(block_hashes(tokens[: ev.block_size - 1], ev.block_size)) == 0


def test_char_blocks_are_chained_and_prefix_stable() -> None:
    a = char_block_hashes("x" * 100 + "tail-a", 10)
    b = char_block_hashes("x" * 100 + "tail-b", 10)
    assert len(a) == 10 and a == b  # only full chunks; equal prefixes hash equally
    assert len(set(a)) == 10  # chaining: equal chunks at different positions differ
    assert len(char_block_hashes("short", 10)) == 0


def test_unreproducible_algorithms_are_refused() -> None:
    check_algo("sha256")
    with pytest.raises(UnsupportedHashAlgo, match="sha256"):
        check_algo("xxhash")


def test_sha256_cbor_is_reproduced_and_xxhash_refused() -> None:
    check_algo("sha256_cbor")
    with pytest.raises(UnsupportedHashAlgo, match="xxhash_cbor"):
        check_algo("xxhash_cbor")
