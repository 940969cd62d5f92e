"""TensorRT-LLM pull-path JSON -> per-rank actions: sequence rules, window learning, bad bodies.
The published shapes themselves are golden fixtures (test_worker_agent_golden.py)."""

from __future__ import annotations

import json

import pytest

from kvroute.worker_agent.events import BlockRemoved, BlockStored
from kvroute.worker_agent.trtllm_events import BodyError, RankEvents, RankReset, TrtllmEventConverter


def body(*events: dict) -> bytes:
    return json.dumps(list(events)).encode()


def removed(event_id: int, h: int, window: int = 64, **extra) -> dict:
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": [h]}, "window_size": window, **extra}


def test_sequence_restart_and_late_join() -> None:
    c = TrtllmEventConverter()
    assert [type(a) for a in c.feed(body(removed(5, 1), removed(6, 2)))] == [RankEvents]
    assert c.counters.incomplete_catch_ups == 1
    (reset, events) = c.feed(body(removed(0, 3)))  # the engine restarted: ids start over
    assert reset == RankReset(None, "event_id went back from 6 to 0: engine restarted")
    assert events == RankEvents(None, 0, 0, [BlockRemoved([3])]) and c.counters.sequence_resets == 1
    assert c.feed(b"[]") == []


def test_window_filter_learns_from_created_events_and_falls_back_to_the_widest_seen() -> None:
    c = TrtllmEventConverter()
    # No `created` seen yet: the widest window so far stands in (64, then 128).
    actions = c.feed(body(removed(0, 1, 64), removed(1, 2, 32), removed(2, 3, 128), removed(3, 4, 64)))
    assert [e.block_hashes for a in actions for e in a.events] == [[1], [3]]
    assert c.counters.window_filtered_events == 2
    created = {"event_id": 4, "data": {"type": "created", "num_blocks_per_cache_level": [8]}, "window_size": 64}
    actions = c.feed(body(created, removed(5, 5, 128), removed(6, 6, 64)))
    assert [e.block_hashes for a in actions for e in a.events] == [[6]] and c.full_window == 64


def test_ranks_without_attention_dp() -> None:
    c = TrtllmEventConverter()
    actions = c.feed(body(removed(0, 1, attention_dp_rank=0), removed(1, 2), removed(0, 3, attention_dp_rank=1)))
    assert [e.block_hashes for a in actions for e in a.events] == [[1], [2]] and c.counters.rank_mismatches == 1


def test_bad_events_count_and_keep_their_ids() -> None:
    c = TrtllmEventConverter()
    stored = {
        "event_id": 2,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 9,
                    "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}],
                    "cache_level": 0,
                    "priority": 35,
                }
            ],
        },
        "window_size": 64,
    }
    actions = c.feed(
        body(
            removed(0, 1),
            {"event_id": 1, "data": {"type": "removed"}},
            stored,
            {"event_id": 3, "data": {"type": "stored", "blocks": [{"type": "stored_block", "block_hash": "xyz", "tokens": []}]}},
            {"no": "id"},
            removed(4, 2),
        )
    )
    assert c.counters.malformed_events == 3 and c.counters.gaps == 0  # events 1 and 3 keep the sequence whole
    assert [type(e) for a in actions for e in a.events] == [BlockRemoved, BlockStored, BlockRemoved]


@pytest.mark.parametrize(
    "raw, message", [(b"", "not JSON"), (b"[{", "not JSON"), (b'{"event_id": 1}', "not a JSON array"), (b"[1, 2]", None)]
)
def test_bodies(raw: bytes, message: str | None) -> None:
    c = TrtllmEventConverter()
    if message is None:
        assert c.feed(raw) == [] and c.counters.malformed_events == 2
        return
    with pytest.raises(BodyError, match=message):
        c.feed(raw)


def test_token_extra_ids_and_multimodal_keys_stop_the_chain_at_their_block() -> None:
    def block(h: int, extra: int = 0, **more) -> dict:
        return {
            "type": "stored_block",
            "block_hash": h,
            "cache_level": 0,
            "priority": 35,
            **more,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in (1, 2)],
        }

    event = {
        "event_id": 0,
        "window_size": 64,
        "data": {"type": "stored", "parent_hash": None, "blocks": [block(1), block(2), block(3, extra=7), block(4)]},
    }
    ((stored,),) = [a.events for a in TrtllmEventConverter().feed(body(event))]
    assert stored == BlockStored([1, 2, 3, 4], None, [1, 2] * 4, 2, unkeyable_from=2)
    event["data"]["blocks"] = [
        block(1, mm_keys=[{"type": "mm_key", "hash": "ab" * 32, "uuid": "cd" * 8, "start_offset": 0}]),
        block(2),
    ]
    ((stored,),) = [a.events for a in TrtllmEventConverter().feed(body(event))]
    assert stored.unkeyable_from == 0
