"""Control-plane replicas over a real Redis (a single server and a 3-master Cluster): an agent on one
replica is in every replica's index, epochs fence a stale agent, a second agent is refused across
replicas, expiry is a log entry, and a restarted replica loads snapshots and catches up."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvroute.control_plane.server import ControlPlaneServer
from kvroute.prefix_index import Tier
from kvroute.tools.redis_harness import TcpProxy
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent.vllm_wire import BlockRemoved, BlockStored
from tests.helpers import eventually
from tests.replica_helpers import TOKENS, Agent, start_replica


def keys_on(server: ControlPlaneServer, worker_id: str = "w1") -> set[int] | None:
    record = server.registry.get(worker_id)
    return None if record is None else server.registry.index.worker_keys(record.slot, Tier.GPU)


async def test_an_agent_on_one_replica_is_in_every_replicas_index(redis_any) -> None:
    a, b = await start_replica(redis_any, "a"), await start_replica(redis_any, "b")
    agent = Agent(f"127.0.0.1:{a.port}")
    agent.link.identity.role = "prefill"  # registered before its stream opens: replicated with the rest
    try:
        agent.apply(BlockStored([1, 2, 3], None, TOKENS[:12], 4))
        await eventually(lambda: agent.link.acked_seq >= 1)
        agent.apply(BlockRemoved([3]), BlockStored([4], 2, TOKENS[8:12], 4))
        await eventually(lambda: agent.link.acked_seq >= 2)
        truth = set(agent.resolver.held_keys())
        await eventually(lambda: keys_on(a) == truth and keys_on(b) == truth, what="both replicas hold the agent's keys")
        # Load arrives through the log too.
        await eventually(lambda: b.registry.get("w1").load.observed_unix_ms > 0, what="heartbeat on b")
        # Routers' view on b: the worker answers queries.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as channel:
            stub = pb_grpc.ControlPlaneStub(channel)
            (worker,) = (await stub.ListWorkers(pb.ListWorkersRequest())).workers
            assert (worker.worker_id, worker.cached_blocks, worker.endpoint) == ("w1", len(truth), "http://w1")
            assert worker.role == "prefill" and b.registry.get("w1").role == "prefill"
    finally:
        await agent.close()
        await a.stop(0)
        await b.stop(0)


async def test_a_second_agent_is_refused_on_another_replica(redis_single) -> None:
    a, b = await start_replica(redis_single.url, "a"), await start_replica(redis_single.url, "b")
    first = Agent(f"127.0.0.1:{a.port}")
    second = None
    try:
        await eventually(lambda: first.link.connected)
        second = Agent(f"127.0.0.1:{b.port}", refused_backoff_s=0.05)
        await eventually(lambda: second.link.counters.refusals >= 2, what="refusal")
        assert second.link.refused.startswith("worker id 'w1' is already connected from ipv4:127.0.0.1:")
        assert "via replica a" in second.link.refused and not second.link.connected
        assert second.link.counters.sessions == 0 and first.link.counters.connect_failures == 0
        # The first agent goes away (its stream ends): the second gets the id at its next try.
        await first.close()
        await eventually(lambda: second.link.connected, what="second agent registered")
        await eventually(lambda: a.registry.get("w1").agent_instance == second.link.instance)
    finally:
        await first.close()
        if second is not None:
            await second.close()
        await a.stop(0)
        await b.stop(0)


async def test_an_agent_whose_replica_died_resumes_on_another_without_a_snapshot(redis_single) -> None:
    proxy = TcpProxy(redis_single.port).start()  # replica a's own way to Redis, to "kill" it uncleanly
    a, b = await start_replica(proxy.url, "a"), await start_replica(redis_single.url, "b")
    agent = Agent(f"127.0.0.1:{a.port},127.0.0.1:{b.port}")
    try:
        await eventually(lambda: agent.link.connected)
        agent.store_chain(2)
        await eventually(agent.settled)
        proxy.cut()  # a dies without releasing anything: the owner key lives on for its TTL
        await a.stop(0)
        agent.store_chain(3)  # held while it moves
        await eventually(lambda: agent.link.connected and agent.link.address == f"127.0.0.1:{b.port}")
        await eventually(agent.settled)
        assert agent.link.counters.resumes == 1 and agent.link.counters.snapshots_sent == 1
        assert agent.link.counters.refusals == 0 and agent.link.counters.failovers == 1
        await eventually(lambda: keys_on(b) == set(agent.resolver.held_keys()))
    finally:
        await agent.close()
        await a.stop(0)
        await b.stop(0)
        proxy.stop()


async def test_a_stale_epoch_is_fenced(redis_single) -> None:
    a = await start_replica(redis_single.url, "a")
    agent = Agent(f"127.0.0.1:{a.port}")
    try:
        await eventually(lambda: agent.link.acked_seq >= 1)
        log = a.redis_log
        keys = log.keys_of("w1")
        await log.redis.incr(keys.worker("w1").replace(":w:", ":unused:"))  # unrelated key: nothing happens
        await log.redis.hincrby(keys.worker("w1"), "epoch", 1)  # another registration happened somewhere
        agent.store_chain(1)
        await eventually(lambda: log.counters.stale_epoch_refusals >= 1, what="stale epoch refusal")
        assert a.service.metrics.stream_errors.labels("stale_epoch")._value.get() >= 1
    finally:
        await agent.close()
        await a.stop(0)


async def test_expiry_is_a_log_entry_every_replica_applies(redis_single) -> None:
    a = await start_replica(redis_single.url, "a", heartbeat_timeout_s=0.5)
    b = await start_replica(redis_single.url, "b", heartbeat_timeout_s=0.5)
    agent = Agent(f"127.0.0.1:{a.port}")
    try:
        agent.store_chain(3)
        await eventually(lambda: keys_on(b) and len(keys_on(b)) == 3)
        await agent.close()  # the agent goes away: after the heartbeat timeout the worker is expired
        await eventually(lambda: keys_on(a) is None and keys_on(b) is None, what="expired on both")
        assert a.redis_log.counters.expiries + b.redis_log.counters.expiries == 1
    finally:
        await agent.close()
        await a.stop(0)
        await b.stop(0)


@pytest.mark.parametrize("snapshot", [False, True])
async def test_a_restarted_replica_catches_up_before_it_is_ready(redis_any, snapshot) -> None:
    a = await start_replica(redis_any, "a")
    agent = Agent(f"127.0.0.1:{a.port}")
    try:
        await eventually(lambda: agent.link.connected)
        for _ in range(20):
            agent.store_chain(16)
            await asyncio.sleep(0.001)
        await eventually(agent.settled)
        assert len(agent.resolver.held_keys()) == 320
        if snapshot:
            assert await a.redis_log.write_snapshots(token=1) >= 1
        b = await start_replica(redis_any, "b")
        try:
            assert keys_on(b) == keys_on(a) == set(agent.resolver.held_keys())
            assert (b.redis_log.counters.snapshots_loaded > 0) == snapshot
        finally:
            await b.stop(0)
    finally:
        await agent.close()
        await a.stop(0)
