"""The agent's link across stream failures and replicas: resume without a snapshot, held batches
re-sent, the bound on what it holds, and several control-plane addresses."""

from __future__ import annotations

import asyncio

from kvroute.addresses import AddressRotation, resolve_all, split_addresses
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.tools.redis_harness import TcpProxy
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from kvroute.worker_agent.vllm_wire import BlockRemoved, BlockStored
from tests.helpers import eventually

MODEL = "tiny"
TOKENS = list(range(1, 65))


class Agent:
    def __init__(self, address: str, **options) -> None:
        self.resolver = BlockResolver(MODEL)
        options.setdefault("backoff_max_s", 0.2)
        self.link = ControlPlaneLink(
            address, WorkerIdentity("w1", MODEL, "vllm", 4, "http://w1"), self.resolver.snapshot_events, pb.WorkerLoad, **options
        )
        self.task = asyncio.create_task(self.link.run())

    def apply(self, *events) -> None:
        self.link.send(self.resolver.apply(list(events)))

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def held_keys(server: ControlPlaneServer, worker_id: str = "w1") -> set[int]:
    record = server.registry.get(worker_id)
    return server.registry.index.worker_keys(record.slot, 0) if record else set()


async def start_cp(**options) -> ControlPlaneServer:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", **options))
    await server.start()
    return server


async def test_a_broken_stream_resumes_and_resends_only_what_was_not_acked() -> None:
    server = await start_cp(heartbeat_timeout_s=5.0)
    proxy = TcpProxy(server.port).start()
    agent = Agent(f"127.0.0.1:{proxy.port}")
    try:
        agent.apply(BlockStored([1, 2], None, TOKENS[:8], 4))
        await eventually(lambda: agent.link.acked_seq >= 1)
        agent.apply(BlockStored([3], 2, TOKENS[8:12], 4))
        await eventually(lambda: agent.link.acked_seq >= 2)
        proxy.cut()  # the stream breaks; the control plane keeps the worker (heartbeat timeout 5 s)
        await eventually(lambda: not agent.link.connected)
        agent.apply(BlockRemoved([1]), BlockStored([4, 5], 3, TOKENS[12:20], 4))  # held meanwhile
        proxy.restore()
        await eventually(lambda: agent.link.connected and agent.link.acked_seq >= 3)
        assert agent.link.counters.resumes == 1 and agent.link.counters.snapshots_sent == 1
        assert held_keys(server) == set(agent.resolver.held_keys())
        assert server.registry.get("w1").last_seq == agent.link.acked_seq == 3
    finally:
        await agent.close()
        proxy.stop()
        await server.stop(0)


async def test_past_the_bound_the_held_deltas_become_a_snapshot() -> None:
    server = await start_cp(heartbeat_timeout_s=5.0)
    proxy = TcpProxy(server.port).start()
    agent = Agent(f"127.0.0.1:{proxy.port}", max_pending_events=4)
    try:
        agent.apply(BlockStored([1], None, TOKENS[:4], 4))
        await eventually(lambda: agent.link.acked_seq >= 1)
        proxy.cut()
        await eventually(lambda: not agent.link.connected)
        parent = 1
        for i in range(2, 12):  # ten single-block stores: more than the 4 events it may hold
            agent.apply(BlockStored([i], parent, TOKENS[(i - 1) * 4 : i * 4], 4))
            parent = i
        assert agent.link.counters.overflow_resyncs == 1
        proxy.restore()
        await eventually(lambda: agent.link.connected and agent.link.counters.snapshots_sent == 2)
        await eventually(lambda: held_keys(server) == set(agent.resolver.held_keys()))
        assert agent.link.counters.resumes == 0
    finally:
        await agent.close()
        proxy.stop()
        await server.stop(0)


async def test_the_agent_moves_to_the_next_address_at_once() -> None:
    first, second = await start_cp(), await start_cp()
    agent = Agent(f"127.0.0.1:{first.port},127.0.0.1:{second.port}", backoff_initial_s=5.0, backoff_max_s=5.0)
    try:
        agent.apply(BlockStored([1, 2], None, TOKENS[:8], 4))
        await eventually(lambda: agent.link.acked_seq >= 1)
        assert agent.link.address == f"127.0.0.1:{first.port}"
        loop = asyncio.get_running_loop()
        await first.stop(0)
        lost = loop.time()
        await eventually(lambda: agent.link.connected and held_keys(second) == set(agent.resolver.held_keys()))
        # No backoff (5 s here) while another address is untried.
        assert loop.time() - lost < 2.0
        assert agent.link.address == f"127.0.0.1:{second.port}" and agent.link.counters.failovers == 1
        # `second` never saw this agent: it answers without resume, so the agent sent a snapshot.
        assert agent.link.counters.snapshots_sent == 2
    finally:
        await agent.close()
        await second.stop(0)


def test_addresses_split_resolve_and_rotate() -> None:
    assert split_addresses(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert resolve_all("127.0.0.1:5") == ["127.0.0.1:5"] and resolve_all("[::1]:5") == ["[::1]:5"]
    names = {"cp:1": ["10.0.0.1:1", "10.0.0.2:1"], "x:2": ["x:2"]}
    rotation = AddressRotation("cp:1,x:2", resolve=lambda a: names[a])
    assert rotation.several
    handed = [rotation.next() for _ in range(4)]
    assert handed == [("10.0.0.1:1", True), ("10.0.0.2:1", False), ("x:2", False), ("10.0.0.1:1", True)]
    names["cp:1"] = ["10.0.0.3:1"]  # the headless Service's pods moved: found at the next round
    assert [rotation.next()[0] for _ in range(3)] == ["10.0.0.2:1", "x:2", "10.0.0.3:1"]
    assert not AddressRotation("solo:1", resolve=lambda a: [a]).several
