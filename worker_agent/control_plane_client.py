"""The agent's side of `ControlPlane.Connect`: register, snapshot, deltas, heartbeats, reconnect.

After every (re)connect the first batch is a snapshot of everything the worker holds, so
whatever was lost while disconnected (or sent but never acked) is superseded. Deltas produced
while disconnected are dropped for the same reason. The control plane being down never stops
the agent from consuming engine events.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

log = logging.getLogger("kvroute.agent.cp")
GRPC_OPTIONS = [("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.max_receive_message_length", 256 * 1024 * 1024)]


@dataclass
class WorkerIdentity:
    worker_id: str
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str = ""


class ControlPlaneLink:
    def __init__(self, address: str, identity: WorkerIdentity, snapshot: Callable[[], list[int]],
                 load: Callable[[], pb.WorkerLoad], heartbeat_interval_s: float = 1.0) -> None:
        self.address, self.identity = address, identity
        self._snapshot, self._load = snapshot, load
        self.heartbeat_interval_s = heartbeat_interval_s
        self._deltas: asyncio.Queue[list[pb.BlockEvent]] = asyncio.Queue()
        self.connected = False
        self.sessions = 0
        self.acked_seq = 0
        self._session_task: asyncio.Task | None = None

    def send(self, events: list[pb.BlockEvent]) -> None:
        """Queue deltas; dropped while disconnected (the next snapshot covers them)."""
        if self.connected and events:
            self._deltas.put_nowait(events)

    def reconnect(self) -> None:
        """Force a new session (e.g. after the identity changed or the worker state was reset)."""
        if self._session_task:
            self._session_task.cancel()

    async def run(self) -> None:
        backoff = 0.1
        while True:
            self._session_task = asyncio.create_task(self._session())
            started = time.monotonic()
            try:
                await self._session_task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
            except grpc.aio.AioRpcError as exc:
                log.warning("control plane %s: %s %s", self.address, exc.code().name, exc.details())
            except Exception:  # never let the link die
                log.exception("control plane session failed")
            self.connected = False
            if time.monotonic() - started > 5:
                backoff = 0.1
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0)

    async def _session(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS) as channel:
            call = pb_grpc.ControlPlaneStub(channel).Connect(self._outgoing())
            async for message in call:
                kind = message.WhichOneof("body")
                if kind == "registered":
                    self.sessions += 1
                    log.info("registered with control plane %s as %s", self.address, self.identity.worker_id)
                elif kind == "ack":
                    self.acked_seq = message.ack.seq

    async def _outgoing(self):
        i = self.identity
        yield pb.AgentMessage(register=pb.RegisterWorker(worker_id=i.worker_id, model=i.model, engine=i.engine,
                                                         block_size=i.block_size, endpoint=i.endpoint,
                                                         engine_version=i.engine_version))
        # Everything queued so far is contained in the snapshot taken now.
        while not self._deltas.empty():
            self._deltas.get_nowait()
        self.connected = True
        seq = 1
        keys = self._snapshot()
        yield pb.AgentMessage(batch=pb.EventBatch(seq=seq, snapshot=True, events=[
            pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, medium="gpu"))]))
        yield pb.AgentMessage(heartbeat=pb.Heartbeat(load=self._load()))
        while True:
            try:
                events = await asyncio.wait_for(self._deltas.get(), self.heartbeat_interval_s)
            except TimeoutError:
                yield pb.AgentMessage(heartbeat=pb.Heartbeat(load=self._load()))
                continue
            while not self._deltas.empty() and len(events) < 1024:  # coalesce a burst into one batch
                events.extend(self._deltas.get_nowait())
            seq += 1
            yield pb.AgentMessage(batch=pb.EventBatch(seq=seq, events=events))
