"""Block hashes exactly as vLLM computes them, and an approximate character-block fallback.

vLLM 0.32.0 with ``--prefix-caching-hash-algo sha256`` (the default) hashes each *full* block of
token ids, chained to its parent:

    NONE = sha256(pickle.dumps("vllm-none-hash", protocol=5))
    h_i  = sha256(pickle.dumps((h_{i-1} or NONE, tuple(tokens_i), extra_keys_i), protocol=5))

and publishes ``int.from_bytes(h_i, "big") & (2**64 - 1)`` in KV events. ``sha256_cbor`` is the same chain
with ``cbor2.dumps(x, canonical=True)`` in place of pickle (NONE = sha256(cbor("vllm-none-hash"))): vLLM
seeds NONE from the fixed string for both cryptographic algorithms unless PYTHONHASHSEED is set. The full 32-byte digest is
what chains, so a router must keep it while walking a prompt; the index only stores the 64-bit form.
The xxhash variants are seeded per process unless PYTHONHASHSEED is set, so they are not reproducible
from outside the engine; we refuse them instead of routing on hashes that never match.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import cbor2

from kvstrata.api.router_config import DEFAULT_HASH_ALGO, HASH_ALGOS, HashAlgo
from kvstrata.router import native

_MASK64 = (1 << 64) - 1
# vLLM's DEFAULT_NONE_HASH_SEED: the first block's parent for cryptographic algorithms.
_NONE_SEED = "vllm-none-hash"
SUPPORTED_ALGOS: tuple[HashAlgo, ...] = HASH_ALGOS


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)  # pickle.HIGHEST_PROTOCOL on Python 3.11, as vLLM uses


def _cbor_bytes(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


_SERIALIZERS: dict[str, Callable[[Any], bytes]] = {"sha256": _pickle_bytes, "sha256_cbor": _cbor_bytes}
NONE_HASHES: dict[str, bytes] = {a: hashlib.sha256(f(_NONE_SEED)).digest() for a, f in _SERIALIZERS.items()}
NONE_HASH: bytes = NONE_HASHES["sha256"]


def chain(values: Iterable[int] = ()) -> array[int]:
    """A prompt's 64-bit block hashes as the router passes them around: an ``array('Q')``, which the
    native index reads in place (a list of 64-bit Python ints costs ~40 ns per block to convert) and
    which concatenates and slices by memcpy."""
    return array("Q", values)


class UnsupportedHashAlgo(ValueError):
    pass


def check_algo(algo: str) -> None:
    if algo not in _SERIALIZERS:
        raise UnsupportedHashAlgo(
            f"hash algorithm {algo!r} cannot be reproduced outside the engine "
            f"(supported: {', '.join(SUPPORTED_ALGOS)}); run engines with --prefix-caching-hash-algo sha256"
        )


def to_external(digest: bytes) -> int:
    """The 64-bit value vLLM puts in KV events for a block digest."""
    return int.from_bytes(digest, "big") & _MASK64


def normalize_hash(value: int | bytes) -> int:
    """KV events carry ints (0.32.0) or raw digests (some builds/peers): map both to the 64-bit int."""
    if isinstance(value, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(value), "big") & _MASK64
    return int(value) & _MASK64


# Block sizes up to this are digested natively (a block's pickle stays within one pickle frame).
_NATIVE_MAX_BLOCK = 4096


def block_digests(
    tokens: Sequence[int], block_size: int, parent: bytes | None = None, algo: HashAlgo = DEFAULT_HASH_ALGO
) -> list[bytes]:
    """Chained digests of every full block of ``tokens`` (a partial tail block is not hashed): natively,
    with the GIL released (:func:`py_block_digests` is the definition it is tested against)."""
    check_algo(algo)
    if 0 < block_size <= _NATIVE_MAX_BLOCK:
        return native.block_digests(tokens, block_size, parent or NONE_HASHES[algo], algo)
    return py_block_digests(tokens, block_size, parent, algo)


def py_block_digests(
    tokens: Sequence[int], block_size: int, parent: bytes | None = None, algo: HashAlgo = DEFAULT_HASH_ALGO
) -> list[bytes]:
    """:func:`block_digests` as vLLM writes it: ``sha256(serialize((parent, tuple(block), None)))``."""
    check_algo(algo)
    prev = parent or NONE_HASHES[algo]
    out: list[bytes] = []
    dumps, sha = _SERIALIZERS[algo], hashlib.sha256
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = sha(dumps((prev, tuple(tokens[start : start + block_size]), None))).digest()
        out.append(prev)
    return out


def block_hashes(tokens: Sequence[int], block_size: int, algo: HashAlgo = DEFAULT_HASH_ALGO) -> array[int]:
    """The 64-bit block hashes vLLM would publish for a prompt of ``tokens``."""
    return chain(map(to_external, block_digests(tokens, block_size, algo=algo)))


def char_block_hashes(text: str, chunk_chars: int, max_blocks: int | None = None) -> array[int]:
    """Approximate prefix identity when token ids are unavailable: chained hashes of character chunks.

    They never match engine hashes; they only let the router remember where it sent a prefix."""
    out = chain()
    prev = b"kvstrata-char-blocks"
    limit = len(text) - chunk_chars + 1
    for start in range(0, max(limit, 0), chunk_chars):
        if max_blocks is not None and len(out) >= max_blocks:
            break
        prev = hashlib.blake2b(prev + text[start : start + chunk_chars].encode(), digest_size=16).digest()
        out.append(to_external(prev))
    return out
