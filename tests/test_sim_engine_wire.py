"""The sim engine's KV events have vLLM's exact shapes (wire spec §2.3-§2.7)."""

from __future__ import annotations

import msgspec

from sim_engine.kv_publisher import KvEventPublisher
from sim_engine.prefix_cache import ClearedEvent, RemovedEvent, StoredEvent

EVENTS = [StoredEvent([2**63 + 1], None, [1, 2]), RemovedEvent([2**63 + 1]), ClearedEvent()]


def publisher(era: str) -> KvEventPublisher:
    return KvEventPublisher({"endpoint": "tcp://127.0.0.1:*"}, block_size=2, era=era)


def test_map_era_matches_vllm_0_33_shape() -> None:
    pub = publisher("map")
    try:
        ts, events, rank = msgspec.msgpack.decode(pub.encode(EVENTS))
    finally:
        pub.close()
    assert isinstance(ts, float) and rank == 0
    assert events[0] == {"type": "BlockStored", "block_hashes": [2**63 + 1], "parent_block_hash": None,
                         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                         "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    assert next(iter(events[0])) == "type"
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [2**63 + 1], "medium": "GPU", "group_idx": 0}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_array_era_matches_vllm_0_22_shape() -> None:
    pub = publisher("array")
    try:
        raw = pub.encode(EVENTS)
        _, events, _ = msgspec.msgpack.decode(raw)
    finally:
        pub.close()
    assert events[0] == ["BlockStored", [2**63 + 1], None, [1, 2], 2, None, "GPU", None, None, 0, "full_attention", None]
    assert events[1] == ["BlockRemoved", [2**63 + 1], "GPU", 0]
    assert events[2] == ["AllBlocksCleared"]
    assert b"\xcf\x80\x00\x00\x00\x00\x00\x00\x01" in raw  # uint64 hash as msgpack 0xcf, like vLLM's int form
