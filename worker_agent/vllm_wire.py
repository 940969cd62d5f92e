"""Decoder of vLLM's KV-event wire format (all eras, see the wire-format spec §2 and §8).

Pure, no I/O. Three ZMQ frames: topic, 8-byte big-endian sequence, msgpack EventBatch.
The batch is a positional array `[ts, events]` (0.9.0) or `[ts, events, dp_rank]`; a map
batch is accepted defensively. Events are tagged arrays (<= 0.23) or tagged maps (>= 0.24).
Events are validated one by one so a bad event is reported while its neighbours still apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

U64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()


class WireFormatError(ValueError):
    """A frame or batch that cannot be decoded at all."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = "gpu"
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "gpu"
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class DecodedBatch:
    seq: int
    ts: float
    dp_rank: int | None
    events: list[EngineEvent] = field(default_factory=list)
    bad_events: list[str] = field(default_factory=list)      # why each rejected event was rejected
    unknown_events: list[str] = field(default_factory=list)  # tags we do not know (tolerated)


def normalize_hash(value: object) -> int:
    """Signed/unsigned ints -> u64; bytes -> last 8 bytes big-endian (vLLM's own int form)."""
    if isinstance(value, bool):
        raise TypeError("block hash must be int or bytes, got bool")
    if isinstance(value, int):
        return value & U64
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise TypeError("empty bytes block hash")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise TypeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hashes(value: object) -> list[int]:
    if not isinstance(value, list):
        raise TypeError("block_hashes must be a list")
    return [normalize_hash(h) for h in value]


def _medium(value: object) -> str:
    return value.lower() if isinstance(value, str) else "gpu"


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _stored(f: dict) -> BlockStored:
    tokens = f["token_ids"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise TypeError("token_ids must be a list of ints")
    block_size = f["block_size"]
    if not isinstance(block_size, int) or block_size <= 0:
        raise TypeError("block_size must be a positive int")
    parent = f.get("parent_block_hash")
    return BlockStored(_hashes(f["block_hashes"]), None if parent is None else normalize_hash(parent), tokens,
                       block_size, _opt_str(f.get("lora_name")), _medium(f.get("medium")), _opt_int(f.get("group_idx")),
                       _opt_str(f.get("kv_cache_spec_kind")))


def _removed(f: dict) -> BlockRemoved:
    return BlockRemoved(_hashes(f["block_hashes"]), _medium(f.get("medium")), _opt_int(f.get("group_idx")))


# Array-era positions after the tag (spec §2.3/§2.4). Trailing fields absent in older versions.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def decode_event(raw: object) -> EngineEvent | str:
    """An event, or the unknown tag as a string. Raises (TypeError/KeyError/ValueError) on a malformed one."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise TypeError(f"event must be a tagged array or map, got {type(raw).__name__}")
    if tag == "BlockStored":
        if isinstance(raw, list) and len(raw) < 5:
            raise ValueError(f"BlockStored array has {len(raw)} elements, needs at least 5")
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return str(tag)


def decode_frames(frames: list[bytes]) -> DecodedBatch:
    if len(frames) != 3:
        raise WireFormatError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise WireFormatError(f"sequence frame must be 8 bytes, got {len(seq_frame)}")
    return decode_payload(int.from_bytes(seq_frame, "big"), payload)


def decode_payload(seq: int, payload: bytes) -> DecodedBatch:
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"payload is not msgpack: {exc}") from exc
    if isinstance(batch, dict):  # a non-release vLLM snapshot encoded the batch as a map
        ts, events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    else:
        raise WireFormatError("payload must be an EventBatch array [ts, events(, rank)]")
    if not isinstance(events, list) or not isinstance(ts, (int, float)):
        raise WireFormatError("EventBatch must hold a numeric ts and a list of events")
    out = DecodedBatch(seq=seq, ts=float(ts), dp_rank=_opt_int(rank))
    for raw in events:
        try:
            event = decode_event(raw)
        except (TypeError, KeyError, ValueError) as exc:
            out.bad_events.append(f"{type(exc).__name__}: {exc}")
            continue
        if isinstance(event, str):
            out.unknown_events.append(event)
        else:
            out.events.append(event)
    return out
