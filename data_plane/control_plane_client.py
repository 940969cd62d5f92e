"""The router's view of the control plane: deadline-bounded Query plus a background fleet
refresher, so a slow or dead control plane degrades routing to load-only, never to errors."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

log = logging.getLogger("kvroute.router.cp")


@dataclass(slots=True)
class KnownWorker:
    worker_id: str
    model: str
    endpoint: str
    block_size: int
    load: pb.WorkerLoad


class ControlPlaneClient:
    def __init__(self, address: str, query_timeout_s: float = 0.02, refresh_interval_s: float = 0.5,
                 static_workers: dict[str, str] | None = None, static_block_size: int = 16) -> None:
        self.address = address
        self.query_timeout_s = query_timeout_s
        self.refresh_interval_s = refresh_interval_s
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = pb_grpc.ControlPlaneStub(self._channel)
        self.fleet: dict[str, KnownWorker] = {}
        self.fleet_updated_at = 0.0
        self._static = {wid: KnownWorker(wid, "", url, static_block_size, pb.WorkerLoad())
                        for wid, url in (static_workers or {}).items()}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        await self._channel.close()

    def workers_for(self, model: str) -> list[KnownWorker]:
        known = [w for w in self.fleet.values() if w.model == model]
        if known:
            return known
        if not self.fleet_updated_at and self._static:
            return list(self._static.values())  # control plane never reached: static fallback fleet
        return []

    def models(self) -> set[str]:
        return {w.model for w in self.fleet.values()}

    async def refresh(self) -> None:
        response = await self._stub.ListWorkers(pb.ListWorkersRequest(), timeout=1.0)
        self.fleet = {w.worker_id: KnownWorker(w.worker_id, w.model, w.endpoint, w.block_size, w.load)
                      for w in response.workers}
        self.fleet_updated_at = time.monotonic()

    async def _refresh_forever(self) -> None:
        failures = 0
        while True:
            try:
                await self.refresh()
                if failures:
                    log.info("control plane %s reachable again", self.address)
                failures = 0
            except grpc.aio.AioRpcError as exc:
                failures += 1
                if failures in (1, 20) or failures % 200 == 0:
                    log.warning("control plane %s unreachable (%s); routing on last known fleet", self.address,
                                exc.code().name)
            await asyncio.sleep(self.refresh_interval_s)

    async def query(self, model: str, chains: dict[int, list[int]]) -> list[pb.WorkerMatch]:
        request = pb.QueryRequest(model=model, chains=[pb.KeyChain(block_size=bs, block_keys=keys)
                                                       for bs, keys in chains.items()])
        response = await self._stub.Query(request, timeout=self.query_timeout_s)
        return list(response.workers)
