"""Redis faults: a replica cut off while the log is trimmed reloads the trimmed shards and converges;
Redis gone for every replica costs nothing but freshness: agents hold their batches and resume."""

from __future__ import annotations

import asyncio

from kvroute.prefix_index import Tier
from kvroute.tools.redis_harness import TcpProxy
from tests.helpers import eventually
from tests.replica_helpers import Agent, start_replica


def keys_on(server, worker_id: str = "w1") -> set[int] | None:
    record = server.registry.get(worker_id)
    return None if record is None else server.registry.index.worker_keys(record.slot, Tier.GPU)


async def test_a_replica_cut_off_while_the_log_was_trimmed_reloads_and_converges(redis_single) -> None:
    proxy = TcpProxy(redis_single.port).start()
    a = await start_replica(redis_single.url, "a", heartbeat_timeout_s=30.0)
    b = await start_replica(proxy.url, "b", heartbeat_timeout_s=30.0)
    agent = Agent(f"127.0.0.1:{a.port}")
    try:
        await eventually(lambda: agent.link.connected)
        agent.store_chain(4)
        await eventually(lambda: agent.settled() and keys_on(b) == set(agent.resolver.held_keys()))
        proxy.cut()
        for _ in range(5):  # entries b will never read: trimmed behind a snapshot before it is back
            agent.store_chain(3)
            await eventually(agent.settled)
        assert await a.redis_log.write_snapshots(token=1) >= 1
        await asyncio.sleep(0.2)
        assert keys_on(b) != set(agent.resolver.held_keys())  # b is stale while cut off ...
        assert b.ready  # ... but keeps serving its last state
        proxy.restore()
        await eventually(lambda: keys_on(b) == set(agent.resolver.held_keys()), 10, what="b converged after the cut")
        assert b.redis_log.counters.shard_reloads >= 1
    finally:
        await agent.close()
        await a.stop(0)
        await b.stop(0)
        proxy.stop()


async def test_redis_down_for_every_replica_then_back(redis_single) -> None:
    proxies = [TcpProxy(redis_single.port).start() for _ in range(2)]
    a = await start_replica(proxies[0].url, "a", heartbeat_timeout_s=30.0)
    b = await start_replica(proxies[1].url, "b", heartbeat_timeout_s=30.0)
    agent = Agent(f"127.0.0.1:{a.port},127.0.0.1:{b.port}")
    try:
        await eventually(lambda: agent.link.connected)
        agent.store_chain(4)
        await eventually(lambda: agent.settled() and keys_on(a) == keys_on(b) == set(agent.resolver.held_keys()))
        before = set(agent.resolver.held_keys())
        for proxy in proxies:
            proxy.cut()
        for _ in range(5):  # the engine goes on; the agent holds these
            agent.store_chain(2)
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        # Nothing crashed; both replicas serve their last state.
        assert a.ready and b.ready and keys_on(a) == keys_on(b) == before
        assert not agent.link.connected or agent.link._held
        for proxy in proxies:
            proxy.restore()
        truth = set(agent.resolver.held_keys())
        await eventually(lambda: keys_on(a) == keys_on(b) == truth, 15, what="both replicas converged")
        await eventually(agent.settled)
        # The held batches were re-sent: a resume, not a snapshot.
        assert agent.link.counters.snapshots_sent == 1 and agent.link.counters.resumes >= 1
    finally:
        await agent.close()
        await a.stop(0)
        await b.stop(0)
        for proxy in proxies:
            proxy.stop()
