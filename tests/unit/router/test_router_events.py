"""KV-event decoding against the recorded vLLM 0.32.0 stream, in map and positional-array forms."""

from __future__ import annotations

import msgspec
import pytest

from kvstrata.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    UnknownEvent,
    decode_event,
    decode_frames,
    decode_payload,
)
from kvstrata.router.hashing import normalize_hash

enc = msgspec.msgpack.Encoder()


def test_recorded_stream_decodes_with_the_recorded_counts(
    kv_messages: list[tuple[bytes, int, bytes]],
) -> None:
    stored = removed = 0
    seqs = []
    for topic, seq, payload in kv_messages:
        batch = decode_frames([topic, seq.to_bytes(8, "big"), payload])
        seqs.append(batch.seq)
        assert batch.dp_rank == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += 1
                assert ev.medium == "GPU"
                assert ev.block_size == 32
                # token_ids hold every token of the stored (full) blocks.
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert all(0 <= h < 2**64 for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                removed += len(ev.block_hashes)
    # FACTS.md: 22 messages, 21 BlockStored events; seq numbers consecutive.
    assert len(kv_messages) == 22
    assert stored == 21
    assert removed > 300
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def _as_array(ev: dict) -> list:
    """The positional (array_like, tag first) encoding older vLLM used."""
    if ev["type"] == "BlockStored":
        keys = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    elif ev["type"] == "BlockRemoved":
        keys = ("block_hashes", "medium")
    else:
        keys = ()
    return [ev["type"], *(ev[k] for k in keys)]


def test_array_form_decodes_to_the_same_events(kv_messages: list[tuple[bytes, int, bytes]]) -> None:
    for _, seq, payload in kv_messages:
        ts, events, rank = msgspec.msgpack.decode(payload)
        as_arrays = enc.encode([ts, [_as_array(e) for e in events], rank])
        assert decode_payload(seq, as_arrays) == decode_payload(seq, payload)


def test_hashes_as_bytes_are_normalised_to_the_published_int() -> None:
    digest = bytes(range(32))
    ev = decode_event({"type": "BlockRemoved", "block_hashes": [digest, 7], "medium": "CPU"})
    assert ev == BlockRemoved((int.from_bytes(digest, "big") & (2**64 - 1), 7), "CPU")
    assert normalize_hash(digest) == int.from_bytes(digest[-8:], "big")


def test_cleared_unknown_and_missing_medium() -> None:
    assert decode_event({"type": "AllBlocksCleared"}) == AllBlocksCleared()
    assert decode_event(["AllBlocksCleared"]) == AllBlocksCleared()
    assert decode_event({"type": "SomethingNew", "x": 1}) == UnknownEvent("SomethingNew")
    ev = decode_event({"type": "BlockRemoved", "block_hashes": [1], "medium": None})
    assert isinstance(ev, BlockRemoved) and ev.medium == "GPU"


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv-events", b"\x00" * 7, b"\x90"],  # short seq frame
        [b"kv-events", (1).to_bytes(8, "big"), b"\xc1"],  # invalid msgpack
        [b"kv-events", (1).to_bytes(8, "big"), enc.encode({"a": 1})],  # not [ts, events, rank]
        [b"kv-events", (1).to_bytes(8, "big"), enc.encode([0.0, [{"type": "BlockStored"}], 0])],  # no fields
        [b"kv-events", (1).to_bytes(8, "big"), enc.encode([0.0, [42], 0])],  # event is not a map/array
        [b"only-one-frame"],
    ],
)
def test_malformed_messages_raise_a_decode_error(frames: list[bytes]) -> None:
    with pytest.raises(EventDecodeError):
        decode_frames(frames)


def test_replay_frames_with_empty_delimiter(kv_messages: list[tuple[bytes, int, bytes]]) -> None:
    topic, seq, payload = kv_messages[0]
    batch = decode_frames([b"", topic, seq.to_bytes(8, "big"), payload])
    assert batch.seq == seq and len(batch.events) == 1
