"""vLLM KV-event decoding: golden bytes (docs/wire-formats.md#vllm-example-bytes) and payloads encoded with our own
replicas of every era's schema (docs/wire-formats.md#vllm-event-fields, field names/order/options copied as data, no vLLM
code)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvroute.worker_agent.vllm_wire import (
    AllBlocksCleared,
    BatchShapeError,
    BlockRemoved,
    BlockStored,
    EventError,
    FrameCountError,
    PayloadError,
    SequenceFrameError,
    UnknownEventError,
    WireFormatError,
    decode_event,
    decode_frames,
    decode_payload,
    normalize_hash,
    read_extra_keys,
    split_frames,
)

U64 = 2**64 - 1
enc = msgspec.msgpack.encode
SEQ0 = (0).to_bytes(8, "big")


def fixstr(s: str) -> bytes:  # msgpack fixstr, written out by hand
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


# ----------------------------------------------------------------------------- golden bytes
# (docs/wire-formats.md#vllm-example-bytes)


def test_golden_vllm_0_9_0_two_element_batch() -> None:
    # EventBatch(ts=1.5, [BlockStored([-2,3], None, [1,2,3,4], 2, None)]): 35 bytes, builtin-hash -2 = fe.
    payload = bytes.fromhex("92 cb3ff8000000000000 91 96 ab") + b"BlockStored" + bytes.fromhex("92 fe 03 c0 94 01 02 03 04 02 c0")
    assert len(payload) == 35
    batch = decode_frames([b"", SEQ0, payload])
    assert batch.seq == 0 and batch.ts == 1.5 and batch.dp_rank is None
    assert batch.events == [BlockStored([U64 - 1, 3], None, [1, 2, 3, 4], 2)]
    assert batch.bad_events == [] and batch.unknown_events == []


def test_golden_vllm_0_10_2_seven_element_event_in_three_event_batch() -> None:
    # `93 cb… 93 97 ab"BlockStored" 92 cf ffffffffffffffff 05 c0 94 01020304 04 c0 a3"GPU" …`
    stored = (
        bytes.fromhex("97 ab") + b"BlockStored" + bytes.fromhex("92 cf ffffffffffffffff 05 c0 94 01020304 04 c0") + fixstr("GPU")
    )
    removed = bytes.fromhex("93") + fixstr("BlockRemoved") + bytes.fromhex("91 05") + fixstr("GPU")
    cleared = bytes.fromhex("91 b0") + b"AllBlocksCleared"
    payload = bytes.fromhex("93 cb3ff8000000000000 93") + stored + removed + cleared + bytes.fromhex("00")
    batch = decode_payload(7, payload)
    assert batch.seq == 7 and batch.dp_rank == 0
    assert batch.events == [BlockStored([U64, 5], None, [1, 2, 3, 4], 4, medium="gpu"), BlockRemoved([5]), AllBlocksCleared()]


def test_golden_vllm_0_33_map_event_175_bytes() -> None:
    event = (
        bytes.fromhex("de 000a")
        + fixstr("type")
        + fixstr("BlockStored")
        + fixstr("block_hashes")
        + bytes.fromhex("91 cf 7b0bf7bf7fd01682")
        + fixstr("parent_block_hash")
        + bytes.fromhex("c0")
        + fixstr("token_ids")
        + bytes.fromhex("92 01 02")
        + fixstr("block_size")
        + bytes.fromhex("02")
        + fixstr("lora_id")
        + bytes.fromhex("c0")
        + fixstr("medium")
        + fixstr("GPU")
        + fixstr("lora_name")
        + bytes.fromhex("c0")
        + fixstr("group_idx")
        + bytes.fromhex("00")
        + fixstr("kv_cache_spec_kind")
        + fixstr("full_attention")
    )
    payload = bytes.fromhex("93 cb3ff8000000000000 91") + event + bytes.fromhex("00")
    assert len(payload) == 175
    assert payload.startswith(
        bytes.fromhex("93cb3ff800000000000091de000aa4")
        + b"type"
        + bytes.fromhex("ab")
        + b"BlockStored"
        + bytes.fromhex("ac")
        + b"block_hashes"
        + bytes.fromhex("91cf7b0bf7bf7fd01682b1")
    )
    (stored,) = decode_payload(0, payload).events
    assert stored == BlockStored([8866452693264111234], None, [1, 2], 2, None, "gpu", 0, "full_attention")


# ----------------------------------------------------------------------------- replicas of every era row


def _fields(*names: str) -> list[tuple]:
    required = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}
    return [(n, Any) if n in required else (n, Any, None) for n in names]


STORED_V = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]  # 0.9.0
STORED_ROWS = {  # docs/wire-formats.md#vllm-array-and-map-eras: array-era element count (incl. tag) -> fields
    6: STORED_V,
    7: STORED_V + ["medium"],  # 0.10.2-0.13
    8: STORED_V + ["medium", "lora_name"],  # 0.14-0.16
    9: STORED_V + ["medium", "lora_name", "extra_keys"],  # 0.17-0.19
    10: STORED_V + ["medium", "lora_name", "extra_keys", "group_idx"],  # 0.20-0.21
    12: STORED_V
    + ["medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],  # 0.22-0.23
}
MAP_STORED_ROWS = {  # map era (0.24+): fields grow
    "0.24": STORED_ROWS[12],
    "0.26": STORED_ROWS[12] + ["locality"],
    "0.29": STORED_ROWS[12] + ["locality", "ownership"],
    "0.30": STORED_ROWS[12] + ["locality", "ownership", "session_id"],
    "0.33": STORED_ROWS[12] + ["locality", "ownership", "session_id", "lookahead_token_ids"],
}
REMOVED_ROWS = {2: ["block_hashes"], 3: ["block_hashes", "medium"], 4: ["block_hashes", "medium", "group_idx"]}


def replica(tag: str, names: list[str], era: str) -> type:
    options: dict[str, Any] = {"array_like": True} if era == "array" else {"tag_field": "type", "omit_defaults": True}
    return msgspec.defstruct(tag, _fields(*names), tag=tag, **options)


class Batch090(msgspec.Struct, array_like=True):  # vLLM 0.9.0
    ts: float
    events: list[Any]


class Batch(msgspec.Struct, array_like=True):  # 0.9.1+
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


ALL_VALUES = {
    "block_hashes": [2**63 + 11, 12],
    "parent_block_hash": 10,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": 3,
    "medium": "GPU",
    "lora_name": "adapter",
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": None,
    "locality": "LOCAL",
    "ownership": None,
    "session_id": "s-1",
    "lookahead_token_ids": None,
}


@pytest.mark.parametrize("length", sorted(STORED_ROWS))
def test_array_era_block_stored_every_length(length: int) -> None:
    names = STORED_ROWS[length]
    cls = replica("BlockStored", names, "array")
    wire = enc(cls(**{n: ALL_VALUES[n] for n in names}))
    assert msgspec.msgpack.decode(wire)[0] == "BlockStored" and len(msgspec.msgpack.decode(wire)) == length
    batch_cls = Batch090 if length == 6 else Batch
    batch = decode_payload(0, enc(batch_cls(1.0, [msgspec.msgpack.decode(wire)])))
    (stored,) = batch.events
    assert stored.block_hashes == [2**63 + 11, 12] and stored.parent_block_hash == 10
    assert stored.token_ids == list(range(8)) and stored.block_size == 4
    assert stored.lora_name == ("adapter" if length >= 8 else None)  # position 7; lora_id (5) ignored
    assert stored.medium == "gpu"
    assert stored.group_idx == (0 if length >= 10 else None)
    assert stored.kv_cache_spec_kind == ("full_attention" if length >= 12 else None)


@pytest.mark.parametrize("length", sorted(REMOVED_ROWS))
def test_array_era_block_removed_every_length(length: int) -> None:
    names = REMOVED_ROWS[length]
    cls = replica("BlockRemoved", names, "array")
    event = cls(**{n: ALL_VALUES[n] for n in names})
    (removed,) = decode_payload(0, enc(Batch(1.0, [event], 0))).events
    assert removed == BlockRemoved([2**63 + 11, 12], "gpu", 0 if length == 4 else None)


@pytest.mark.parametrize("version", sorted(MAP_STORED_ROWS))
def test_map_era_every_version(version: str) -> None:
    names = MAP_STORED_ROWS[version]
    stored_cls = replica("BlockStored", names, "map")
    removed_cls = replica("BlockRemoved", ["block_hashes", "medium", "group_idx", "locality", "ownership"], "map")
    cleared_cls = replica("AllBlocksCleared", [], "map")
    values = dict(ALL_VALUES, parent_block_hash=None, lora_name=None, medium="GPU")
    events = [
        stored_cls(**{n: values[n] for n in names}),
        removed_cls(block_hashes=[12], medium="GPU", group_idx=0, locality="LOCAL", ownership=None),
        cleared_cls(),
    ]
    wire_events = msgspec.msgpack.decode(enc(events))
    assert wire_events[0]["type"] == "BlockStored" and "kv_cache_spec_sliding_window" not in wire_events[0]
    batch = decode_payload(5, enc(Batch(1.0, events, 1)))
    assert batch.dp_rank == 1
    assert batch.events == [
        BlockStored([2**63 + 11, 12], None, list(range(8)), 4, None, "gpu", 0, "full_attention", lora_id=3),
        BlockRemoved([12], "gpu", 0),
        AllBlocksCleared(),
    ]


def test_hash_forms_normalise_to_u64() -> None:
    sha = bytes(range(32))  # sha256 digest with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    xx = bytes(range(100, 116))  # xxhash 16-byte digest
    vllm_int_form = int.from_bytes(sha, "big") & U64  # what vLLM sends by default for the same digest
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [sha, xx],
            "parent_block_hash": -(2**63),
            "token_ids": [1, 2],
            "block_size": 1,
            "lora_id": None,
            "medium": None,
            "lora_name": None,
        },
        ["BlockRemoved", [-1, U64, 0, 2**63 - 1], "CPU"],
    ]
    stored, removed = decode_payload(0, enc([1.0, events, 0])).events
    assert stored.block_hashes == [vllm_int_form, int.from_bytes(xx[-8:], "big")]
    assert stored.parent_block_hash == 2**63 and stored.medium == "gpu"  # nil medium -> gpu
    assert removed.block_hashes == [U64, U64, 0, 2**63 - 1] and removed.medium == "cpu"  # lower-cased
    assert normalize_hash(-2) == U64 - 1 and normalize_hash(b"\x01" * 40) == int.from_bytes(b"\x01" * 8, "big")
    with pytest.raises(EventError):
        normalize_hash(b"")


def test_map_batch_is_accepted() -> None:
    batch = decode_payload(
        3,
        enc(
            {"ts": 2.0, "events": [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [1]}], "data_parallel_rank": 1}
        ),
    )
    assert batch.events == [AllBlocksCleared(), BlockRemoved([1])] and batch.dp_rank == 1


def test_unknown_tags_and_fields_are_tolerated_and_reported() -> None:
    events = [
        ["BlockStored", [1], None, [7, 8], 2, None, "GPU", None, None, 0, "full_attention", None, "extra", "more"],  # 14 elems
        {
            "type": "BlockStored",
            "block_hashes": [2],
            "parent_block_hash": 1,
            "token_ids": [9, 10],
            "block_size": 2,
            "medium": "GPU",
            "some_future_field": {"nested": [1, 2]},
            "mm_keys": [[{"type": "mm_key"}]],
        },
        ["FutureEvent", 1, 2],
        {"type": "BlockUpdated", "block_hashes": [1]},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
    ]
    batch = decode_payload(0, enc([1.0, events, 0]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored, BlockRemoved]
    assert batch.unknown_events == ["FutureEvent", "BlockUpdated"] and batch.bad_events == []
    assert batch.unknown_fields == ["event 0: $[12:]", "event 1: $.some_future_field"]  # counted, the events apply


def test_a_bad_event_does_not_lose_its_neighbours() -> None:
    good_a = ["BlockRemoved", [1], "GPU"]
    good_b = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1], "block_size": 1}
    events = [
        good_a,
        ["BlockStored", "not-a-list", None, [], 4, None],  # wrong type
        {"type": "BlockRemoved"},  # missing field
        ["BlockStored", [1], None, [1, 2]],  # too short (no block_size)
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 0},
        {"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None, "token_ids": [1], "block_size": 1},
        42,
        "BlockStored",
        [],
        None,  # not events at all
        good_b,
        good_a,
    ]
    batch = decode_payload(0, enc([1.0, events, 0]))
    assert batch.events == [BlockRemoved([1]), BlockStored([5], None, [1], 1), BlockRemoved([1])]
    assert len(batch.bad_events) == 9
    assert batch.bad_events[0].startswith("event 1:") and batch.bad_events[-1].startswith("event 9:")


def test_both_eras_decode_in_any_order() -> None:
    arr = enc([1.0, [["BlockRemoved", [1], "GPU", 0]], 0])
    mp = enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}], 0])
    mixed = enc(
        [
            1.0,
            [["BlockRemoved", [1], "GPU", 0], {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}],
            0,
        ]
    )
    for payload in (arr, mp, arr, mixed, mp, mp, arr):
        batch = decode_payload(0, payload)
        assert batch.events and all(e == BlockRemoved([1], "gpu", 0) for e in batch.events) and not batch.bad_events


def test_decode_event_single() -> None:
    assert decode_event(enc(["AllBlocksCleared"])) == AllBlocksCleared()
    assert decode_event(enc({"type": "AllBlocksCleared"})) == AllBlocksCleared()
    with pytest.raises(UnknownEventError) as info:
        decode_event(enc({"type": "Nope"}))
    assert info.value.tag == "Nope"
    with pytest.raises(EventError):
        decode_event(enc([1, 2]))


@pytest.mark.parametrize(
    "frames, error, message",
    [
        ([b"", SEQ0], FrameCountError, "expected 3 frames"),
        ([b"", SEQ0, b"", b""], FrameCountError, "got 4"),
        ([b"", b"\x00\x01\x02", enc([1.0, [], 0])], SequenceFrameError, "8 bytes"),
        ([b"", SEQ0 + b"\x00", enc([1.0, [], 0])], SequenceFrameError, "got 9"),
        ([b"", SEQ0, b""], PayloadError, "not msgpack"),
        ([b"", SEQ0, b"\xc1\xc1garbage"], PayloadError, "not msgpack"),
        ([b"", SEQ0, enc([1.0, [["BlockRemoved", [1]]], 0])[:-3]], PayloadError, "not msgpack"),  # truncated
        ([b"", SEQ0, enc("just a string")], BatchShapeError, "EventBatch"),
        ([b"", SEQ0, enc([1.0])], BatchShapeError, "EventBatch"),
        ([b"", SEQ0, enc(["ts", []])], BatchShapeError, "EventBatch"),
        ([b"", SEQ0, enc([1.0, {"not": "a list"}])], BatchShapeError, "EventBatch"),
        ([b"", SEQ0, enc({"ts": 1.0})], BatchShapeError, "EventBatch"),
    ],
)
def test_unusable_messages_raise_wire_format_errors(frames: list[bytes], error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        decode_frames(frames)
    assert isinstance(info.value, WireFormatError)


def test_split_frames_reads_big_endian_unsigned_seq() -> None:
    topic, seq, payload = split_frames([b"kv@pod", bytes.fromhex("00000000000001ff"), b"x"])
    assert (topic, seq, payload) == (b"kv@pod", 511, b"x")
    assert split_frames([b"", b"\xff" * 7 + b"\xfe", b""])[1] == 2**64 - 2


# ----------------------------------------------------------------------------- extra_keys, locality, multimodal


@pytest.mark.parametrize(
    "extra_keys, lora_name, starts_prompt, expected",
    [
        ([None, None], None, True, (None, None)),
        ([["sql"], ["sql"]], "sql", True, (None, None)),  # LoRA name only
        ([["sql", "tenant-a"], ["sql"]], "sql", True, ("tenant-a", None)),  # LoRA, then the salt (block 0)
        ([["tenant-a"], None], None, True, ("tenant-a", None)),
        ([["tenant-a"], None], None, False, (None, 0)),  # not a prompt start: a string is an mm id
        ([None, [["img-1", 0]]], None, True, (None, 1)),  # 0.19+: (mm id, offset) pairs
        ([[["img-1", 3], "tenant-a"]], None, True, ("tenant-a", 0)),  # image in block 0, salted
        ([None, None, ["img-hash"]], None, True, (None, 2)),  # 0.17-0.18: bare mm id past block 0
        ([["sql", b"\x01" * 32]], "sql", True, (None, 0)),  # prompt-embeds digest
    ],
)
def test_extra_keys_give_the_salt_and_where_unkeyable_content_starts(extra_keys, lora_name, starts_prompt, expected) -> None:
    assert read_extra_keys(extra_keys, lora_name, starts_prompt) == expected


def test_bad_extra_keys_reject_only_their_event() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    bad = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1],
        "block_size": 1,
        "extra_keys": [3],
    }
    batch = decode_payload(0, enc([1.0, [good, bad, good], 0]))
    assert batch.events == [BlockRemoved([1]), BlockRemoved([1])] and "extra_keys[0]" in batch.bad_events[0]


def test_locality_multimodal_keys_and_string_tokens() -> None:
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [1, 2],
            "block_size": 2,
            "medium": "GPU",
            "locality": "REMOTE",
        },
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "locality": "REMOTE"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "locality": "LOCAL"},
        # TRT-LLM streaming: per-block mm_keys and a digest string in place of a multimodal token.
        {
            "type": "BlockStored",
            "block_hashes": [-5, 6],
            "parent_block_hash": None,
            "token_ids": [1, 2, "ab" * 32, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": None,
            "mm_keys": [[], [{"type": "mm_key", "hash": "cd" * 32, "start_offset": 0, "uuid": "ef" * 8}]],
        },
    ]
    remote_store, remote_remove, local_remove, trt = decode_payload(0, enc([1.0, events, 0])).events
    assert remote_store.remote and remote_remove.remote and not local_remove.remote
    assert trt.block_hashes == [2**64 - 5, 6] and trt.token_ids == [1, 2, "ab" * 32, 4] and trt.unkeyable_from == 1
