"""Randomized convergence: stores, removes, clears, agent restarts, replica restarts and trims in a
random order against three replicas; at the end every replica's index equals the reference index
built from the engines' truth (a SetPrefixIndex fed only the engines' own blocks)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.prefix_index import TIERS, SetPrefixIndex, Tier
from kvroute.tools.local_cluster import free_port
from kvroute.worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers import eventually
from tests.replica_helpers import Agent

REPLICAS, AGENTS, STEPS = 3, 4, 150


class Engine:
    """One engine's truth (the blocks it holds, per medium) and its agent."""

    def __init__(self, index: int, addresses: str) -> None:
        self.worker_id = f"w{index}"
        self.addresses = addresses
        self.agent = Agent(addresses, self.worker_id)
        self.held: dict[int, str] = {}  # engine hash -> medium
        self.next_hash = index * 1_000_000 + 1

    def store(self, rng: random.Random) -> None:
        blocks = rng.randint(1, 12)
        hashes = list(range(self.next_hash, self.next_hash + blocks))
        self.next_hash += blocks
        medium = "cpu" if rng.random() < 0.2 else "gpu"
        tokens = [rng.randrange(1, 50_000) for _ in range(blocks * 4)]
        self.agent.apply(BlockStored(hashes, None, tokens, 4, medium=medium))
        self.held.update(dict.fromkeys(hashes, medium))

    def remove(self, rng: random.Random) -> None:
        if self.held:
            gone = rng.sample(sorted(self.held), min(len(self.held), rng.randint(1, 6)))
            for medium in ("gpu", "cpu"):
                of_medium = [h for h in gone if self.held[h] == medium]
                if of_medium:
                    self.agent.apply(BlockRemoved(of_medium, medium=medium))
            for h in gone:
                del self.held[h]

    def clear(self) -> None:
        self.agent.apply(AllBlocksCleared())
        self.held.clear()

    async def restart_agent(self) -> None:
        """A new agent process for the same engine: a new instance, the engine's blocks as they are."""
        resolver = self.agent.resolver
        await self.agent.close()
        self.agent = Agent(self.addresses, self.worker_id, resolver=resolver)


async def start_replica_on(url: str, port: int, name: str) -> ControlPlaneServer:
    server = ControlPlaneServer(
        ControlPlaneConfig(listen=f"127.0.0.1:{port}", redis_url=url, replica_id=name, redis_shards=4, heartbeat_timeout_s=3.0)
    )
    await server.start()
    return server


@pytest.mark.parametrize("seed", [1, 2])
async def test_replicas_converge_on_the_engines_truth(redis_any, seed) -> None:
    rng = random.Random(seed)
    ports = [free_port() for _ in range(REPLICAS)]
    replicas = [await start_replica_on(redis_any, port, f"r{i}") for i, port in enumerate(ports)]
    for replica in replicas:
        assert await replica.redis_log.wait_ready(10)
    addresses = ",".join(f"127.0.0.1:{p}" for p in rng.sample(ports, len(ports)))
    engines = [Engine(i, addresses) for i in range(AGENTS)]
    token = 0
    counts: dict[str, int] = {}
    try:
        for _ in range(STEPS):
            action = rng.choices(
                ["store", "remove", "clear", "agent_restart", "replica_restart", "trim"], weights=[10, 5, 1, 1, 1, 2]
            )[0]
            counts[action] = counts.get(action, 0) + 1
            engine = rng.choice(engines)
            if action == "store":
                engine.store(rng)
            elif action == "remove":
                engine.remove(rng)
            elif action == "clear":
                engine.clear()
            elif action == "agent_restart":
                await engine.restart_agent()
            elif action == "replica_restart":
                i = rng.randrange(REPLICAS)
                await replicas[i].stop(0)
                replicas[i] = await start_replica_on(redis_any, ports[i], f"r{i}")
            elif action == "trim":
                token += 1
                live = rng.choice(replicas)
                if live.redis_log.ready:
                    await live.redis_log.write_snapshots(token=token)
            await asyncio.sleep(rng.choice([0, 0.001, 0.01, 0.05]))

        for replica in replicas:
            assert await replica.redis_log.wait_ready(10)
        await eventually(lambda: all(e.agent.settled() for e in engines), 20, what="every agent's batches acked")
        reference = SetPrefixIndex()
        slots = {e.worker_id: i for i, e in enumerate(engines)}
        for e in engines:
            for tier in (Tier.GPU, Tier.CPU):
                reference.store(slots[e.worker_id], e.agent.resolver.held_keys(tier.label), tier)

        def converged(replica: ControlPlaneServer) -> bool:
            for e in engines:
                record = replica.registry.get(e.worker_id)
                if record is None:
                    return False
                for tier in TIERS:
                    if replica.registry.index.worker_keys(record.slot, tier) != reference.worker_keys(slots[e.worker_id], tier):
                        return False
            return len(replica.registry) == len(engines)

        for i, replica in enumerate(replicas):
            await eventually(lambda r=replica: converged(r), 10, what=f"replica r{i} equals the reference ({counts})")
        # The truth really is the engines' blocks, not just what the agents happened to send.
        for e in engines:
            assert len(e.agent.resolver.held_keys("gpu")) + len(e.agent.resolver.held_keys("cpu")) == len(e.held)
        assert counts.get("replica_restart", 0) + counts.get("agent_restart", 0) > 0, counts
    finally:
        for e in engines:
            await e.agent.close()
        for replica in replicas:
            await replica.stop(0)
