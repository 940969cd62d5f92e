"""What vLLM, SGLang and TensorRT-LLM's streaming publisher share on the wire (docs/wire-formats.md#live-message-frames,
docs/wire-formats.md#msgspec-encoding-rules): three ZMQ frames (topic, 8-byte big-endian unsigned sequence, msgpack
batch), a batch that is a positional array `[ts, events(, rank)]`, and events that are tagged arrays or
tagged maps.

`BatchDecoder` is the decoding strategy every dialect uses: one typed msgspec decode of the whole
batch (the fast path, one C call per batch; the era that decoded last is tried first); if any
event in it does not fit, the batch is decoded again event by event, so a malformed event is
reported in `DecodedBatch.bad_events`, an unknown tag in `DecodedBatch.unknown_events` and an event
with fields the dialect does not declare (a newer release) in `DecodedBatch.unknown_fields`, while
the events around them are kept. The wire structs forbid unknown fields, which is what sends such
an event to the per-event path, where they are stripped and counted (`unknown_fields`). An event
that is not msgpack msgspec can read (a string that is not UTF-8, nesting past the recursion limit)
is a bad event too: its neighbours are found without it (`msgpack_scan`).
Frame-level problems raise a `WireFormatError` subclass, and so does a batch claiming more events
than `max_events` (`OversizeBatchError`, before anything is allocated for them): nothing else
escapes a decode, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvroute.worker_agent import msgpack_scan
from kvroute.worker_agent.events import DecodedBatch, EngineEvent, EventError, UnknownEventError
from kvroute.worker_agent.limits import DEFAULT_MAX_BATCH_EVENTS, SCAN_MAX_BYTES
from kvroute.worker_agent.unknown_fields import strip_unknown_fields

TOPIC, SEQ, PAYLOAD = 0, 1, 2  # frame positions
EVENT_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})  # every msgpack dialect's tags


class WireFormatError(ValueError):
    """A ZMQ message that cannot be decoded at all (the whole batch is lost)."""


class FrameCountError(WireFormatError):
    """Not the three frames (topic, seq, payload)."""


class SequenceFrameError(WireFormatError):
    """The sequence frame is not 8 bytes."""


class PayloadError(WireFormatError):
    """The payload is not msgpack (garbage or truncated)."""


class BatchShapeError(PayloadError):
    """The payload is msgpack but not an EventBatch `[ts, events(, rank)]`."""


class OversizeBatchError(PayloadError):
    """The batch claims more events than the decoder's limit (dropped before they are taken apart)."""


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a live message; raises FrameCountError / SequenceFrameError."""
    if len(frames) != 3:
        raise FrameCountError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    seq_frame = frames[SEQ]
    if len(seq_frame) != 8:
        raise SequenceFrameError(f"sequence frame must be 8 bytes, got {len(seq_frame)}")
    return frames[TOPIC], int.from_bytes(seq_frame, "big"), frames[PAYLOAD]


def is_msgpack_map(first_byte: int) -> bool:
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


class ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared", forbid_unknown_fields=True, gc=False):
    """AllBlocksCleared, array era: `["AllBlocksCleared"]` (no fields in any engine)."""


class ClearedMap(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", forbid_unknown_fields=True, gc=False):
    """AllBlocksCleared, map era: `{"type": "AllBlocksCleared"}`."""


def typed_batch_decoder(event_type: object) -> msgspec.msgpack.Decoder:
    """Fast-path decoder of a positional batch `[ts, events, rank]` whose events are `event_type`."""
    batch = msgspec.defstruct(
        "TypedBatch", [("ts", float), ("events", list[event_type]), ("rank", Any, None)], array_like=True, gc=False
    )
    return msgspec.msgpack.Decoder(batch)


class RawArrayBatch(msgspec.Struct, array_like=True, gc=False):
    """Any dialect's batch with its events left undecoded (the slow path)."""

    ts: float
    events: list[msgspec.Raw]
    rank: Any = None


_dec_any = msgspec.msgpack.Decoder()
_dec_ts = msgspec.msgpack.Decoder(float)


class BatchDecoder:
    """One dialect's payload decoder.

    `array_events` / `map_events`: the tagged-union types of its array-era and map-era events (wire
    structs with forbid_unknown_fields). `convert`: wire struct -> engine-neutral event (raises
    EventError). `map_batch`: a decoder for a batch encoded as a map, or None if the dialect never
    sends one.
    """

    def __init__(
        self,
        name: str,
        *,
        array_events: Any,
        map_events: Any,
        convert: Callable[[Any], EngineEvent],
        map_batch: msgspec.msgpack.Decoder | None = None,
        known_tags: frozenset[str] = EVENT_TAGS,
    ) -> None:
        self.name = name
        self._fast = [typed_batch_decoder(map_events), typed_batch_decoder(array_events)]
        self._array_type, self._map_type = array_events, map_events
        self._array_event = msgspec.msgpack.Decoder(array_events)
        self._map_event = msgspec.msgpack.Decoder(map_events)
        self._known_tags, self._convert = known_tags, convert
        self._raw_batch = msgspec.msgpack.Decoder(RawArrayBatch)
        self._map_batch = map_batch

    def decode_frames(self, frames: list[bytes], max_events: int = DEFAULT_MAX_BATCH_EVENTS) -> DecodedBatch:
        """One live ZMQ message (3 frames). Raises a WireFormatError subclass if the message is unusable."""
        _, seq, payload = split_frames(frames)
        return self.decode_payload(seq, payload, max_events)

    def decode_payload(self, seq: int, payload: bytes, max_events: int = DEFAULT_MAX_BATCH_EVENTS) -> DecodedBatch:
        """One msgpack batch. Raises PayloadError / BatchShapeError / OversizeBatchError; bad events are
        reported, not raised."""
        if not payload:
            raise PayloadError("payload is not msgpack: empty")
        if len(payload) > max_events:  # every event takes a byte at least: only a longer payload can hold more
            claimed = msgpack_scan.claimed_events(payload)
            if claimed is not None and claimed > max_events:
                raise OversizeBatchError(f"batch claims {claimed} events, over the limit of {max_events}")
        if is_msgpack_map(payload[0]):
            if self._map_batch is None:
                raise BatchShapeError(f"payload is not a {self.name} EventBatch [ts, events, rank]: a map")
            return self._decode_slow(seq, payload, self._map_batch)
        fast = self._fast
        for i, decoder in enumerate(fast):
            try:
                batch = decoder.decode(payload)
            except msgspec.ValidationError:
                continue  # the other era, a bad/unknown event, unknown fields, or a bad batch: find out below
            except (msgspec.DecodeError, RecursionError):
                break  # garbage, or one event msgspec cannot read (not UTF-8, too deep): find out below
            if i:
                fast.insert(0, fast.pop(i))
            try:
                events = [self._convert(w) for w in batch.events]
            except EventError:
                break  # e.g. block_size 0: the slow path reports which event
            return DecodedBatch(seq, batch.ts, _rank(batch.rank), events)
        return self._decode_slow(seq, payload, self._raw_batch)

    def decode_event(self, buf: bytes | msgspec.Raw) -> EngineEvent:
        """One msgpack-encoded event (tagged array or tagged map); unknown fields are dropped.
        Raises EventError / UnknownEventError."""
        return self._decode_event(buf)[0]

    def _decode_event(self, buf: bytes | msgspec.Raw) -> tuple[EngineEvent, list[str]]:
        """(event, paths of the unknown fields it carried)."""
        try:
            first = memoryview(buf)[0]
        except IndexError:
            raise EventError("empty event") from None
        is_map = is_msgpack_map(first)
        try:
            return self._convert((self._map_event if is_map else self._array_event).decode(buf)), []
        except msgspec.ValidationError as exc:
            error = str(exc)
        except msgspec.DecodeError as exc:  # e.g. a string that is not UTF-8 (a Raw slice is not checked)
            raise EventError(f"not msgpack: {exc}") from None
        except RecursionError:
            raise EventError("nested too deeply") from None
        try:
            raw = _dec_any.decode(buf)
        except msgspec.DecodeError as exc:
            raise EventError(f"not msgpack: {exc}") from None
        except RecursionError:
            raise EventError(f"nested too deeply ({error})") from None
        tag = _tag_of(raw)
        if isinstance(tag, str) and tag not in self._known_tags:
            raise UnknownEventError(tag)
        union = self._map_type if is_map else self._array_type
        cleaned, unknown = strip_unknown_fields(raw, union)
        if not unknown:
            raise EventError(error)
        try:
            return self._convert(msgspec.convert(cleaned, union)), unknown
        except msgspec.ValidationError as exc:
            raise EventError(str(exc)) from None
        except RecursionError:
            raise EventError("nested too deeply") from None

    def _decode_slow(self, seq: int, payload: bytes, decoder: msgspec.msgpack.Decoder) -> DecodedBatch:
        try:
            batch = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            raise BatchShapeError(f"payload is not an EventBatch [ts, events(, rank)]: {exc}") from None
        except msgspec.DecodeError as exc:
            raise PayloadError(f"payload is not msgpack (garbage or truncated): {exc}") from None
        except RecursionError:
            batch = self._scan(payload)
        out = DecodedBatch(seq, batch.ts, _rank(batch.rank))
        for i, raw in enumerate(batch.events):
            try:
                event, unknown = self._decode_event(raw)
                out.events.append(event)
                if unknown:
                    out.unknown_fields.append(f"event {i}: {', '.join(unknown)}")
            except UnknownEventError as exc:
                out.unknown_events.append(exc.tag)
            except EventError as exc:
                out.bad_events.append(f"event {i}: {exc}")
        return out

    def _scan(self, payload: bytes) -> RawArrayBatch:
        """The batch's events as slices, found without msgspec (something in it nests past the recursion limit)."""
        if len(payload) > SCAN_MAX_BYTES:
            raise PayloadError(f"payload nests too deeply to decode ({len(payload)} bytes)")
        try:
            ts, events, rank = msgpack_scan.split_batch(payload)
            return RawArrayBatch(
                _dec_ts.decode(ts), [msgspec.Raw(e) for e in events], _dec_any.decode(rank) if rank is not None else None
            )
        except msgpack_scan.ScanError as exc:
            raise PayloadError(f"payload is not msgpack (garbage or truncated): {exc}") from None
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            raise BatchShapeError(f"payload is not an EventBatch [ts, events(, rank)]: {exc}") from None


def _tag_of(raw: object) -> object:
    if isinstance(raw, dict):
        return raw.get("type")
    if isinstance(raw, list) and raw:
        return raw[0]
    return None


def _rank(value: object) -> int | None:
    return value if type(value) is int else None
