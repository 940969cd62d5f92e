"""ControlPlaneLink against a small fake ControlPlane (grpc.aio, real socket) and once against the real one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.tools.local_cluster import free_port
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from kvroute.worker_agent.vllm_wire import BlockRemoved, BlockStored
from tests.helpers import eventually

MODEL = "tiny"
TOKENS = list(range(1, 33))
KEYS = prompt_block_keys(TOKENS, 4, MODEL)  # 8 blocks of 4


class FakeControlPlane(pb_grpc.ControlPlaneServicer):
    """Records every stream; answers `registered` (optionally late), acks batches (optionally never)."""

    def __init__(self, heartbeat_timeout_ms: int = 300, register_delay_s: float = 0.0, ack: bool = True) -> None:
        self.heartbeat_timeout_ms, self.register_delay_s, self.ack = heartbeat_timeout_ms, register_delay_s, ack
        self.streams: list[list[pb.AgentMessage]] = []
        self.registered_at: list[int] = []  # per stream: how many messages had arrived when `registered` was sent

    async def Connect(self, request_iterator, context):
        messages: list[pb.AgentMessage] = []
        self.streams.append(messages)
        async for message in request_iterator:
            messages.append(message)
            body = message.WhichOneof("body")
            if body == "register":
                await asyncio.sleep(self.register_delay_s)
                self.registered_at.append(len(messages))
                yield pb.ControlMessage(
                    registered=pb.Registered(worker_id=message.register.worker_id, heartbeat_timeout_ms=self.heartbeat_timeout_ms)
                )
            elif body == "batch" and self.ack:
                yield pb.ControlMessage(ack=pb.Ack(seq=message.batch.seq, applied_events=len(message.batch.events)))

    # helpers
    def batches(self, stream: int = -1) -> list[pb.EventBatch]:
        return [m.batch for m in self.streams[stream] if m.WhichOneof("body") == "batch"]

    def heartbeats(self, stream: int = -1) -> list[pb.Heartbeat]:
        return [m.heartbeat for m in self.streams[stream] if m.WhichOneof("body") == "heartbeat"]

    def held_keys(self, stream: int = -1) -> set[int]:
        """Apply the stream the way the control plane does: snapshot replaces, deltas update."""
        held: set[int] = set()
        for batch in self.batches(stream):
            if batch.snapshot:
                held = set()
            for e in batch.events:
                kind = e.WhichOneof("kind")
                if kind == "stored":
                    held.update(e.stored.block_keys)
                elif kind == "removed":
                    held.difference_update(e.removed.block_keys)
                else:
                    held.clear()
        return held


async def start_server(servicer: pb_grpc.ControlPlaneServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


class Worker:
    def __init__(self, port: int, **link_options) -> None:
        self.resolver = BlockResolver(MODEL)
        self.load = pb.WorkerLoad(running_requests=3, waiting_requests=1, kv_usage=0.25, observed_unix_ms=1)
        self.identity = WorkerIdentity("w1", MODEL, "vllm", 4, "http://10.0.0.7:8000", "0.32.0")
        link_options.setdefault("backoff_max_s", 0.3)
        self.link = ControlPlaneLink(
            f"127.0.0.1:{port}", self.identity, self.resolver.snapshot_events, lambda: self.load, **link_options
        )
        self.task = asyncio.create_task(self.link.run())

    def apply(self, *events) -> None:  # what the agent does for every engine batch
        self.link.send(self.resolver.apply(list(events)))

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def fake():
    servicer = FakeControlPlane()
    server, port = await start_server(servicer)
    yield servicer, port
    await server.stop(0)


async def test_register_snapshot_batches_acks_heartbeats(fake) -> None:
    cp, port = fake
    w = Worker(port)
    w.apply(BlockStored([1, 2], None, TOKENS[:8], 4))  # before connecting: goes into the snapshot
    try:
        await w.link.connected_event.wait()
        w.apply(BlockStored([3], 2, TOKENS[8:12], 4))
        await eventually(lambda: w.link.acked_seq >= 2)
        w.apply(BlockRemoved([1]), BlockStored([4], 3, TOKENS[12:16], 4))
        await eventually(lambda: w.link.acked_seq >= 3 and len(cp.heartbeats()) >= 3)
        first = cp.streams[0][0]
        assert first.WhichOneof("body") == "register"
        assert first.register == pb.RegisterWorker(
            worker_id="w1",
            model=MODEL,
            engine="vllm",
            block_size=4,
            endpoint="http://10.0.0.7:8000",
            engine_version="0.32.0",
            agent_instance=w.link.instance,
        )
        batches = cp.batches()
        assert [b.seq for b in batches] == [1, 2, 3]
        assert batches[0].snapshot and list(batches[0].events[0].stored.block_keys) == KEYS[:2]
        assert not batches[1].snapshot and list(batches[1].events[0].stored.block_keys) == [KEYS[2]]
        assert [e.WhichOneof("kind") for e in batches[2].events] == ["removed", "stored"]
        assert cp.held_keys() == {KEYS[1], KEYS[2], KEYS[3]} == set(w.resolver.held_keys())
        assert cp.heartbeats()[0].load == w.load
        assert w.link.counters.batches_acked == 3 and w.link.connected
    finally:
        await w.close()


async def test_snapshot_carries_every_tier_and_identity_carries_rank_and_adapters(fake) -> None:
    cp, port = fake
    w = Worker(port)
    w.identity.lora_adapters[:] = ["sql"]  # the agent updates the list in place when the engine's adapters change
    w.apply(BlockStored([1, 2], None, TOKENS[:8], 4), BlockRemoved([2]), BlockStored([2], 1, TOKENS[4:8], 4, medium="cpu"))
    try:
        await w.link.connected_event.wait()
        await eventually(lambda: cp.batches() and cp.heartbeats())
        (snapshot,) = cp.batches()
        assert [(e.stored.tier, list(e.stored.block_keys)) for e in snapshot.events] == [
            (pb.TIER_GPU, KEYS[:1]),
            (pb.TIER_CPU, KEYS[1:2]),
        ]
        assert list(cp.streams[0][0].register.lora_adapters) == ["sql"]
        assert not cp.streams[0][0].register.HasField("data_parallel_rank")
        assert list(cp.heartbeats()[0].lora_adapters) == ["sql"]
        w.identity.lora_adapters[:] = []
        w.identity.data_parallel_rank = 3
        w.link.reregister()
        await eventually(lambda: len(cp.streams) == 2 and cp.heartbeats(1))
        assert cp.streams[1][0].register.data_parallel_rank == 3 and list(cp.heartbeats(1)[-1].lora_adapters) == []
    finally:
        await w.close()


async def test_heartbeats_follow_the_control_planes_timeout_even_under_steady_deltas(fake) -> None:
    cp, port = fake  # heartbeat_timeout_ms=300 -> every 100 ms
    w = Worker(port)
    try:
        await w.link.connected_event.wait()
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(40):  # a delta every 20 ms never starves the heartbeats
            w.apply(BlockStored([100 + i], None, [i, i, i, i], 4))
            await asyncio.sleep(0.02)
        elapsed = loop.time() - started
        assert len(cp.heartbeats()) >= 0.5 * elapsed / 0.1
        assert len(cp.batches()) >= 10
    finally:
        await w.close()


async def test_snapshot_waits_for_registered() -> None:
    cp = FakeControlPlane(register_delay_s=0.4)
    server, port = await start_server(cp)
    w = Worker(port)
    try:
        # A moment inside the fake's 0.4 s register delay (both timers of this loop: not a race).
        await asyncio.sleep(0.2)
        assert not w.link.connected and len(cp.streams[0]) == 1  # only the register so far
        await eventually(lambda: cp.batches() if cp.streams else False)
        assert cp.registered_at == [1] and cp.streams[0][1].WhichOneof("body") == "batch"
    finally:
        await w.close()
        await server.stop(0)


async def test_reconnects_after_restart_and_resends_a_current_snapshot() -> None:
    port = free_port()
    cp1 = FakeControlPlane()
    server, _ = await start_server(cp1, port)
    w = Worker(port)
    try:
        w.apply(BlockStored([1, 2], None, TOKENS[:8], 4))
        await w.link.connected_event.wait()
        w.apply(BlockStored([3], 2, TOKENS[8:12], 4))
        await eventually(lambda: w.link.acked_seq >= 2)
        await server.stop(0)  # control plane killed
        await eventually(lambda: not w.link.connected)
        # Engine events keep arriving while it is down: held, then superseded by the snapshot (the
        # restarted control plane does not know this agent: no resume).
        w.apply(BlockRemoved([1]), BlockStored([4, 5], 3, TOKENS[12:20], 4))
        await eventually(lambda: w.link.counters.connect_failures >= 2, what="a few failed reconnect attempts")
        cp2 = FakeControlPlane()
        server, _ = await start_server(cp2, port)  # restarted on the same address
        await eventually(lambda: w.link.connected and cp2.batches())
        snapshot = cp2.batches()[0]
        assert snapshot.seq == 1 and snapshot.snapshot  # seq restarts at 1 on the new stream
        assert set(snapshot.events[0].stored.block_keys) == {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}
        w.apply(BlockRemoved([5]))
        await eventually(lambda: len(cp2.batches()) == 2)
        assert cp2.batches()[1].seq == 2 and cp2.held_keys() == {KEYS[1], KEYS[2], KEYS[3]}
        assert w.link.counters.sessions == 2
    finally:
        await w.close()
        await server.stop(0)


async def test_control_plane_down_at_start_never_crashes() -> None:
    port = free_port()
    w = Worker(port)
    try:
        w.apply(BlockStored([1], None, TOKENS[:4], 4))
        await eventually(lambda: w.link.counters.connect_failures >= 2, what="a few failed connect attempts")
        assert not w.task.done() and not w.link.connected
        cp = FakeControlPlane()
        server, _ = await start_server(cp, port)
        await eventually(lambda: w.link.connected and cp.batches())
        assert list(cp.batches()[0].events[0].stored.block_keys) == KEYS[:1]
        await server.stop(0)
    finally:
        await w.close()


async def test_a_control_plane_back_after_a_long_outage_is_reached_without_waiting_out_the_backoff() -> None:
    """The backoff grows while the control plane is down (here to 10-30 s); its return is noticed by
    the probe channel within about probe_interval_s."""
    port = free_port()
    w = Worker(port, backoff_initial_s=20.0, backoff_max_s=20.0, probe_interval_s=0.1)
    try:
        w.apply(BlockStored([1], None, TOKENS[:4], 4))
        await eventually(lambda: w.link.counters.connect_failures >= 1)
        cp = FakeControlPlane()
        server, _ = await start_server(cp, port)
        started = asyncio.get_running_loop().time()
        await eventually(lambda: w.link.connected and cp.batches(), timeout=3)
        assert asyncio.get_running_loop().time() - started < 2
        assert list(cp.batches()[0].events[0].stored.block_keys) == KEYS[:1]
        await server.stop(0)
    finally:
        await w.close()


async def test_a_reachable_control_plane_that_ends_sessions_gets_the_full_backoff() -> None:
    """Reachable but failing (here: no `registered` in time, as when another agent keeps taking the
    worker over): no probe short-cut, the link waits out its backoff."""
    servicer = FakeControlPlane()
    servicer.register_delay_s = 5.0
    server, port = await start_server(servicer)
    w = Worker(port, register_timeout_s=0.1, backoff_initial_s=2.0, backoff_max_s=2.0, probe_interval_s=0.05)
    try:
        await eventually(lambda: len(servicer.streams) >= 1)
        await asyncio.sleep(0.5)  # the first session timed out at ~0.1 s; the next starts 1-3 s after that
        assert len(servicer.streams) == 1 and w.link.counters.connect_failures == 1
    finally:
        await w.close()
        await server.stop(0)


async def test_unacked_batches_end_the_session_and_a_snapshot_supersedes_them() -> None:
    cp = FakeControlPlane(ack=False)
    server, port = await start_server(cp)
    w = Worker(port, ack_timeout_s=0.3)
    try:
        await w.link.connected_event.wait()
        w.apply(BlockStored([1], None, TOKENS[:4], 4))
        await eventually(lambda: len(cp.streams) >= 2 and cp.batches(1))  # gave up on stream 0, reconnected
        assert cp.batches(1)[0].snapshot and list(cp.batches(1)[0].events[0].stored.block_keys) == KEYS[:1]
    finally:
        await w.close()
        await server.stop(0)


async def test_resync_sends_a_snapshot_on_the_same_stream(fake) -> None:
    cp, port = fake
    w = Worker(port)
    try:
        w.apply(BlockStored([1, 2], None, TOKENS[:8], 4))
        await w.link.connected_event.wait()
        w.resolver.clear()  # what the agent does when the engine restarted
        w.link.resync()
        await eventually(lambda: len(cp.batches()) == 2)
        assert cp.batches()[1].snapshot and list(cp.batches()[1].events[0].stored.block_keys) == []
        assert len(cp.streams) == 1
    finally:
        await w.close()


async def test_reregister_opens_a_new_stream_with_the_new_identity(fake) -> None:
    cp, port = fake
    w = Worker(port)
    try:
        await w.link.connected_event.wait()
        w.identity.block_size = 32
        w.link.reregister()
        await eventually(lambda: len(cp.streams) == 2 and cp.batches(1))
        assert cp.streams[1][0].register.block_size == 32 and w.link.counters.connect_failures == 0
    finally:
        await w.close()


async def test_against_the_real_control_plane() -> None:
    from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer

    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=0.6))
    port = await server.start()
    w = Worker(port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ControlPlaneStub(channel)
    query = pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=KEYS)])
    try:
        w.apply(BlockStored([1, 2, 3], None, TOKENS[:12], 4))
        await w.link.connected_event.wait()
        w.apply(BlockStored([4, 5], 3, TOKENS[12:20], 4))
        await eventually(lambda: w.link.acked_seq >= 2)
        (match,) = (await stub.Query(query)).workers
        assert (match.worker_id, match.matched_blocks, match.endpoint) == ("w1", 5, "http://10.0.0.7:8000")
        await asyncio.sleep(1.0)  # longer than the heartbeat timeout: heartbeats keep the worker alive
        (match,) = (await stub.Query(query)).workers
        assert match.matched_blocks == 5 and match.load.running_requests == 3
    finally:
        await w.close()
        await channel.close()
        await server.stop(0)
