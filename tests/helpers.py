"""Helpers shared by test modules (fixtures live in the conftest.py files; test modules never import
one another)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import grpc

from kvroute.tools.local_cluster import LocalCluster, kvroute_argv
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
FAKE_AGENT_BLOCK_SIZE = 16


async def eventually(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01,
                     what: str = "condition") -> None:
    """Poll `predicate()` on the running event loop until it is truthy; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"{what} not reached in time"
        await asyncio.sleep(interval)


async def run_audit(cluster: LocalCluster, *args: str) -> tuple[int, dict, str]:
    proc = await asyncio.create_subprocess_exec(
        *kvroute_argv("audit", "--control-plane", cluster.control_plane_addr, *args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    lines = out.decode().strip().splitlines()
    return proc.returncode, json.loads(lines[-1]), out.decode() + err.decode()


class FakeAgent:
    """A Connect stream that tells the control plane whatever the test wants, heartbeating meanwhile."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = pb_grpc.ControlPlaneStub(self.channel).Connect(self._messages())
        self.heartbeats: asyncio.Task | None = None

    async def _messages(self):
        while (message := await self.outbox.get()) is not None:
            yield message

    async def claim(self, worker_id: str, endpoint: str, tiers: dict[str, list[int]]) -> None:
        await self.outbox.put(pb.AgentMessage(register=pb.RegisterWorker(
            worker_id=worker_id, model="tiny-llama", engine="sim", block_size=FAKE_AGENT_BLOCK_SIZE, endpoint=endpoint)))
        await self.call.read()
        await self.outbox.put(pb.AgentMessage(batch=pb.EventBatch(seq=1, snapshot=True, events=[
            pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, medium=medium)) for medium, keys in tiers.items()])))
        await self.call.read()
        self.heartbeats = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            await self.outbox.put(pb.AgentMessage(heartbeat=pb.Heartbeat(load=pb.WorkerLoad())))
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.heartbeats:
            self.heartbeats.cancel()
        await self.outbox.put(None)
        await self.channel.close()
