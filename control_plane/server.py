"""Runs the control plane: gRPC server, liveness sweeper and an optional /metrics HTTP port."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from control_plane.auditor import PeriodicAuditor
from control_plane.index import BitmaskPrefixIndex
from control_plane.inflight import InflightTracker
from control_plane.registry import WorkerRegistry
from control_plane.service import GRPC_OPTIONS, ControlPlaneMetrics, ControlPlaneService, InflightCollector
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

log = logging.getLogger("kvroute.control_plane")


@dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    heartbeat_timeout_s: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0 = no metrics endpoint
    speculative_ttl_s: float = 5.0       # a reservation's blocks count as cached there this long (ttl_ms = 0)
    reservation_max_age_s: float = 600.0  # reservations never released are dropped after this
    audit_interval_s: float = 0.0         # compare the index with engines serving /kvroute/blocks (0 = off)
    audit_settle_s: float = 0.5
    audit_probe: bool = False             # ... and probe the workers whose engine does not serve it
    audit_probe_deadline_s: float = 5.0


class ControlPlaneServer:
    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.metrics_registry = CollectorRegistry()
        index = BitmaskPrefixIndex()
        self.inflight = InflightTracker(index, default_ttl_s=config.speculative_ttl_s,
                                        max_age_s=config.reservation_max_age_s)
        self.registry = WorkerRegistry(index, heartbeat_timeout_s=config.heartbeat_timeout_s, watcher=self.inflight)
        self.service = ControlPlaneService(self.registry, self.inflight, ControlPlaneMetrics(self.metrics_registry))
        self.metrics_registry.register(InflightCollector(self.inflight))
        self.auditor = (PeriodicAuditor(self.registry, self.metrics_registry, config.audit_interval_s,
                                        settle_s=config.audit_settle_s, probe=config.audit_probe,
                                        probe_deadline_s=config.audit_probe_deadline_s)
                        if config.audit_interval_s > 0 else None)
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._audit_task: asyncio.Task[None] | None = None
        self._metrics_runner: web.AppRunner | None = None

    async def start(self) -> int:
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_ControlPlaneServicer_to_server(self.service, self._server)
        self.port = self._server.add_insecure_port(self.config.listen)
        if self.port == 0:
            raise OSError(f"control plane could not listen on {self.config.listen}")
        await self._server.start()
        self._sweeper = asyncio.create_task(self.service.expire_forever(max(0.05, self.config.heartbeat_timeout_s / 5)))
        if self.auditor:
            self._audit_task = asyncio.create_task(self.auditor.run_forever(), name="kvroute-cp-audit")
        if self.config.metrics_port:
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/health", self._health)
            self._metrics_runner = web.AppRunner(app, access_log=None)
            await self._metrics_runner.setup()
            await web.TCPSite(self._metrics_runner, self.config.metrics_host, self.config.metrics_port).start()
        host = self.config.listen.rsplit(":", 1)[0]
        log.info("control plane ready on %s:%d", host, self.port)
        return self.port

    async def stop(self, grace_s: float = 0.5) -> None:
        for task in (self._sweeper, self._audit_task):
            if task:
                task.cancel()
        if self._metrics_runner:
            await self._metrics_runner.cleanup()
        if self._server:
            await self._server.stop(grace_s)

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics_registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": len(self.registry)})


async def serve(config: ControlPlaneConfig) -> int:
    server = ControlPlaneServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    return 0
