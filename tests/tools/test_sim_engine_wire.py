"""The sim engine's KV-event transport (docs/wire-formats.md#zmq-transport) over real ZMQ sockets, per dialect: bind rules,
config defaults, data-parallel offsets, replay framings and the fault hooks. Payload shapes are in
test_sim_engine_dialects.py."""

from __future__ import annotations

import asyncio
import contextlib
import random

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.tools.sim_engine.dialects import get_dialect
from kvroute.tools.sim_engine.kv_publisher import END_SEQ, KvEventPublisher, parse_kv_events_config, pub_binds
from kvroute.tools.sim_engine.prefix_cache import ClearedEvent, RemovedEvent, StoredEvent

EVENTS = [StoredEvent([2**63 + 1], None, [1, 2]), RemovedEvent([2**63 + 1]), ClearedEvent()]


# ---------------------------------------------------------------- config and bind rules


def test_bind_heuristic_and_config_parsing() -> None:
    assert pub_binds("tcp://*:5557") and pub_binds("tcp://[::]:5557") and pub_binds("ipc:///tmp/x")
    assert pub_binds("inproc://x") and not pub_binds("tcp://127.0.0.1:5557") and not pub_binds("tcp://0.0.0.0:5557")
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config["endpoint"] == "tcp://*:5557" and config["buffer_steps"] == 10000 and config["hwm"] == 100000
    assert config["replay_endpoint"] is None and config["max_queue_size"] == 100000 and config["topic"] == "kv"
    assert KvEventPublisher.from_cli("", 16) is None
    assert KvEventPublisher.from_cli('{"enable_kv_cache_events": true, "publisher": "null"}', 16) is None
    for bad in (
        '{"enable_kv_cache_events": true, "endpoint_typo": "x"}',
        "not json",
        '{"buffer_steps": 0}',
        '{"bind": true}',
    ):  # "bind" is SGLang >= 0.5.22's key, not vLLM's
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)


def open_publisher(dialect: str, config: str) -> KvEventPublisher | None:
    pub = KvEventPublisher.from_cli(config, 16, get_dialect(dialect))
    if pub is not None:
        pub.close()
    return pub


def test_publisher_defaults_per_engine_version() -> None:
    enable_only = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}'
    # vLLM <= 0.11 and SGLang default to the null publisher; vLLM >= 0.12 to zmq once enabled
    # (docs/wire-formats.md#publisher-configuration).
    assert open_publisher("vllm-0.10.2", enable_only) is None and open_publisher("sglang-0.5.9", enable_only) is None
    assert open_publisher("vllm-0.14", enable_only) is not None
    zmq_only = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}'
    assert open_publisher("sglang-0.5.9", zmq_only) is not None  # SGLang: the flag itself enables events
    assert open_publisher("vllm-0.26", zmq_only) is None and open_publisher("trtllm-zmq", zmq_only) is None
    with pytest.raises(ValueError):
        parse_kv_events_config('{"publisher": "zmq", "format": "dynamo"}', get_dialect("sglang-0.5.22"))


def test_bind_or_connect_per_dialect() -> None:
    def binds(dialect: str, endpoint: str, **extra) -> bool:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, **extra}
        pub = KvEventPublisher(config, 16, get_dialect(dialect))
        pub.close()
        return pub.binds

    # Connecting never fails, so any address works for the connect cases.
    assert not binds("vllm-0.26", "tcp://127.0.0.1:1") and not binds("vllm-0.26", "tcp://0.0.0.0:1")
    assert not binds("sglang-0.5.9", "tcp://0.0.0.0:1") and binds("sglang-0.5.20", "tcp://0.0.0.0:0")
    assert binds("sglang-0.5.22", "tcp://127.0.0.1:0", bind=True)
    assert not binds("sglang-0.5.22", "tcp://127.0.0.1:1", bind=False)
    assert binds("trtllm-zmq", "tcp://127.0.0.1:0")  # TRT-LLM always binds
    assert binds("vllm-0.26", "tcp://*:0") and binds("vllm-0.9.0", "inproc://x")


def test_data_parallel_rank_offsets_ports_and_is_written_into_batches() -> None:
    # Below the kernel's ephemeral range, so no port the OS hands out elsewhere can collide.
    base = random.Random().randrange(20_000, 30_000, 200)
    config = {"endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{base + 100}"}
    pub = KvEventPublisher(config, 16, get_dialect("vllm-0.26"), data_parallel_rank=2)
    try:
        assert pub.last_endpoint.endswith(f":{base + 2}") and pub.replay_last_endpoint.endswith(f":{base + 102}")
        assert msgspec.msgpack.decode(pub.encode([ClearedEvent()]))[2] == 2
    finally:
        pub.close()
    inproc = KvEventPublisher({"endpoint": "inproc://kv"}, 16, get_dialect("trtllm-zmq"), data_parallel_rank=1)
    assert inproc.endpoint == "inproc://kv_dp1"
    inproc.close()
    with pytest.raises(ValueError, match="no data parallelism"):
        KvEventPublisher({"endpoint": "tcp://*:0"}, 16, get_dialect("vllm-0.9.0"), data_parallel_rank=1)
    with pytest.raises(ValueError, match="ipc"):
        KvEventPublisher({"endpoint": "ipc:///tmp/kvroute-x"}, 16, get_dialect("sglang-0.5.22"), data_parallel_rank=1)


def test_only_vllm_0_33_raises_the_replay_high_water_mark() -> None:
    hwm = {}
    for dialect in ("vllm-0.26", "vllm-0.33"):
        pub = KvEventPublisher(
            {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 50},
            16,
            get_dialect(dialect),
        )
        hwm[dialect] = pub._replay.getsockopt(zmq.SNDHWM)
        pub.close()
    assert hwm == {"vllm-0.26": 1000, "vllm-0.33": 102}


# ---------------------------------------------------------------- over real ZMQ sockets


async def recv_or_none(sock: zmq.asyncio.Socket, timeout: float) -> list[bytes] | None:
    try:
        return await asyncio.wait_for(sock.recv_multipart(), timeout)
    except TimeoutError:
        return None


async def connected_sub(ctx: zmq.asyncio.Context, pub: KvEventPublisher, topic: bytes = b"") -> zmq.asyncio.Socket:
    """A SUB socket on `pub`'s endpoint that has provably joined (probe batches until one arrives)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.last_endpoint)
    while await _probe(pub, sub) is None:  # ZMQ slow joiner: early batches are dropped before the connection is up
        pass
    while await recv_or_none(sub, 0.2) is not None:  # a probe that arrived after its timeout
        pass
    return sub


async def _probe(pub: KvEventPublisher, sub: zmq.asyncio.Socket) -> list[bytes] | None:
    pub.publish([RemovedEvent([1])])
    await pub.flush()
    return await recv_or_none(sub, 0.1)


@pytest.mark.parametrize("dialect", ["vllm-0.22", "vllm-0.26", "sglang-0.5.9"])
async def test_sub_socket_receives_three_frame_batches(dialect: str) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@w0")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # No '*' in the endpoint: like vLLM, the publisher connects and the consumer binds.
    pub = KvEventPublisher({"endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv@w0"}, 2, get_dialect(dialect))
    pub.start()
    try:
        frames = None
        while frames is None:
            frames = await _probe(pub, sub)
        while (late := await recv_or_none(sub, 0.2)) is not None:
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
    if dialect == "vllm-0.26":
        assert events[2] == {"type": "AllBlocksCleared"}
        assert stored == {
            "type": "BlockStored",
            "block_hashes": [7, 8],
            "parent_block_hash": 6,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    elif dialect == "vllm-0.22":
        assert events[1] == ["BlockRemoved", [2**63 + 1], "GPU", 0]
        assert stored == ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", None, None, 0, "full_attention", None]
    else:
        assert events[1] == ["BlockRemoved", [2**63 + 1], "GPU"]
        assert stored == ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU"]


async def replay(dealer: zmq.asyncio.Socket, start: int) -> list[list[bytes]]:
    """Every reply message to one replay request, up to and including the end marker."""
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        msg = await asyncio.wait_for(dealer.recv_multipart(), 2)
        replies.append(msg)
        if END_SEQ in msg:
            return replies


@pytest.mark.parametrize(
    "dialect,framing",
    [("vllm-0.24", "old"), ("sglang-0.4.8", "old"), ("vllm-0.26", "new"), ("sglang-0.5.22", "new"), ("trtllm-zmq", "new")],
)
async def test_replay_over_dealer_returns_requested_batches_then_end_marker(dialect: str, framing: str) -> None:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "buffer_steps": 3,
        "topic": "t",
    }
    pub = KvEventPublisher(config, 2, get_dialect(dialect))
    pub.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_last_endpoint)
    try:
        for h in range(5):  # seqs 0..4; the replay ring keeps the last 3
            pub.publish([RemovedEvent([h])])
        await pub.flush()
        await dealer.send_multipart([b"x"])  # invalid request (2 frames at the ROUTER): ignored
        replies = await replay(dealer, 3)
        from_zero = await replay(dealer, 0)  # older than the ring: starts at seq 2
        only_end = await replay(dealer, 99)  # nothing that new: only the end marker
    finally:
        pub.close()
        ctx.destroy(linger=0)
    data, end = replies[:-1], replies[-1]
    assert len(data) == 2
    if framing == "new":
        assert [m[:3] for m in data] == [[b"", b"t", (3).to_bytes(8, "big")], [b"", b"t", (4).to_bytes(8, "big")]]
        assert end == [b"", b"", END_SEQ, b""] and from_zero[0][2] == (2).to_bytes(8, "big")
    else:
        assert [m[:2] for m in data] == [[b"", (3).to_bytes(8, "big")], [b"", (4).to_bytes(8, "big")]]
        assert end == [b"", END_SEQ, b""] and from_zero[0][1] == (2).to_bytes(8, "big")
    assert len(from_zero) == 4 and only_end == [end]
    decoded = [msgspec.msgpack.decode(m[-1])[1][0] for m in data]
    hashes = [e["block_hashes"] if isinstance(e, dict) else e[1] for e in decoded]
    assert hashes == [[3], [4]]


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


# ---------------------------------------------------------------- fault hooks


@contextlib.asynccontextmanager
async def live_and_replay(dialect: str):
    """A started publisher with a joined SUB socket and a DEALER on its replay socket."""
    pub = KvEventPublisher({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}, 2, get_dialect(dialect))
    pub.start()
    ctx = zmq.asyncio.Context()
    try:
        sub = await connected_sub(ctx, pub)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_last_endpoint)
        yield pub, sub, dealer
    finally:
        pub.close()
        ctx.destroy(linger=0)


async def test_dropped_batches_leave_a_gap_that_replay_fills() -> None:
    async with live_and_replay("vllm-0.33") as (pub, sub, dealer):
        base = pub.seq
        assert pub.inject_faults(drop_next_batches=2) == {
            "next_seq": base,
            "drop_next_batches": 2,
            "dropped_by_fault": 0,
            "restarts": 0,
        }
        for h in range(100, 104):
            pub.publish([RemovedEvent([h])])
        await pub.flush()
        live = [await asyncio.wait_for(sub.recv_multipart(), 2) for _ in range(2)]
        assert await recv_or_none(sub, 0.2) is None
        assert [int.from_bytes(m[1], "big") for m in live] == [base + 2, base + 3]  # base, base+1 never came
        filled = (await replay(dealer, base))[:-1]
        assert [int.from_bytes(m[2], "big") for m in filled] == [base, base + 1, base + 2, base + 3]
        assert [msgspec.msgpack.decode(m[3])[1][0]["block_hashes"] for m in filled] == [[100], [101], [102], [103]]
        assert pub.faults.dropped_by_fault == 2 and pub.faults.drop_next_batches == 0


async def test_a_restarted_publisher_counts_from_zero_with_nothing_to_replay() -> None:
    async with live_and_replay("sglang-0.5.9") as (pub, sub, dealer):
        assert pub.seq > 0
        state = pub.inject_faults(restart=True)
        assert state["next_seq"] == 0 and state["restarts"] == 1
        assert len(await replay(dealer, 0)) == 1  # the replay buffer went with the restart: only the end marker
        pub.publish([RemovedEvent([5])])
        await pub.flush()
        msg = await asyncio.wait_for(sub.recv_multipart(), 2)
        assert int.from_bytes(msg[1], "big") == 0 and msgspec.msgpack.decode(msg[2])[1] == [["BlockRemoved", [5], "GPU"]]
        assert [int.from_bytes(m[1], "big") for m in (await replay(dealer, 0))[:-1]] == [0]
