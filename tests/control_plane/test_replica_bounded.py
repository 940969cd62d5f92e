"""A replica with --max-index-entries among replicas over a real Redis: its evictions stay its own. It
applies the same log as the others and answers within its bound (never more than they do), and it
writes no snapshot that would carry its losses to the log: it gives the snapshot lease up, a replica
without evictions takes it, and a replica restarted from that snapshot holds every block."""

from __future__ import annotations

import asyncio

from kvroute.control_plane.server import ControlPlaneServer
from kvroute.prefix_index import Tier
from tests.helpers import eventually
from tests.replica_helpers import Agent, start_replica

LEASE = "kvroute:{kvroute:meta}:snapshot-lease"


def keys_of(server: ControlPlaneServer, worker_id: str = "w1") -> set[int]:
    record = server.registry.get(worker_id)
    return set() if record is None else server.registry.index.worker_keys(record.slot, Tier.GPU)


def lease_holder(redis) -> str:
    return redis.cli("get", LEASE).strip()  # a blocking call: poll it slowly (interval=0.05)


async def store_chains(agent: Agent, chains: int, blocks: int = 16) -> None:
    for _ in range(chains):
        agent.store_chain(blocks)
        await asyncio.sleep(0.001)
    await eventually(agent.settled)


async def test_a_bounded_replicas_evictions_stay_its_own(redis_single) -> None:
    url = redis_single.url
    # Snapshot rounds every 0.1 s, so who holds the lease shows within a test's patience.
    small = await start_replica(url, "small", max_index_entries=100, snapshot_interval_s=0.1)
    agent = Agent(f"127.0.0.1:{small.port}")
    full = restarted = None
    try:
        await store_chains(agent, 4)  # 64 blocks: under the bound, so "small" may hold the lease
        await eventually(lambda: lease_holder(redis_single) == "small", interval=0.05, what="small to take the lease")
        await store_chains(agent, 16)  # 320 blocks in all
        truth = set(agent.resolver.held_keys())
        assert len(truth) == 320
        await eventually(lambda: small.registry.index.entry_count() == 100 and keys_of(small) <= truth)
        assert sum(small.registry.index.evicted_entries(small.registry.get("w1").slot).values()) >= 220
        # Lossy now: it gives the lease up and writes no snapshot, even when asked to.
        await eventually(lambda: lease_holder(redis_single) == "", interval=0.05, what="small to give the lease up")
        written_while_exact = small.redis_log.counters.snapshots_written
        assert await small.redis_log.write_snapshots(token=10**6) == 0
        assert small.redis_log.counters.snapshot_skips >= 1

        # A replica without a bound applies the same log, holds everything, takes the lease and writes.
        full = await start_replica(url, "full", snapshot_interval_s=0.1)
        assert keys_of(full) == truth
        await eventually(lambda: lease_holder(redis_single) == "full", interval=0.05, what="full to take the lease")
        await eventually(lambda: full.redis_log.counters.snapshots_written >= 1, what="a snapshot by full")
        assert small.redis_log.counters.snapshots_written == written_while_exact

        # Whatever a router asks, the bounded replica answers at most what the full one does.
        chains = [sorted(truth)[i : i + 16] for i in range(0, 320, 16)]
        for chain in chains:
            ours, theirs = small.registry.index.match_tiers(chain), full.registry.index.match_tiers(chain)
            assert all(depth <= theirs.depth.get(slot, 0) for slot, depth in ours.depth.items())

        # A replica restarted now loads full's snapshot: nothing small dropped went missing elsewhere.
        restarted = await start_replica(url, "restarted")
        assert keys_of(restarted) == truth and restarted.redis_log.counters.snapshots_loaded >= 1

        # Later events reach the bounded replica too (it stays within its bound and keeps up).
        agent.store_chain(8)
        await eventually(agent.settled)
        newest = set(agent.resolver.held_keys()) - truth
        await eventually(lambda: newest <= keys_of(small) and newest <= keys_of(full), what="the newest chain")
        assert small.registry.index.entry_count() == 100
    finally:
        await agent.close()
        for server in (small, full, restarted):
            if server is not None:
                await server.stop(0)
