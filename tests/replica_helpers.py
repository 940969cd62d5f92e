"""Helpers the replica tests share: in-process replicas over a real Redis and agents' links to them."""

from __future__ import annotations

import asyncio

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from kvroute.worker_agent.vllm_wire import BlockStored
from tests.helpers import eventually

MODEL = "tiny"
TOKENS = list(range(1, 257))


async def start_replica(url: str, name: str, **options) -> ControlPlaneServer:
    options.setdefault("heartbeat_timeout_s", 2.0)
    server = ControlPlaneServer(
        ControlPlaneConfig(listen="127.0.0.1:0", redis_url=url, replica_id=name, redis_shards=4, **options)
    )
    await server.start()
    await eventually(lambda: server.ready, 10, what=f"replica {name} ready (log and router sessions)")
    return server


class Agent:
    def __init__(self, address: str, worker_id: str = "w1", resolver: BlockResolver | None = None, **options) -> None:
        self.resolver = resolver or BlockResolver(MODEL)  # a resolver of its own, or a restarted agent's engine state
        options.setdefault("backoff_max_s", 0.2)
        self.link = ControlPlaneLink(
            address,
            WorkerIdentity(worker_id, MODEL, "vllm", 4, f"http://{worker_id}"),
            self.resolver.snapshot_events,
            pb.WorkerLoad,
            **options,
        )
        self.task = asyncio.create_task(self.link.run())
        self.next_hash = 1

    def apply(self, *events) -> None:
        self.link.send(self.resolver.apply(list(events)))

    def store_chain(self, blocks: int) -> None:
        start = self.next_hash
        hashes = list(range(start, start + blocks))
        self.next_hash += blocks
        self.apply(BlockStored(hashes, None, [start * 1000 + i for i in range(blocks * 4)], 4))

    async def chain_past_held(self, timeout_s: float = 10.0) -> list[int]:
        """Once connected, store 4 blocks and wait until they are acked; returns a prompt's chain that
        runs 2 blocks past them (what a router's reservation would claim)."""
        await eventually(lambda: self.link.connected, timeout_s, what="the agent registered")
        self.store_chain(4)
        await eventually(self.settled, timeout_s, what="its blocks acked")
        return list(self.resolver.held_keys()) + [111, 222]

    def settled(self) -> bool:
        """Everything the engine reported so far is acked."""
        link = self.link
        return link.connected and not link._pending and link.acked_seq == link.last_sent_seq

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
