"""Property-based tests of the agent's msgpack decoders (vLLM every era, SGLang, TensorRT-LLM's streaming
publisher), against input from engines and from anything else that can reach the socket.

(a) Agreement: events drawn by hypothesis, encoded by the sim engine's own encoder for each dialect
(`sim_engine/wire_encoding.py`, written from docs/wire-formats.md and sharing no code with the
decoders), decode to the engine-neutral events the field tables say they are.
(b) Hostility: arbitrary bytes, truncated or mutated batches, wrong types in every field, deep
nesting, non-UTF-8 strings, huge length headers, NaN: the decoder raises nothing but
`WireFormatError` (a batch) or `EventError` (one event), in bounded time and memory; a bad event
inside a batch is counted and its neighbours apply.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvroute.tools.sim_engine.dialects import DIALECTS, Dialect
from kvroute.tools.sim_engine.prefix_cache import CPU, GPU, CacheNamespace, ClearedEvent, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.wire_encoding import MsgpackEventEncoder, coalesce_stores
from kvroute.worker_agent import sglang_wire, vllm_wire
from kvroute.worker_agent.events import U64, AllBlocksCleared, BlockRemoved, BlockStored, EventError
from kvroute.worker_agent.msgpack_wire import BatchDecoder, OversizeBatchError, WireFormatError
from tests.hostile import NAMES, Bounded, namespaces, token_ids

ZMQ_DIALECTS = sorted(name for name, d in DIALECTS.items() if d.transport == "zmq")
DECODERS: dict[str, BatchDecoder] = {
    "vllm": vllm_wire.DECODER,
    "sglang": sglang_wire.DECODER,
    "trtllm": vllm_wire.DECODER,
}  # TRT-LLM's publisher sends vLLM's map shape

I64 = st.integers(-(2**63), 2**63 - 1)
ENGINES = st.sampled_from(("vllm", "sglang"))
EVENT_KINDS = st.sampled_from(("stored", "stored", "removed", "cleared"))
MUTATIONS = st.sampled_from(("truncate", "flip", "insert", "delete"))


def decoder_of(d: Dialect) -> BatchDecoder:
    return DECODERS[d.engine]


# ---------------------------------------------------------------- what engines send


_DIGESTS, _U64S = st.binary(min_size=32, max_size=32), st.integers(0, U64)
_HASHES = {h: (h, st.none() | h) for h in (_DIGESTS, _U64S, I64)}  # (hash, hash or None)


def hash_values(d: Dialect, form: str) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """The published block hash of the dialect, and a parent (the same or None), per
    docs/wire-formats.md#vllm-block-hashes, #sglang-block-hashes, #tensorrt-llm-block-hashes: vLLM's
    digest era u64 or the digest's bytes, signed int64 otherwise."""
    if d.hash_kind == "vllm-digest":
        return _HASHES[_DIGESTS if form == "bytes" else _U64S]
    return _HASHES[I64]


_BOTH_MEDIA, _GPU_ONLY = st.sampled_from((GPU, CPU)), st.just(GPU)


@st.composite
def cache_events(draw, d: Dialect, form: str, block_size: int, max_events: int = 5) -> list:
    hashes, parents = hash_values(d, form)
    media = _BOTH_MEDIA if d.cpu_medium else _GPU_ONLY
    out: list = []
    for _ in range(draw(st.integers(0, max_events))):
        kind = draw(EVENT_KINDS)
        if kind == "stored":
            n = draw(st.integers(1, 4))
            # SGLang 0.4.7 hashes a whole radix node: more tokens than pages (docs/wire-formats.md#sglang-block-hashes).
            extra = draw(st.integers(0, block_size)) if d.engine == "sglang" else 0
            tokens = draw(token_ids(n * block_size + extra))
            out.append(
                StoredEvent(
                    draw(st.lists(hashes, min_size=n, max_size=n)), draw(parents), tokens, draw(media), draw(namespaces())
                )
            )
        elif kind == "removed":
            out.append(RemovedEvent(draw(st.lists(hashes, min_size=1, max_size=4)), draw(media)))
        else:
            out.append(ClearedEvent())
    return out


def u64(h: int | bytes) -> int:
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & U64


def expected_event(d: Dialect, ev, block_size: int):
    """The engine-neutral event the dialect's field table says `ev` is (docs/wire-formats.md)."""
    if isinstance(ev, ClearedEvent):
        return AllBlocksCleared()
    medium = "gpu" if ev.medium == GPU else d.cpu_medium.lower()
    if isinstance(ev, RemovedEvent):
        return BlockRemoved([u64(h) for h in ev.block_hashes], medium, 0 if "group_idx" in d.removed_fields else None)
    ns, fields = ev.namespace, d.stored_fields
    salt = None
    if d.engine == "sglang" and "cache_salt" in fields:
        salt = ns.cache_salt  # SGLang 0.5.20+ maps name the salt directly
    elif d.engine == "vllm" and "extra_keys" in fields and ev.parent_block_hash is None:
        salt = ns.cache_salt  # vLLM 0.17+: block 0's extra keys, first block of a prompt
    unkeyable = None
    if d.engine == "sglang" and len(ev.token_ids) > len(ev.block_hashes) * block_size:
        unkeyable = 0
    return BlockStored(
        [u64(h) for h in ev.block_hashes],
        None if ev.parent_block_hash is None else u64(ev.parent_block_hash),
        list(ev.token_ids),
        block_size,
        ns.lora_name if d.lora_on_wire == "lora_name" else None,
        medium,
        0 if "group_idx" in fields else None,
        "full_attention" if "kv_cache_spec_kind" in fields else None,
        salt,
        None if d.engine == "sglang" else ns.lora_id,
        False,
        unkeyable,
    )


@st.composite
def engine_batches(draw, max_events: int = 5):
    """(dialect, block size, rank, events, the payload the dialect's encoder writes for them)."""
    d = DIALECTS[draw(st.sampled_from(ZMQ_DIALECTS))]
    form = draw(st.sampled_from(d.hash_forms))
    block_size = draw(st.integers(1, 8))
    rank = draw(st.integers(0, 2**31 - 1)) if d.batch_has_rank else 0
    events = draw(cache_events(d, form, block_size, max_events))
    ts = draw(st.floats(allow_nan=False))
    payload = MsgpackEventEncoder(d, block_size, rank).encode(events, ts)
    return d, block_size, rank, events, payload


# ---------------------------------------------------------------- (a) agreement


@given(engine_batches(), st.integers(0, 2**64 - 1))
@example(
    (
        DIALECTS["vllm-0.26"],
        2,
        0,
        [StoredEvent([1], None, [5, 6], GPU, CacheNamespace("a", 1, "a"))],
        MsgpackEventEncoder(DIALECTS["vllm-0.26"], 2).encode(
            [StoredEvent([1], None, [5, 6], GPU, CacheNamespace("a", 1, "a"))], 1.0
        ),
    ),
    7,
)  # salt equal to the LoRA name
def test_every_dialects_batches_decode_to_the_events_the_field_tables_say(batch, seq: int) -> None:
    d, block_size, rank, events, payload = batch
    decoded = decoder_of(d).decode_payload(seq, payload)
    wire_events = coalesce_stores(events) if d.coalesce_stores else events
    assert decoded.events == [expected_event(d, e, block_size) for e in wire_events]
    assert decoded.seq == seq and decoded.dp_rank == (rank if d.batch_has_rank else None)
    assert decoded.bad_events == [] and decoded.unknown_events == [] and decoded.unknown_fields == []


@given(engine_batches().filter(lambda b: b[0].engine == "vllm"))
def test_a_vllm_batch_written_as_a_map_decodes_the_same(batch) -> None:
    """The batch shape of a non-release vLLM snapshot, `{"ts", "events", "data_parallel_rank"}`
    (docs/wire-formats.md#vllm-map-batch-snapshot): the same batch, re-encoded as that map, is the same events."""
    *_, payload = batch
    fields = msgspec.msgpack.decode(payload)
    as_map = {"ts": fields[0], "events": fields[1]}
    if len(fields) > 2:
        as_map["data_parallel_rank"] = fields[2]
    assert vllm_wire.decode_payload(5, msgspec.msgpack.encode(as_map)) == vllm_wire.decode_payload(5, payload)


@given(engine_batches(), st.binary(max_size=16), st.integers(0, 2**64 - 1))
def test_three_frames_give_the_batch_whatever_the_topic(batch, topic: bytes, seq: int) -> None:
    d, _, _, _, payload = batch
    assert decoder_of(d).decode_frames([topic, seq.to_bytes(8, "big"), payload]) == decoder_of(d).decode_payload(seq, payload)


# ---------------------------------------------------------------- hostile values

_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary(max_size=12)
)
MSGPACK_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=12,
)


def raw_fragments() -> st.SearchStrategy[msgspec.Raw]:
    """Complete msgpack values no encoder would write: invalid UTF-8, nesting deeper than any decoder
    recursion limit, ext types, map keys that are arrays, a huge string."""
    return st.one_of(
        st.binary(min_size=1, max_size=8).map(lambda b: msgspec.Raw(bytes([0xA0 | len(b)]) + b"\xff" + b[1:])),
        st.integers(1000, 3000).map(lambda n: msgspec.Raw(b"\x91" * n + b"\xc0")),
        st.integers(1000, 3000).map(lambda n: msgspec.Raw(b"\x81\xa1k" * n + b"\xc0")),
        st.sampled_from(
            [
                msgspec.Raw(b"\xd4\x01\x00"),
                msgspec.Raw(b"\xd6\xff\x00\x00\x00\x00"),  # ext, timestamp ext
                msgspec.Raw(b"\x81\x91\x00\x00"),  # {[0]: 0}
                msgspec.Raw(b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"),  # NaN
                msgspec.Raw(b"\xdb\x00\x01\x00\x00" + b"a" * 65536),
            ]
        ),  # a 64 KiB string
    )


HOSTILE_VALUES = MSGPACK_VALUES | raw_fragments()
HOSTILE_TAGS = HOSTILE_VALUES | NAMES
HOSTILE_EVENT_BYTES = st.binary(max_size=64) | MSGPACK_VALUES.map(msgspec.msgpack.encode) | raw_fragments().map(bytes)
FIELD_CHANGES = st.sampled_from(("field", "field", "drop", "add", "tag", "value"))


@st.composite
def hostile_events(draw, d: Dialect, block_size: int):
    """One event, as msgpack-ready builtins: a valid event with one field replaced, removed, added
    or re-typed, or a value that is no event at all."""
    how = draw(FIELD_CHANGES)
    if how == "value":
        return draw(HOSTILE_VALUES)
    form = draw(st.sampled_from(d.hash_forms))
    events = draw(cache_events(d, form, block_size, max_events=1).filter(bool))
    wire = msgspec.to_builtins(MsgpackEventEncoder(d, block_size).to_wire(events[0]))
    keys = list(wire) if isinstance(wire, dict) else list(range(len(wire)))
    if how == "tag":
        wire[keys[0] if isinstance(wire, list) else "type"] = draw(HOSTILE_TAGS)
    elif how == "add":
        if isinstance(wire, dict):
            wire[draw(st.text(max_size=8))] = draw(HOSTILE_VALUES)
        else:
            wire.append(draw(HOSTILE_VALUES))
    elif keys:
        key = draw(st.sampled_from(keys))
        if how == "drop" and isinstance(wire, dict):
            del wire[key]
        elif how == "drop":
            del wire[key:]
        else:
            wire[key] = draw(HOSTILE_VALUES)
    return wire


def batch_bytes(ts: object, events: list, rank: object = 0, *, with_rank: bool = True) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank] if with_rank else [ts, events])


bounded = Bounded()


def decode_hostile(decoder: BatchDecoder, payload: bytes, seq: int = 1):
    """The batch, or None when the decoder raised its documented error (anything else fails the test)."""
    try:
        return bounded(decoder.decode_payload, payload, seq, payload)
    except WireFormatError:
        return None


# ---------------------------------------------------------------- (b) hostility


@given(ENGINES, st.binary(max_size=256))
@example("vllm", b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff")  # 4 G events claimed, none there
@example("vllm", b"\x93\xcb" + b"\x00" * 8 + b"\x91\xdb\xff\xff\xff\xff")  # a 4 GB string claimed
@example("vllm", b"\x81\xa6events" + b"\x91" * 5000 + b"\xc0")  # a map batch nested beyond the recursion limit
def test_arbitrary_bytes_raise_only_wire_format_errors(engine: str, payload: bytes) -> None:
    decode_hostile(DECODERS[engine], payload)


@given(engine_batches(), st.data())
def test_truncated_and_mutated_batches_raise_only_wire_format_errors(batch, data) -> None:
    d, *_, payload = batch
    mutation = data.draw(MUTATIONS)
    at = data.draw(st.integers(0, len(payload) - 1))
    if mutation == "truncate":
        payload = payload[:at]
    elif mutation == "flip":
        payload = payload[:at] + bytes([payload[at] ^ data.draw(st.integers(1, 255))]) + payload[at + 1 :]
    elif mutation == "insert":
        payload = payload[:at] + data.draw(st.binary(min_size=1, max_size=9)) + payload[at:]
    else:
        payload = payload[:at] + payload[at + data.draw(st.integers(1, 9)) :]
    decoded = decode_hostile(decoder_of(d), payload)
    if decoded is not None:  # whatever came through is engine-neutral events of the documented types
        assert all(type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in decoded.events)


@given(ENGINES, HOSTILE_VALUES, HOSTILE_VALUES, HOSTILE_VALUES)
def test_wrong_types_in_the_batch_raise_only_wire_format_errors(engine: str, ts, events, rank) -> None:
    for payload in (
        batch_bytes(ts, events, rank),
        batch_bytes(ts, events, with_rank=False),
        msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": rank}),
    ):
        decode_hostile(DECODERS[engine], payload)


@given(st.data())
def test_a_bad_event_is_counted_and_its_neighbours_apply(data) -> None:
    d = DIALECTS[data.draw(st.sampled_from(ZMQ_DIALECTS))]
    block_size = data.draw(st.integers(1, 4))
    form = data.draw(st.sampled_from(d.hash_forms))
    before = data.draw(cache_events(d, form, block_size, max_events=3))
    after = data.draw(cache_events(d, form, block_size, max_events=3))
    bad = data.draw(hostile_events(d, block_size))
    encoder = MsgpackEventEncoder(d, block_size)
    events = [encoder.to_wire(e) for e in before] + [bad] + [encoder.to_wire(e) for e in after]
    payload = batch_bytes(data.draw(st.floats()), events, with_rank=d.batch_has_rank)
    decoded = bounded(decoder_of(d).decode_payload, payload, 3, payload)
    want_before = [expected_event(d, e, block_size) for e in before]
    want_after = [expected_event(d, e, block_size) for e in after]
    assert decoded.events[: len(want_before)] == want_before
    assert decoded.events[len(decoded.events) - len(want_after) :] == want_after
    kept = len(decoded.events) - len(want_before) - len(want_after)
    assert kept in (0, 1)
    assert kept + len(decoded.bad_events) + len(decoded.unknown_events) == 1  # the bad one is accounted for once
    assert all(s.startswith(f"event {len(before)}: ") for s in decoded.bad_events + decoded.unknown_fields)


@given(ENGINES, HOSTILE_EVENT_BYTES)
def test_decode_event_raises_only_event_errors(engine: str, buf: bytes) -> None:
    try:
        bounded(DECODERS[engine].decode_event, buf, buf)
    except EventError:
        pass


@given(ENGINES, st.integers(0, 150), st.integers(1, 100))
def test_more_events_than_the_limit_are_refused_before_they_are_taken_apart(engine: str, events: int, limit: int) -> None:
    for payload in (
        batch_bytes(1.0, [0] * events),
        batch_bytes(1.0, [["AllBlocksCleared"]] * events),
        msgspec.msgpack.encode({"ts": 1.0, "events": [0] * events}),
    ):
        try:
            decoded = bounded(DECODERS[engine].decode_payload, payload, 1, payload, max_events=limit)
        except OversizeBatchError:
            assert events > limit
            continue
        except WireFormatError:
            continue
        assert events <= limit and len(decoded.events) + len(decoded.bad_events) == events


# ---------------------------------------------------------------- regressions the properties found


def good_event(h: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@pytest.mark.parametrize(
    "bad",
    [
        msgspec.Raw(b"\xa3\xff\xfe\xfd"),  # a string that is not UTF-8
        {**good_event(5), "medium": msgspec.Raw(b"\xa2\xc3\x28")},  # ... as a field
        msgspec.Raw(b"\x91" * 5000 + b"\xc0"),  # nested past the recursion limit
        {**good_event(5), "extra_keys": msgspec.Raw(b"\x91" * 5000 + b"\xc0")},  # ... inside an Any field
        {**good_event(5), "new_field": msgspec.Raw(b"\x91" * 5000 + b"\xc0")},  # ... inside an unknown field
        ["BlockRemoved", [1], "GPU", 0, msgspec.Raw(b"\x91" * 5000 + b"\xc0")],  # ... past an array's known fields
        {"type": "NewEvent", "x": msgspec.Raw(b"\x91" * 5000 + b"\xc0")},  # ... in an unknown event type
    ],
    ids=[
        "utf8-event",
        "utf8-field",
        "deep-event",
        "deep-any-field",
        "deep-unknown-field",
        "deep-array-tail",
        "deep-unknown-type",
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_regression_hostile_event_between_good_ones(engine: str, bad) -> None:
    """Invalid UTF-8 lost the whole batch (PayloadError from the one-call decode); deep nesting raised
    RecursionError out of the decoder."""
    payload = batch_bytes(1.0, [good_event(1), bad, good_event(2)])
    decoded = DECODERS[engine].decode_payload(1, payload)
    assert [e.block_hashes for e in decoded.events] == [[1], [2]]
    assert len(decoded.bad_events) + len(decoded.unknown_events) == 1


def test_regression_salt_equal_to_the_lora_name_is_still_the_salt() -> None:
    """vLLM's extra keys are (LoRA name, ..., salt): a salt spelled like the adapter was dropped with it, and the
    salted prompt's blocks were keyed as unsalted (shared with the adapter's unsalted requests)."""
    assert vllm_wire.read_extra_keys([["a", "a"]], "a", True) == ("a", None)
    assert vllm_wire.read_extra_keys([["a"]], "a", True) == (None, None)


def test_nan_and_infinite_timestamps_are_timestamps() -> None:
    for ts in (math.nan, math.inf, -math.inf):
        assert vllm_wire.decode_payload(1, batch_bytes(ts, [good_event(1)])).events[0].block_hashes == [1]


@pytest.mark.parametrize("shape", ["array", "map"])
def test_regression_counting_events_does_not_walk_a_huge_value_in_python(shape: str) -> None:
    """To count a big batch's events the decoder stepped over its `ts` (or the map's keys before `events`) one
    msgpack value at a time in Python: 4 MB of zeros there took 0.4 s of CPU, a 128 MiB frame over 10 s."""
    ts = [0] * 4_000_000
    payload = msgspec.msgpack.encode([ts, [], 0] if shape == "array" else {"ts": ts, "events": [0] * 2000})
    with pytest.raises(WireFormatError):
        Bounded(seconds=0.1)(vllm_wire.decode_payload, payload, 0, payload, max_events=1000)
