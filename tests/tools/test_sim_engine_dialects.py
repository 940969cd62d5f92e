"""Every ZMQ dialect's bytes, read back with a generic msgpack decode and checked against the documented
positions and keys (docs/wire-formats.md#vllm-event-fields, docs/wire-formats.md#sglang-events-per-version,
docs/wire-formats.md#tensorrt-llm-streaming-publisher), and the hash form each engine publishes."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest

from kvroute.tools.sim_engine.dialects import DEFAULT_DIALECT, DIALECTS, get_dialect
from kvroute.tools.sim_engine.engine import EngineConfig
from kvroute.tools.sim_engine.engine_hashes import DialectLabeler
from kvroute.tools.sim_engine.prefix_cache import CPU, CacheNamespace, ClearedEvent, PrefixCache, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.wire_encoding import MsgpackEventEncoder

NS = CacheNamespace(lora_name="sql", lora_id=1, cache_salt="s")
H1, H2, H3 = 11, 12, 13
BATCH = [
    StoredEvent([H1, H2], None, [1, 2, 3, 4], namespace=NS),
    StoredEvent([H3], H2, [5, 6], namespace=NS),
    RemovedEvent([H1]),
    ClearedEvent([H2, H3]),
]

# Per dialect, from the tables of docs/wire-formats.md: batch length, the first BlockStored, the continuing one,
# BlockRemoved.
# `None` in a map means the key is present with nil; a key that is absent is omitted on the wire.
EXPECTED = {
    "vllm-0.9.0": (
        2,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1],
        ["BlockStored", [H3], H2, [5, 6], 2, 1],
        ["BlockRemoved", [H1]],
    ),
    "vllm-0.9.1": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1],
        ["BlockStored", [H3], H2, [5, 6], 2, 1],
        ["BlockRemoved", [H1]],
    ),
    "vllm-0.10.2": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1, "GPU"],
        ["BlockStored", [H3], H2, [5, 6], 2, 1, "GPU"],
        ["BlockRemoved", [H1], "GPU"],
    ),
    "vllm-0.14": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1, "GPU", "sql"],
        ["BlockStored", [H3], H2, [5, 6], 2, 1, "GPU", "sql"],
        ["BlockRemoved", [H1], "GPU"],
    ),
    # extra_keys: per block (LoRA name, salt on the request's first block)
    # (docs/wire-formats.md#vllm-extra-keys-lora-and-cache-salt)
    "vllm-0.17": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1, "GPU", "sql", [["sql", "s"], ["sql"]]],
        ["BlockStored", [H3], H2, [5, 6], 2, 1, "GPU", "sql", [["sql"]]],
        ["BlockRemoved", [H1], "GPU"],
    ),
    "vllm-0.20": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1, "GPU", "sql", [["sql", "s"], ["sql"]], 0],
        ["BlockStored", [H3], H2, [5, 6], 2, 1, "GPU", "sql", [["sql"]], 0],
        ["BlockRemoved", [H1], "GPU", 0],
    ),
    "vllm-0.22": (
        3,
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, 1, "GPU", "sql", [["sql", "s"], ["sql"]], 0, "full_attention", None],
        ["BlockStored", [H3], H2, [5, 6], 2, 1, "GPU", "sql", [["sql"]], 0, "full_attention", None],
        ["BlockRemoved", [H1], "GPU", 0],
    ),
    "sglang-0.4.8": (
        3,
        ["BlockStored", [H1, H2, H3], None, [1, 2, 3, 4, 5, 6], 2, None],
        None,  # coalesced
        ["BlockRemoved", [H1]],
    ),
    "sglang-0.5.9": (
        3,
        ["BlockStored", [H1, H2, H3], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU"],
        None,
        ["BlockRemoved", [H1], "GPU"],
    ),
}
_VLLM_MAP = {
    "type": "BlockStored",
    "block_hashes": [H1, H2],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": 1,
    "medium": "GPU",
    "lora_name": "sql",
    "extra_keys": [["sql", "s"], ["sql"]],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
_VLLM_MAP_NEXT = {**_VLLM_MAP, "block_hashes": [H3], "parent_block_hash": H2, "token_ids": [5, 6], "extra_keys": [["sql"]]}
_VLLM_REMOVED = {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0}
for _name in ("vllm-0.24", "vllm-0.26", "vllm-0.33"):
    EXPECTED[_name] = (3, _VLLM_MAP, _VLLM_MAP_NEXT, _VLLM_REMOVED)
_SGLANG_MAP = {
    "type": "BlockStored",
    "block_hashes": [H1, H2, H3],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4, 5, 6],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "cache_salt": "s",
    "session_id": None,
}
EXPECTED["sglang-0.5.20"] = (3, _SGLANG_MAP, None, {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"})
EXPECTED["sglang-0.5.22"] = (
    3,
    {**_SGLANG_MAP, "lora_name": "sql"},
    None,
    {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"},
)
EXPECTED["trtllm-zmq"] = (
    3,
    {
        "type": "BlockStored",
        "block_hashes": [H1, H2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "mm_keys": [[], []],
    },
    {
        "type": "BlockStored",
        "block_hashes": [H3],
        "parent_block_hash": H2,
        "token_ids": [5, 6],
        "block_size": 2,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "mm_keys": [[]],
    },
    {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0},
)


def test_every_zmq_dialect_is_covered() -> None:
    assert set(EXPECTED) == {name for name, d in DIALECTS.items() if d.transport == "zmq"}
    assert DEFAULT_DIALECT == "vllm-0.26"  # what the sim engine sent before dialects existed


@pytest.mark.parametrize("dialect", sorted(EXPECTED))
def test_batch_and_event_positions_or_keys(dialect: str) -> None:
    length, first, following, removed = EXPECTED[dialect]
    raw = MsgpackEventEncoder(get_dialect(dialect), block_size=2).encode(BATCH, ts=1.5)
    batch = msgspec.msgpack.decode(raw)
    assert isinstance(batch, list) and len(batch) == length and batch[0] == 1.5
    assert raw[:10] == bytes([0x90 + length]) + b"\xcb\x3f\xf8" + bytes(6)  # fixarray, float64 ts
    if length == 3:
        assert batch[2] == 0
    events = batch[1]
    expected = [first] + ([following] if following is not None else []) + [removed]
    assert events[: len(expected)] == expected
    assert events[-1] == ({"type": "AllBlocksCleared"} if isinstance(first, dict) else ["AllBlocksCleared"])
    if isinstance(first, dict):
        assert all(next(iter(e)) == "type" for e in events)  # the tag key comes first
        assert list(events[0]) == list(first)  # and the fields in declaration order


def test_map_header_size_tracks_the_number_of_declared_fields() -> None:
    """msgspec writes map16 once a struct could have more than 15 keys: vLLM 0.33's BlockStored
    (docs/wire-formats.md#msgspec-encoding-rules)."""
    stored = [StoredEvent([H1], None, [1, 2])]
    old = MsgpackEventEncoder(get_dialect("vllm-0.24"), 2).encode(stored, ts=1.5)
    new = MsgpackEventEncoder(get_dialect("vllm-0.33"), 2).encode(stored, ts=1.5)
    assert old[10:12] == b"\x91\x8a" and new[10:14] == b"\x91\xde\x00\x0a"  # 10 keys: fixmap vs map16
    assert msgspec.msgpack.decode(old) == msgspec.msgpack.decode(new)


def test_sglang_coalesces_only_stores_that_continue_each_other() -> None:
    enc = MsgpackEventEncoder(get_dialect("sglang-0.5.9"), 2)
    other_chain = StoredEvent([21], 99, [7, 8])
    events = msgspec.msgpack.decode(
        enc.encode(
            [
                StoredEvent([H1], None, [1, 2]),
                StoredEvent([H2], H1, [3, 4]),
                other_chain,
                RemovedEvent([H1]),
                StoredEvent([H3], H2, [5, 6]),
            ]
        )
    )[1]
    assert [e[1] for e in events] == [[H1, H2], [21], [H1], [H3]]  # a remove in between ends the run
    vllm = msgspec.msgpack.decode(
        MsgpackEventEncoder(get_dialect("vllm-0.22"), 2).encode([StoredEvent([H1], None, [1, 2]), StoredEvent([H2], H1, [3, 4])])
    )[1]
    assert len(vllm) == 2


@pytest.mark.parametrize(
    "dialect,medium,locality",
    [("vllm-0.10.2", "CPU", None), ("vllm-0.26", "CPU", "LOCAL"), ("sglang-0.5.20", "CPU_PINNED", None)],
)
def test_cpu_tier_events_carry_the_engines_medium_name(dialect: str, medium: str, locality: str | None) -> None:
    raw = MsgpackEventEncoder(get_dialect(dialect), 2).encode(
        [RemovedEvent([H1], "GPU", moved_to=CPU), StoredEvent([H1], None, [1, 2], CPU, moved_from="GPU"), RemovedEvent([H1], CPU)]
    )
    removed_gpu, stored_cpu, removed_cpu = msgspec.msgpack.decode(raw)[1]
    if isinstance(stored_cpu, dict):
        assert removed_gpu["medium"] == "GPU" and stored_cpu["medium"] == removed_cpu["medium"] == medium
        assert stored_cpu.get("locality") == removed_cpu.get("locality") == locality
        assert "locality" not in removed_gpu
    else:
        assert removed_gpu == ["BlockRemoved", [H1], "GPU"] and removed_cpu == ["BlockRemoved", [H1], medium]
        assert stored_cpu[:7] == ["BlockStored", [H1], None, [1, 2], 2, None, medium]


@pytest.mark.parametrize("dialect", ["vllm-0.9.1", "sglang-0.4.8", "sglang-0.5.9", "trtllm-zmq"])
def test_a_cpu_tier_is_refused_where_events_cannot_show_it(dialect: str) -> None:
    with pytest.raises(ValueError, match="cannot report a CPU offload tier"):
        EngineConfig(dialect=dialect, cpu_offload_blocks=8)
    EngineConfig(dialect=dialect)


@pytest.mark.parametrize(
    "dialect,form", [("vllm-0.9.1", "bytes"), ("sglang-0.5.22", "bytes"), ("vllm-0.33", "hex"), ("trtllm-zmq", "hex")]
)
def test_hash_forms_exist_only_where_the_spec_says(dialect: str, form: str) -> None:
    with pytest.raises(ValueError, match="block hashes"):
        EngineConfig(dialect=dialect, event_hash_form=form)


# ---------------------------------------------------------------- hash forms on the wire

ONE_TO_16 = list(range(1, 17))


def published(dialect: str, tokens: list[int], form: str | None = None, hash_seed: str = "t") -> tuple[bytes, PrefixCache]:
    """Commit `tokens` as one request's blocks in a cache labelled like `dialect`'s engine; the encoded batch."""
    d = get_dialect(dialect)
    cache = PrefixCache(
        64, 16, hash_seed, digest_bits=128 if form == "bytes" else 64, labeler=DialectLabeler("m", 16, d.hash_scheme(form))
    )
    hashes = cache.chain_hashes(tokens)
    alloc = cache.allocate(hashes, len(tokens), len(tokens) + 1)
    cache.commit(alloc, hashes, tokens)
    return MsgpackEventEncoder(d, 16).encode(cache.take_events()), cache


def stored_hashes(raw: bytes) -> list:
    event = msgspec.msgpack.decode(raw)[1][0]
    return event["block_hashes"] if isinstance(event, dict) else event[1]


def test_vllm_builtin_era_sends_signed_int64() -> None:
    for seed in map(str, range(40)):  # about half of all 64-bit identities are negative as int64
        raw, cache = published("vllm-0.9.1", ONE_TO_16, hash_seed=seed)
        (identity,) = cache.true_block_hashes()
        if identity >= 2**63:
            assert stored_hashes(raw) == [identity - 2**64]
            assert b"\xd3" + (identity - 2**64).to_bytes(8, "big", signed=True) in raw  # msgpack int64
            return
    raise AssertionError("no identity above 2**63 in 40 seeds")


def test_vllm_digest_era_sends_uint64_or_the_digest_bytes() -> None:
    for seed in map(str, range(40)):
        raw, cache = published("vllm-0.10.2", ONE_TO_16, hash_seed=seed)
        (identity,) = cache.true_block_hashes()
        if identity >= 2**63:
            assert stored_hashes(raw) == [identity] and b"\xcf" + identity.to_bytes(8, "big") in raw  # uint64
            break
    else:
        raise AssertionError("no identity above 2**63 in 40 seeds")
    raw, cache = published("vllm-0.24", ONE_TO_16 * 2, form="bytes")
    identities = cache.true_block_hashes()
    digests = stored_hashes(raw)
    assert [len(d) for d in digests] == [16, 16] and b"\xc4\x10" + digests[0] in raw  # msgpack bin 8
    assert [int.from_bytes(d[-8:], "big") for d in digests] == [h & (2**64 - 1) for h in identities]
    event = msgspec.msgpack.decode(raw)[1][0]
    assert event["parent_block_hash"] is None


def test_sglang_hashes_on_the_wire() -> None:
    raw, _ = published("sglang-0.5.9", ONE_TO_16 + list(range(17, 33)))
    d1 = hashlib.sha256(struct.pack("<16I", *ONE_TO_16)).digest()
    d2 = hashlib.sha256(d1 + struct.pack("<16I", *range(17, 33))).digest()
    assert stored_hashes(raw) == [8635429971592222890, int.from_bytes(d2[:8], "big", signed=True)]
    raw, _ = published("sglang-0.4.8", [9] * 32)
    assert stored_hashes(raw) == [hash(tuple([9] * 16))] * 2  # content only: equal pages, equal hashes


def test_trtllm_zmq_sends_v1_block_keys_as_signed_int64() -> None:
    raw, _ = published("trtllm-zmq", ONE_TO_16 + ONE_TO_16)
    first, second = stored_hashes(raw)
    assert first == 6052439777046529588  # the vector of docs/wire-formats.md#tensorrt-llm-block-hashes (positive either way)
    assert -(2**63) <= second < 2**63 and second != first
