"""TensorRT-LLM's pull-path KV events (`POST /kv_cache_events` on trtllm-serve, docs/wire-formats.md#tensorrt-llm-pull-path-json)
-> engine-neutral events, per attention-DP rank. Pure: `TrtllmEventConverter.feed(body)` takes one
response body and returns what to do, in order.

The body is a JSON array drained from the engine's queue since the last call:
`{"event_id", "data": {"type": "created" | "stored" | "removed" | "updated", ...}, "window_size",
"attention_dp_rank"?, "layer_group_id"?, "hash_algo"?}`. Decoded with msgspec (64-bit safe: hashes
are uint64 up to 2**64-1); one typed decode per body, per-event decoding only when something in it
does not fit (a bad event is counted, its neighbours apply; unknown types are counted and skipped;
unknown fields are counted and dropped, the event applies). Elements msgspec cannot take apart (a
lone surrogate escape, nesting past the recursion limit) are found by `json_scan`. `feed` raises
`BodyError` and nothing else; a body with more events than `max_events` is refused before they are
decoded (`OversizeBodyError`).

- Hashes: uint64 ints (`v1_block_key`, `v2_sha256_64`) or 64-hex strings (`v2_sha256`): opaque ids.
- `stored`: block i's parent is block i-1, the first block's is `parent_hash`. Each block carries its
  own tokens, so a run of equal-sized blocks becomes one BlockStored with that size; a trailing
  smaller block is a partial block, which the resolver holds without a key (and whose later
  removal it suppresses). A token whose id is a 64-hex string (multimodal digest, KV-cache manager
  V2), a non-zero `token_extra_id` or non-empty `mm_keys` mark content a text router cannot match:
  the chain stops there. Per block `lora_id` / `cache_salt` (newer builds) name the namespace;
  older builds carry neither, so salted prompts are keyed as unsalted.
- `window_size`: sliding-window layers publish their own streams. The widest window of the
  `created` events is the full-attention one; other windows are dropped (counted). Before any
  `created` event is seen, the widest window seen so far stands in.
- `removed`: removals. `updated` (cache level / priority changes): counted and ignored, so every
  block counts as on the GPU tier. `layer_group_id` -> the event's KV group.
- `event_id` must grow by one per rank. A jump is a gap, and the pull path has no replay: the
  rank's state is unknown -> reset. Going back means the engine restarted -> reset. The first id
  seen above 0 means we joined late (nothing to reset, counted). Ranks are attention-DP ranks;
  events of a rank this agent does not serve are counted and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any

import msgspec

from kvroute.worker_agent import json_scan
from kvroute.worker_agent.events import U64, BlockRemoved, BlockStored, EngineEvent, EventError, normalize_hash
from kvroute.worker_agent.limits import DEFAULT_MAX_BATCH_EVENTS, SCAN_MAX_BYTES
from kvroute.worker_agent.unknown_fields import strip_unknown_fields

_Hash = int | str  # uint64 (checked in `_hash`: msgspec bounds stop at int64) or 64 hex digits


class _Token(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    token_id: int | str
    token_extra_id: int = 0
    type: str | None = None  # "unique_token"


class _Block(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    block_hash: _Hash
    tokens: list[_Token]
    lora_id: int | None = None
    cache_level: int = 0
    priority: int = 0
    mm_keys: list[Any] | None = None
    cache_salt: str | None = None
    type: str | None = None  # "stored_block"


class _Created(msgspec.Struct, tag_field="type", tag="created", forbid_unknown_fields=True, gc=False):
    num_blocks_per_cache_level: list[int] = msgspec.field(default_factory=list)


class _Stored(msgspec.Struct, tag_field="type", tag="stored", forbid_unknown_fields=True, gc=False):
    blocks: list[_Block]
    parent_hash: _Hash | None = None


class _Removed(msgspec.Struct, tag_field="type", tag="removed", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]


class _Updated(msgspec.Struct, tag_field="type", tag="updated", forbid_unknown_fields=True, gc=False):
    block_hash: _Hash
    cache_level: Any = None
    priority: Any = None


class _Unreadable(msgspec.Struct, gc=False):
    """Stands in for an event that could not be decoded but whose event_id could: it still counts in the sequence."""


class _Event(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    event_id: Annotated[int, msgspec.Meta(ge=0)]
    data: _Created | _Stored | _Removed | _Updated
    window_size: int = 0
    attention_dp_rank: int | None = None
    layer_group_id: int | None = None
    hash_algo: str | None = None


_KNOWN_TYPES = frozenset({"created", "stored", "removed", "updated"})
_dec_body = msgspec.json.Decoder(list[_Event])
_dec_raw_body = msgspec.json.Decoder(list[msgspec.Raw])
_dec_event = msgspec.json.Decoder(_Event)
_dec_any = msgspec.json.Decoder()


class BodyError(ValueError):
    """A response body that is not a JSON array of events (the whole poll is lost)."""


class OversizeBodyError(BodyError):
    """A body with more events than the converter's limit (dropped before they are taken apart)."""


@dataclass(slots=True)
class TrtllmCounters:
    malformed_frames: int = 0  # response bodies that could not be decoded
    oversize_bodies: int = 0  # response bodies over the byte or event limit (dropped)
    malformed_events: int = 0  # single events rejected inside otherwise good bodies
    unknown_events: int = 0  # events with an unknown data type (skipped)
    unknown_fields: int = 0  # events carrying fields we do not know (dropped; the event applies)
    gaps: int = 0  # event_id jumped forward
    unrecoverable_gaps: int = 0  # every gap on the pull path: no replay -> rank state reset
    sequence_resets: int = 0  # event_id went back: engine restarted
    incomplete_catch_ups: int = 0  # the first event seen for a rank was not its first ever
    window_filtered_events: int = 0  # events of a window other than the full-attention one
    updated_events: int = 0  # `updated` events (ignored)
    rank_mismatches: int = 0  # events of an attention-DP rank this agent does not serve

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class RankEvents:
    """Events of one rank to apply, from event ids first_id..last_id (filtered events leave holes)."""

    rank: int | None
    first_id: int
    last_id: int
    events: list[EngineEvent]


@dataclass(slots=True)
class RankReset:
    """The rank's state is unknown (gap, restart): drop it before what follows."""

    rank: int | None
    reason: str


Action = RankEvents | RankReset


class TrtllmEventConverter:
    """`ranks`: the attention-DP ranks this agent serves (None: an engine without attention DP, whose
    events carry no rank or rank 0). `max_events`: a body with more events is refused whole."""

    def __init__(self, ranks: list[int] | None = None, max_events: int = DEFAULT_MAX_BATCH_EVENTS) -> None:
        self.ranks = None if ranks is None else frozenset(ranks)
        self.max_events = max_events
        self.counters = TrtllmCounters()
        self.full_window: int | None = None  # widest window of the `created` events
        self._widest_seen: int | None = None  # stand-in until a `created` event arrives
        self._last_id: dict[int | None, int] = {}
        self.last_bad_event: str | None = None  # why the last rejected event was rejected (for the log)
        self.last_unknown_fields: list[str] | None = None  # the last event's fields we do not know (for the log)

    def last_event_id(self, rank: int | None) -> int | None:
        return self._last_id.get(rank)

    # ------------------------------------------------------------------ decode

    def decode(self, body: bytes) -> list[_Event]:
        """Events of one body; bad / unknown events are counted and skipped (their ids still count).
        Raises BodyError (OversizeBodyError: more events than `max_events`) and nothing else."""
        if body.count(b'"event_id"') > self.max_events:  # every decodable event names one: refused before decoding
            raise OversizeBodyError(f"KV event body holds over {self.max_events} events")
        try:
            events = _dec_body.decode(body)
        except msgspec.ValidationError:
            pass
        except (msgspec.DecodeError, RecursionError):
            pass  # garbage, or one event msgspec cannot read (a lone surrogate, nested too deeply): find out below
        else:
            if len(events) > self.max_events:
                raise OversizeBodyError(f"KV event body holds {len(events)} events, over the limit of {self.max_events}")
            return events
        return [e for e in map(self._decode_one, self._elements(body)) if e is not None]

    def _elements(self, body: bytes) -> list[msgspec.Raw] | list[bytes]:
        """The body's top-level elements, for a body that does not decode in one call."""
        if body.count(b",") >= self.max_events:  # more elements would be possible: not taken apart one by one
            raise OversizeBodyError(
                f"KV event body of {len(body)} bytes does not decode as a whole and has too many "
                f"elements to decode one by one (limit {self.max_events})"
            )
        try:
            return _dec_raw_body.decode(body)
        except msgspec.ValidationError as exc:
            raise BodyError(f"KV event body is not a JSON array of events: {exc}") from None
        except (msgspec.DecodeError, RecursionError) as exc:
            if len(body) > SCAN_MAX_BYTES:
                raise BodyError(f"KV event body is not JSON msgspec can read as a whole: {exc}") from None
            try:
                return json_scan.split_array(body)  # find the elements without msgspec: the readable ones apply
            except json_scan.ScanError as scan:
                raise BodyError(f"KV event body is not JSON (garbage or truncated): {exc}; {scan}") from None

    def _decode_one(self, raw: msgspec.Raw | bytes) -> _Event | None:
        """One element: the event, a stand-in keeping the id of an unreadable event, or None."""
        try:
            return _dec_event.decode(raw)
        except msgspec.ValidationError as exc:
            error = str(exc)
        except (msgspec.DecodeError, RecursionError) as exc:
            error = str(exc) or "nested too deeply"
        try:
            generic = _dec_any.decode(raw)
        except (msgspec.MsgspecError, RecursionError):  # out-of-range numbers too: ValidationError
            generic = None
        if generic is not None:
            cleaned, unknown = strip_unknown_fields(generic, _Event)
            if unknown:
                try:
                    event = msgspec.convert(cleaned, _Event)
                except (msgspec.ValidationError, RecursionError) as exc:
                    error = str(exc)
                else:
                    self.counters.unknown_fields += 1
                    self.last_unknown_fields = unknown
                    return event
        self.last_bad_event = error
        if not isinstance(generic, dict):
            generic = {}
        data = generic.get("data")
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in _KNOWN_TYPES:
            self.counters.unknown_events += 1
        else:
            self.counters.malformed_events += 1
        event_id, rank = generic.get("event_id"), generic.get("attention_dp_rank")
        if type(event_id) is int and event_id >= 0:  # keep its id in the sequence: an unreadable event is not a gap
            return _Event(event_id, _Unreadable(), attention_dp_rank=rank if type(rank) is int else None)
        return None

    # ------------------------------------------------------------------ convert

    def feed(self, body: bytes) -> list[Action]:
        """One response body -> actions in order. Raises BodyError if the body is unusable."""
        return self.convert(self.decode(body))

    def convert(self, events: list[_Event]) -> list[Action]:
        c = self.counters
        actions: list[Action] = []
        for ev in events:
            rank = ev.attention_dp_rank
            if self.ranks is None:
                if rank is not None and rank != 0:
                    c.rank_mismatches += 1
                    continue
                rank = None
            elif rank not in self.ranks:
                c.rank_mismatches += 1
                continue
            data = ev.data
            reset = self._sequence(rank, ev.event_id)
            if reset:
                actions.append(RankReset(rank, reset))
            if type(data) is _Unreadable:
                continue
            if type(data) is _Created:
                self.full_window = max(self.full_window or 0, ev.window_size)
                continue
            if type(data) is _Updated:
                c.updated_events += 1
                continue
            if not self._full_window(ev.window_size):
                c.window_filtered_events += 1
                continue
            try:
                converted = (
                    self._stored(data, ev.layer_group_id)
                    if type(data) is _Stored
                    else [BlockRemoved([_hash(h) for h in data.block_hashes], group_idx=ev.layer_group_id)]
                )
            except EventError:
                c.malformed_events += 1
                continue
            last = actions[-1] if actions else None
            if type(last) is RankEvents and last.rank == rank:  # no reset in between: one batch
                last.events.extend(converted)
                last.last_id = ev.event_id
            else:
                actions.append(RankEvents(rank, ev.event_id, ev.event_id, converted))
        return actions

    def _sequence(self, rank: int | None, event_id: int) -> str | None:
        c = self.counters
        last = self._last_id.get(rank)
        self._last_id[rank] = event_id
        if last is None:
            if event_id > 0:
                c.incomplete_catch_ups += 1
            return None
        if event_id == last + 1:
            return None
        if event_id > last:
            c.gaps += 1
            c.unrecoverable_gaps += 1
            return f"event_id gap: expected {last + 1}, got {event_id} (the pull path cannot replay)"
        c.sequence_resets += 1
        return f"event_id went back from {last} to {event_id}: engine restarted"

    def _full_window(self, window: int) -> bool:
        if not window:
            return True  # no window on the event: nothing to filter on
        if self.full_window is not None:
            return window == self.full_window
        self._widest_seen = max(self._widest_seen or 0, window)
        return window == self._widest_seen

    def _stored(self, data: _Stored, group: int | None) -> list[EngineEvent]:
        blocks = data.blocks
        if not blocks:
            return []
        out: list[EngineEvent] = []
        parent = None if data.parent_hash is None else _hash(data.parent_hash)
        first = blocks[0]
        start = 0
        while start < len(blocks):
            size = len(blocks[start].tokens)
            end = start + 1
            while end < len(blocks) and len(blocks[end].tokens) == size:
                end += 1
            run = blocks[start:end]
            hashes = [_hash(b.block_hash) for b in run]
            tokens: list = []
            unkeyable = None
            for i, block in enumerate(run):
                if unkeyable is None and (block.mm_keys or any(t.token_extra_id for t in block.tokens)):
                    unkeyable = i
                tokens.extend(t.token_id for t in block.tokens)  # a str id: the resolver stops the chain there
            if size == 0:
                raise EventError("stored block without tokens")
            out.append(
                BlockStored(
                    hashes,
                    parent,
                    tokens,
                    size,
                    group_idx=group,
                    lora_id=first.lora_id,
                    cache_salt=first.cache_salt,
                    unkeyable_from=unkeyable,
                )
            )
            parent = hashes[-1]
            start = end
        return out


def _hash(value: int | str) -> int:
    """A pull-path hash as an id: uint64 ints as they are (no wrapping: anything outside is malformed), hex strings
    by their last 16 digits."""
    if type(value) is int and not 0 <= value <= U64:
        raise EventError(f"block hash {value} is not a uint64")
    return normalize_hash(value)
