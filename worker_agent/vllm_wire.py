"""Decoder of vLLM's KV-event wire format, every era (wire-format spec §1.2, §2, §8). Pure, no I/O.

A live message is three ZMQ frames: topic, 8-byte big-endian unsigned sequence, msgpack
EventBatch. The batch is a positional array `[ts, events]` (0.9.0) or `[ts, events, dp_rank]`
(0.9.1+); a map batch `{"ts", "events", "data_parallel_rank"}` is accepted defensively (§2.11).
Events are tagged arrays `[tag, field, ...]` (0.9.0-0.23, fixed length per version: BlockStored
6/7/8/9/10/12 elements, BlockRemoved 2/3/4) or tagged maps `{"type": tag, ...}` (0.24+; unknown
keys ignored).

Frame-level problems raise a `WireFormatError` subclass. Event-level problems never do: a batch
is first decoded in one typed msgspec pass (the fast path, one C call per batch); if any event in
it does not fit, the batch is decoded again event by event, so a malformed event is reported in
`DecodedBatch.bad_events` and an unknown tag in `DecodedBatch.unknown_events` while the events
around them are kept.

Block hashes are normalised to u64 ints: signed or unsigned ints -> `h & (2**64 - 1)`;
bytes -> last 8 bytes big-endian (the number vLLM's default int form carries, §2.8).
"""

from __future__ import annotations

from typing import Any

import msgspec

U64 = (1 << 64) - 1
TOPIC, SEQ, PAYLOAD = 0, 1, 2  # frame positions


# ----------------------------------------------------------------------------- errors


class WireFormatError(ValueError):
    """A ZMQ message that cannot be decoded at all (the whole batch is lost)."""


class FrameCountError(WireFormatError):
    """Not the three frames (topic, seq, payload)."""


class SequenceFrameError(WireFormatError):
    """The sequence frame is not 8 bytes."""


class PayloadError(WireFormatError):
    """The payload is not msgpack (garbage or truncated)."""


class BatchShapeError(PayloadError):
    """The payload is msgpack but not an EventBatch `[ts, events(, dp_rank)]`."""


class EventError(ValueError):
    """One event that cannot be decoded (reported per event, never raised out of decode_payload)."""


class UnknownEventError(EventError):
    """A well-formed event with a tag we do not know (tolerated: skipped and counted)."""

    def __init__(self, tag: str) -> None:
        super().__init__(f"unknown event type {tag!r}")
        self.tag = tag


# ----------------------------------------------------------------------------- decoded events


class BlockStored(msgspec.Struct, gc=False):
    """Full blocks inserted into the engine's prefix cache, in chain order."""

    block_hashes: list[int]         # u64, one per full block
    parent_block_hash: int | None   # u64 hash of the block before block_hashes[0]; None = first block of the prompt
    token_ids: list[int]            # tokens of the stored range (len >= len(block_hashes) * block_size)
    block_size: int
    lora_name: str | None = None
    medium: str = "gpu"             # lower-cased; None on the wire -> "gpu"
    group_idx: int | None = None    # KV-cache group (vLLM 0.20+)
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", ... (vLLM 0.22+)


class BlockRemoved(msgspec.Struct, gc=False):
    block_hashes: list[int]
    medium: str = "gpu"
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, gc=False):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class DecodedBatch(msgspec.Struct, gc=False):
    seq: int
    ts: float
    dp_rank: int | None
    events: list[EngineEvent] = msgspec.field(default_factory=list)
    bad_events: list[str] = msgspec.field(default_factory=list)      # "event <i>: <why>" per rejected event
    unknown_events: list[str] = msgspec.field(default_factory=list)  # tags we do not know (tolerated)


# ----------------------------------------------------------------------------- wire structs (private)

_Hash = int | bytes


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    # Positions of spec §2.3. Missing trailing fields (older versions) take the defaults;
    # extra trailing elements (newer versions) are ignored by msgspec.
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None                 # deprecated adapter int id: ignored
    medium: str | None = None           # 0.10.2+
    lora_name: str | None = None        # 0.14+
    extra_keys: Any = None              # 0.17+
    group_idx: int | None = None        # 0.20+
    kv_cache_spec_kind: str | None = None  # 0.22+


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None           # 0.10.2+
    group_idx: int | None = None        # 0.20+


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    # Only the keys we keep; every other key (lora_id, extra_keys, locality, ...) is ignored.
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None     # always written by vLLM (no default): required
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


_ArrayEvent = _StoredArray | _RemovedArray | _ClearedArray
_MapEvent = _StoredMap | _RemovedMap | _ClearedMap


class _ArrayBatchOfArrays(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: Any = None


class _ArrayBatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: Any = None


class _ArrayBatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


class _MapBatchRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


_dec_array_events = msgspec.msgpack.Decoder(_ArrayEvent)
_dec_map_events = msgspec.msgpack.Decoder(_MapEvent)
_dec_any = msgspec.msgpack.Decoder()
_dec_batch_raw = msgspec.msgpack.Decoder(_ArrayBatchRaw)
_dec_map_batch_raw = msgspec.msgpack.Decoder(_MapBatchRaw)
_FAST_DECODERS = {"map": msgspec.msgpack.Decoder(_ArrayBatchOfMaps), "array": msgspec.msgpack.Decoder(_ArrayBatchOfArrays)}
_fast_order = ["map", "array"]  # the era that decoded last is tried first


def _is_msgpack_map(first_byte: int) -> bool:
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


# ----------------------------------------------------------------------------- normalisation


def normalize_hash(value: int | bytes) -> int:
    """Signed/unsigned ints -> u64; bytes -> last 8 bytes big-endian unsigned (vLLM's own int form)."""
    if type(value) is int:
        return value & U64
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise EventError("empty bytes block hash")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise EventError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hashes(values: list[int | bytes]) -> list[int]:
    for h in values:  # common case (vLLM >= 0.10.2 default): already u64 ints, keep the list as decoded
        if type(h) is not int or h < 0:
            return [normalize_hash(h) for h in values]
    return values  # type: ignore[return-value]


def _medium(value: str | None) -> str:
    return "gpu" if value is None else value.lower()


def _convert(w: Any) -> EngineEvent:
    t = type(w)
    if t is _StoredMap or t is _StoredArray:
        if w.block_size <= 0:
            raise EventError(f"block_size must be positive, got {w.block_size}")
        parent = w.parent_block_hash
        return BlockStored(_hashes(w.block_hashes), None if parent is None else normalize_hash(parent), w.token_ids,
                           w.block_size, w.lora_name, _medium(w.medium), w.group_idx, w.kv_cache_spec_kind)
    if t is _RemovedMap or t is _RemovedArray:
        return BlockRemoved(_hashes(w.block_hashes), _medium(w.medium), w.group_idx)
    return AllBlocksCleared()


# ----------------------------------------------------------------------------- public API


def decode_event(buf: bytes | msgspec.Raw) -> EngineEvent:
    """One msgpack-encoded event (array or map era). Raises EventError / UnknownEventError."""
    try:
        first = memoryview(buf)[0]
    except IndexError:
        raise EventError("empty event") from None
    try:
        wire = (_dec_map_events if _is_msgpack_map(first) else _dec_array_events).decode(buf)
    except msgspec.ValidationError as exc:
        tag = _tag_of(buf)
        if isinstance(tag, str) and tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            raise UnknownEventError(tag) from None
        raise EventError(str(exc)) from None
    except msgspec.DecodeError as exc:  # pragma: no cover - a Raw slice of a decoded batch is valid msgpack
        raise EventError(f"not msgpack: {exc}") from None
    return _convert(wire)


def _tag_of(buf: bytes | msgspec.Raw) -> object:
    try:
        raw = _dec_any.decode(buf)
    except msgspec.DecodeError:  # pragma: no cover
        return None
    if isinstance(raw, dict):
        return raw.get("type")
    if isinstance(raw, list) and raw:
        return raw[0]
    return None


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a live message; raises FrameCountError / SequenceFrameError."""
    if len(frames) != 3:
        raise FrameCountError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    seq_frame = frames[SEQ]
    if len(seq_frame) != 8:
        raise SequenceFrameError(f"sequence frame must be 8 bytes, got {len(seq_frame)}")
    return frames[TOPIC], int.from_bytes(seq_frame, "big"), frames[PAYLOAD]


def decode_frames(frames: list[bytes]) -> DecodedBatch:
    """Decode one live ZMQ message (3 frames). Raises a WireFormatError subclass if the message is unusable."""
    _, seq, payload = split_frames(frames)
    return decode_payload(seq, payload)


def decode_payload(seq: int, payload: bytes) -> DecodedBatch:
    """Decode one msgpack EventBatch. Raises PayloadError / BatchShapeError; bad events are reported, not raised."""
    if not payload:
        raise PayloadError("payload is not msgpack: empty")
    if _is_msgpack_map(payload[0]):  # a non-release vLLM snapshot encoded the batch as a map
        return _decode_slow(seq, payload, _dec_map_batch_raw)
    for era in _fast_order:
        try:
            batch = _FAST_DECODERS[era].decode(payload)
        except msgspec.ValidationError:
            continue  # other era, a bad/unknown event, or a bad batch: find out below
        except msgspec.DecodeError as exc:
            raise PayloadError(f"payload is not msgpack (garbage or truncated): {exc}") from None
        if era != _fast_order[0]:
            _fast_order.reverse()
        try:
            events = [_convert(w) for w in batch.events]
        except EventError:
            break  # e.g. block_size 0: the slow path reports which event
        return DecodedBatch(seq, batch.ts, _rank(batch.data_parallel_rank), events)
    return _decode_slow(seq, payload, _dec_batch_raw)


def _decode_slow(seq: int, payload: bytes, decoder: msgspec.msgpack.Decoder) -> DecodedBatch:
    try:
        batch = decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise BatchShapeError(f"payload is not an EventBatch [ts, events(, dp_rank)]: {exc}") from None
    except msgspec.DecodeError as exc:
        raise PayloadError(f"payload is not msgpack (garbage or truncated): {exc}") from None
    out = DecodedBatch(seq, batch.ts, _rank(batch.data_parallel_rank))
    for i, raw in enumerate(batch.events):
        try:
            out.events.append(decode_event(raw))
        except UnknownEventError as exc:
            out.unknown_events.append(exc.tag)
        except EventError as exc:
            out.bad_events.append(f"event {i}: {exc}")
    return out


def _rank(value: object) -> int | None:
    return value if type(value) is int else None
