"""SGLang's KV-event dialect (docs/wire-formats.md#sglang-events-per-version): its own positions, bigram
tokens, tolerance. The version rows themselves are golden fixtures (test_worker_agent_golden.py)."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.worker_agent.events import BlockRemoved, BlockStored
from kvroute.worker_agent.msgpack_wire import BatchShapeError
from kvroute.worker_agent.sglang_wire import decode_payload, first_of_pairs

enc = msgspec.msgpack.encode


def test_array_position_7_is_not_a_lora_name() -> None:
    # vLLM puts lora_name at position 7; SGLang arrays end at medium (6). A longer array from a future
    # release must not turn its 8th element into an adapter.
    batch = decode_payload(0, enc([1.0, [["BlockStored", [-1], None, [1, 2], 2, None, "GPU", "not-a-lora"]], 0]))
    assert batch.events == [BlockStored([2**64 - 1], None, [1, 2], 2)] and batch.unknown_fields == ["event 0: $[7:]"]


def test_bad_and_unknown_events_keep_their_neighbours() -> None:
    events = [
        ["BlockRemoved", [1], "GPU"],
        {
            "type": "BlockStored",
            "block_hashes": [2],
            "parent_block_hash": None,
            "token_ids": [[1, 2], []],
            "block_size": 1,
        },  # an empty bigram pair
        {"type": "BlockStored", "block_hashes": [2], "token_ids": [1], "block_size": 0},
        {
            "type": "BlockStored",
            "block_hashes": [3],
            "token_ids": [5],
            "block_size": 1,
            "cache_salt": "t",
            "future": 1,
        },  # parent omitted, unknown key
        ["HiCacheEvicted", [1]],
        ["BlockRemoved", [1], "CPU_PINNED"],
    ]
    batch = decode_payload(4, enc([1.0, events, 2]))
    assert batch.dp_rank == 2 and batch.unknown_events == ["HiCacheEvicted"] and len(batch.bad_events) == 2
    assert batch.events == [BlockRemoved([1]), BlockStored([3], None, [5], 1, cache_salt="t"), BlockRemoved([1], "cpu_pinned")]


def test_bigram_pairs_and_batch_shape() -> None:
    assert first_of_pairs([[1, 9], [2, 9], 3]) == [1, 2, 3]
    with pytest.raises(BatchShapeError):
        decode_payload(0, enc({"ts": 1.0, "events": []}))  # SGLang never sends a map batch
