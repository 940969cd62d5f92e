"""vLLM KV-event decoding: golden bytes from the wire spec and every array/map era row."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.block_keys import prompt_block_keys
from worker_agent.block_resolver import BlockResolver
from worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, WireFormatError, decode_frames, decode_payload

U64 = 2**64 - 1
enc = msgspec.msgpack.encode
SEQ0 = (0).to_bytes(8, "big")


def test_golden_vllm_0_9_0_bytes_from_spec() -> None:
    # Spec §2.7: EventBatch(ts=1.5, [BlockStored([-2,3], None, [1,2,3,4], 2, None)]), 2-element batch.
    payload = (
        b"\x92\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x91\x96\xab" + b"BlockStored"
        + b"\x92\xfe\x03\xc0\x94\x01\x02\x03\x04\x02\xc0")
    assert len(payload) == 35
    batch = decode_frames([b"", SEQ0, payload])
    assert batch.ts == 1.5 and batch.dp_rank is None
    assert batch.events == [BlockStored([U64 - 1, 3], None, [1, 2, 3, 4], 2)]


def test_golden_uint64_hash_prefix_from_spec() -> None:
    # Spec §2.7: 0.10.2-0.13 7-element array event with a uint64 hash (cf ff*8) and medium "GPU".
    event = (b"\x97\xab" + b"BlockStored" + b"\x92\xcf" + b"\xff" * 8 + b"\x05\xc0\x94\x01\x02\x03\x04\x04\xc0\xa3GPU")
    payload = b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x91" + event + b"\x00"
    batch = decode_payload(7, payload)
    assert batch.seq == 7 and batch.dp_rank == 0
    assert batch.events == [BlockStored([U64, 5], None, [1, 2, 3, 4], 4, None, "gpu")]


STORED_ARRAY_TAILS = {  # spec §2.6: element counts per version range (including the tag)
    6: [],                              # 0.9.0 - 0.10.1
    7: ["GPU"],                         # 0.10.2 - 0.13
    8: ["GPU", "adapter"],              # 0.14 - 0.16
    9: ["GPU", "adapter", None],        # 0.17 - 0.19
    10: ["GPU", "adapter", None, 0],    # 0.20 - 0.21
    12: ["GPU", "adapter", None, 0, "full_attention", None],  # 0.22 - 0.23
}


@pytest.mark.parametrize("length", sorted(STORED_ARRAY_TAILS))
def test_array_era_block_stored_every_length(length: int) -> None:
    event = ["BlockStored", [11, 12], 10, list(range(8)), 4, None, *STORED_ARRAY_TAILS[length]]
    assert len(event) == length
    batch = decode_payload(0, enc([1.0, [event], 0]))
    (stored,) = batch.events
    assert stored.block_hashes == [11, 12] and stored.parent_block_hash == 10 and stored.block_size == 4
    assert stored.lora_name == ("adapter" if length >= 8 else None)
    assert stored.medium == "gpu"


@pytest.mark.parametrize("event", [["BlockRemoved", [5]], ["BlockRemoved", [5], "GPU"], ["BlockRemoved", [5], "GPU", 0]])
def test_array_era_block_removed_every_length(event: list) -> None:
    assert decode_payload(0, enc([1.0, [event], 0])).events == [BlockRemoved([5], "gpu", event[3] if len(event) > 3 else None)]


def test_map_era_events_with_unknown_keys() -> None:
    stored = {"type": "BlockStored", "block_hashes": [2**63 + 5], "parent_block_hash": None, "token_ids": [1, 2],
              "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
              "kv_cache_spec_kind": "full_attention", "locality": "LOCAL", "lookahead_token_ids": None,
              "some_future_field": {"x": 1}}
    removed = {"type": "BlockRemoved", "block_hashes": [2**63 + 5], "medium": "GPU", "group_idx": 0}
    batch = decode_payload(0, enc([1.0, [stored, removed, {"type": "AllBlocksCleared"}], 0]))
    assert batch.events == [BlockStored([2**63 + 5], None, [1, 2], 2, None, "gpu", 0, "full_attention"),
                            BlockRemoved([2**63 + 5], "gpu", 0), AllBlocksCleared()]


def test_bytes_and_signed_hashes_normalise_to_u64() -> None:
    digest = bytes(range(32))
    event = {"type": "BlockRemoved", "block_hashes": [digest, -1], "medium": None}
    (removed,) = decode_payload(0, enc([1.0, [event], 0])).events
    assert removed.block_hashes == [int.from_bytes(digest[-8:], "big"), U64]


def test_map_batch_is_accepted() -> None:
    batch = decode_payload(3, enc({"ts": 2.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 1}))
    assert batch.events == [AllBlocksCleared()] and batch.dp_rank == 1


def test_bad_and_unknown_events_do_not_lose_neighbours() -> None:
    good = ["BlockRemoved", [1], "GPU"]
    events = [good, ["BlockStored", "not-a-list", None, [], 4, None], {"type": "BlockRemoved"}, ["FutureEvent", 1],
              42, good]
    batch = decode_payload(0, enc([1.0, events, 0]))
    assert batch.events == [BlockRemoved([1], "gpu"), BlockRemoved([1], "gpu")]
    assert len(batch.bad_events) == 3 and batch.unknown_events == ["FutureEvent"]


@pytest.mark.parametrize("frames, message", [
    ([b"", SEQ0], "expected 3 frames"),
    ([b"", b"\x00\x01\x02", enc([1.0, [], 0])], "8 bytes"),
    ([b"", SEQ0, b"\xc1\xc1garbage"], "not msgpack"),
    ([b"", SEQ0, enc([1.0, [["BlockRemoved", [1]]], 0])[:-3]], "not msgpack"),  # truncated payload
    ([b"", SEQ0, enc("just a string")], "EventBatch"),
])
def test_malformed_frames_raise_clear_errors(frames: list[bytes], message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_frames(frames)


def test_resolver_chains_keys_across_events_and_is_idempotent() -> None:
    tokens = list(range(1, 49))  # 3 blocks of 16
    resolver = BlockResolver("tiny")
    first = resolver.apply([BlockStored([101, 102], None, tokens[:32], 16)])
    second = resolver.apply([BlockStored([103], 102, tokens[32:48], 16)])
    expected = prompt_block_keys(tokens, 16, "tiny")
    assert list(first[0].stored.block_keys) + list(second[0].stored.block_keys) == expected
    # Real vLLM re-stores and re-removes the same hash: no duplicate keys, no phantom removals.
    assert resolver.apply([BlockStored([103], 102, tokens[32:48], 16)]) == []
    assert resolver.counters.duplicate_stores == 1
    removed = resolver.apply([BlockRemoved([103]), BlockRemoved([103])])
    assert [list(e.removed.block_keys) for e in removed] == [[expected[2]]]
    assert resolver.counters.unknown_removes == 1
    assert sorted(resolver.snapshot()) == sorted(expected[:2])
    # Unknown parent: cannot be keyed, counted; other tiers and groups are not indexed as GPU prefix blocks.
    assert resolver.apply([BlockStored([200], 999, tokens[:16], 16)]) == []
    assert resolver.counters.orphan_blocks == 1
    assert resolver.apply([BlockStored([300], None, tokens[:16], 16, medium="cpu")]) == []
    assert resolver.apply([BlockStored([301], None, tokens[:16], 16, group_idx=1, kv_cache_spec_kind="sliding_window")]) == []
    assert resolver.apply([BlockStored([302], None, tokens[:8], 16)]) == []  # too few token ids
    cleared = resolver.apply([AllBlocksCleared()])
    assert cleared[0].WhichOneof("kind") == "cleared" and len(resolver) == 0


def test_lora_name_namespaces_keys() -> None:
    tokens = list(range(16))
    resolver = BlockResolver("tiny")
    (plain,) = resolver.apply([BlockStored([1], None, tokens, 16)])
    (lora,) = resolver.apply([BlockStored([2], None, tokens, 16, lora_name="sql-adapter")])
    assert list(plain.stored.block_keys) == prompt_block_keys(tokens, 16, "tiny")
    assert list(lora.stored.block_keys) == prompt_block_keys(tokens, 16, "tiny", lora_name="sql-adapter")
