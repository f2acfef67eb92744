"""Decode vLLM KV-event messages into small typed events.

Wire format (vLLM 0.32.0, distributed/kv_events.py): ZMQ frames ``[topic, seq (8-byte big-endian),
payload]``; payload is msgpack ``[ts, [events...], data_parallel_rank]``. Each event is a map with a
``type`` tag in 0.32.0; older vLLM (and some peers) send positional arrays with the tag first. Both are
accepted. Unknown event types are skipped (counted by the caller), never fatal: an engine upgrade must
not take the router down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvstrata.router.hashing import normalize_hash

MEDIA = ("GPU", "CPU", "STORAGE")
_decoder = msgspec.msgpack.Decoder()

# Positional field order of the array form (msgspec array_like, tag first) in vLLM ≤ 0.10.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


class EventDecodeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    type: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _medium(value: Any) -> str:
    # None means "the engine's own KV cache": vLLM before tiering did not set the field.
    if value is None:
        return "GPU"
    medium = str(value).upper()
    return medium if medium in MEDIA else "GPU"


def _hashes(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list | tuple):
        raise EventDecodeError(f"block_hashes must be a list, got {type(values).__name__}")
    return tuple(normalize_hash(v) for v in values)


def _as_map(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag, rest = raw[0], raw[1:]
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        return {"type": tag, **dict(zip(fields, rest, strict=False))}
    raise EventDecodeError(f"event must be a map or a tagged array, got {type(raw).__name__}")


def decode_event(raw: Any) -> KVEvent:
    ev = _as_map(raw)
    kind = ev.get("type")
    try:
        if kind == "BlockStored":
            parent = ev.get("parent_block_hash")
            return BlockStored(
                block_hashes=_hashes(ev["block_hashes"]),
                parent_block_hash=None if parent is None else normalize_hash(parent),
                token_ids=tuple(ev.get("token_ids") or ()),
                block_size=int(ev["block_size"]),
                medium=_medium(ev.get("medium")),
                lora_id=ev.get("lora_id"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_hashes(ev["block_hashes"]), medium=_medium(ev.get("medium")))
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"malformed {kind} event: {exc}") from exc
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(type=str(kind))


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    try:
        msg = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(msg, list | tuple) or len(msg) < 2 or not isinstance(msg[1], list | tuple):
        raise EventDecodeError("payload must be [ts, [events], dp_rank]")
    ts = float(msg[0])
    rank = msg[2] if len(msg) > 2 else None
    return EventBatch(seq=seq, ts=ts, events=tuple(decode_event(e) for e in msg[1]), dp_rank=rank)


def decode_frames(frames: list[bytes]) -> EventBatch:
    """``[topic, seq, payload]`` from the PUB socket (or ``[b"", topic, seq, payload]`` from replay)."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    return decode_payload(decode_seq(frames[1]), frames[2])
