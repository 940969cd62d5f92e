"""The sim engine's KV events: vLLM's exact shapes (wire spec §2.3-§2.7) and transport (§1) over real sockets."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from sim_engine.kv_publisher import END_SEQ, KvEventPublisher, parse_kv_events_config, pub_binds
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


# ---------------------------------------------------------------- over real ZMQ sockets

def test_bind_heuristic_and_config_parsing() -> None:
    assert pub_binds("tcp://*:5557") and pub_binds("tcp://[::]:5557") and pub_binds("ipc:///tmp/x")
    assert pub_binds("inproc://x") and not pub_binds("tcp://127.0.0.1:5557") and not pub_binds("tcp://0.0.0.0:5557")
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config["endpoint"] == "tcp://*:5557" and config["buffer_steps"] == 10000 and config["hwm"] == 100000
    assert config["replay_endpoint"] is None and config["max_queue_size"] == 100000 and config["topic"] == "kv"
    assert KvEventPublisher.from_cli("", 16) is None
    assert KvEventPublisher.from_cli('{"enable_kv_cache_events": true, "publisher": "null"}', 16) is None
    for bad in ('{"enable_kv_cache_events": true, "endpoint_typo": "x"}', "not json", '{"buffer_steps": 0}'):
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)


async def recv_or_none(sock: zmq.asyncio.Socket, timeout: float) -> list[bytes] | None:
    try:
        return await asyncio.wait_for(sock.recv_multipart(), timeout)
    except TimeoutError:
        return None


@pytest.mark.parametrize("era", ["map", "array"])
async def test_sub_socket_receives_three_frame_batches(era: str) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@w0")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # No '*' in the endpoint: like vLLM, the publisher connects and the consumer binds.
    pub = KvEventPublisher({"endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv@w0"}, block_size=2, era=era)
    pub.start()
    try:
        frames = None
        while frames is None:  # ZMQ slow joiner: early batches may be dropped before the connection is up
            pub.publish([RemovedEvent([1])])
            await pub.flush()
            frames = await recv_or_none(sub, 0.1)
        while (late := await recv_or_none(sub, 0.2)) is not None:  # a probe that arrived after its timeout
            frames = late
        first_seq = int.from_bytes(frames[1], "big")
        assert first_seq == pub.seq - 1
        pub.publish([])  # empty steps publish nothing
        pub.publish(EVENTS)
        pub.publish([StoredEvent([7, 8], 6, [1, 2, 3, 4])])
        await pub.flush()
        got = [await asyncio.wait_for(sub.recv_multipart(), 2) for _ in range(2)]
    finally:
        pub.close()
        ctx.destroy(linger=0)
    for i, msg in enumerate(got):
        assert len(msg) == 3 and msg[0] == b"kv@w0" and len(msg[1]) == 8
        assert int.from_bytes(msg[1], "big") == first_seq + 1 + i  # +1 per non-empty batch
    ts, events, rank = msgspec.msgpack.decode(got[0][2])
    assert isinstance(ts, float) and rank == 0 and len(events) == 3
    _, (stored,), _ = msgspec.msgpack.decode(got[1][2])
    if era == "map":
        assert events[0]["type"] == "BlockStored" and events[2] == {"type": "AllBlocksCleared"}
        assert stored == {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": [1, 2, 3, 4],
                          "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                          "kv_cache_spec_kind": "full_attention"}
    else:
        assert events[1] == ["BlockRemoved", [2**63 + 1], "GPU", 0]
        assert stored == ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", None, None, 0, "full_attention", None]


@pytest.mark.parametrize("framing", ["new", "old"])
async def test_replay_over_dealer_returns_requested_batches_then_end_marker(framing: str) -> None:
    pub = KvEventPublisher({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                            "buffer_steps": 3, "topic": "t"}, block_size=2, replay_framing=framing)
    pub.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_last_endpoint)
    try:
        for h in range(5):  # seqs 0..4; the replay ring keeps the last 3
            pub.publish([RemovedEvent([h])])
        await pub.flush()
        await dealer.send_multipart([b"x"])  # invalid request (2 frames at the ROUTER): ignored
        await dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 2)
            replies.append(msg)
            if END_SEQ in msg:
                break
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # older than the ring: starts at seq 2
        first_of_all = await asyncio.wait_for(dealer.recv_multipart(), 2)
        await dealer.send_multipart([b"", (99).to_bytes(8, "big")])  # nothing that new: only the end marker
        skipped = [await asyncio.wait_for(dealer.recv_multipart(), 2) for _ in range(3)]
        only_end = await asyncio.wait_for(dealer.recv_multipart(), 2)
    finally:
        pub.close()
        ctx.destroy(linger=0)
    data, end = replies[:-1], replies[-1]
    assert len(data) == 2
    if framing == "new":
        assert [m[:3] for m in data] == [[b"", b"t", (3).to_bytes(8, "big")], [b"", b"t", (4).to_bytes(8, "big")]]
        assert end == [b"", b"", END_SEQ, b""] and first_of_all[2] == (2).to_bytes(8, "big")
    else:
        assert [m[:2] for m in data] == [[b"", (3).to_bytes(8, "big")], [b"", (4).to_bytes(8, "big")]]
        assert end == [b"", END_SEQ, b""] and first_of_all[1] == (2).to_bytes(8, "big")
    assert [msgspec.msgpack.decode(m[-1])[1][0]["block_hashes"] for m in data] == [[3], [4]]
    assert END_SEQ in skipped[-1] and END_SEQ in only_end and len(only_end) == len(end)


async def test_publish_never_blocks_and_a_full_queue_leaves_a_seq_gap() -> None:
    pub = KvEventPublisher({"endpoint": "tcp://127.0.0.1:*", "max_queue_size": 2}, block_size=2)
    try:
        for h in range(4):  # sender not started yet: the queue holds 2, the other 2 are dropped
            pub.publish([RemovedEvent([h])])
        pub.start()
        await pub.flush()
        pub.publish([RemovedEvent([9])])
        await pub.flush()
        assert pub.dropped_batches == 2
        assert [seq for seq, _ in pub.buffer] == [0, 1, 4]  # the drops show up as a gap
    finally:
        pub.close()


@pytest.mark.parametrize("era", ["map", "array"])
def test_the_agents_independent_decoder_reads_both_eras(era: str) -> None:
    from worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload

    pub = publisher(era)
    try:
        batch = decode_payload(5, pub.encode([StoredEvent([11, 12], 10, [1, 2, 3, 4]), RemovedEvent([11]), ClearedEvent()]))
    finally:
        pub.close()
    assert not batch.bad_events and not batch.unknown_events and batch.dp_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12] and stored.parent_block_hash == 10
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2 and stored.group_idx == 0
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11]
    assert isinstance(cleared, AllBlocksCleared)
