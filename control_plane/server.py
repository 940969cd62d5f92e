"""Runs the control plane: gRPC server, liveness sweeper and an optional /metrics HTTP port.

Health: `grpc.health.v1.Health` on the gRPC port ("" and "kvroute.v1.ControlPlane") and, on the
metrics port, `GET /health` (liveness) and `GET /ready` (200 while serving, 503 once stopping).
The control plane is ready as soon as it serves: an empty registry is a normal state (agents
register after it starts), not a fault. A replica (--redis) is ready once it has loaded the log's
snapshots, caught up with the heads it saw at start, and replayed the other replicas' router
sessions (control_plane.replication.inflight_sync); until then it refuses agents and routers with
UNAVAILABLE so they ask another replica."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvroute.addresses import parse_redis_url
from kvroute.aio import cancel_and_wait
from kvroute.build_info import register_build_info
from kvroute.control_plane.auditor import PeriodicAuditor
from kvroute.control_plane.authority import Authority
from kvroute.control_plane.follow import FollowFeed
from kvroute.control_plane.metrics import ApplyCollector, ControlPlaneMetrics, IndexCollector, InflightCollector
from kvroute.control_plane.replication.inflight_sync import InflightSync
from kvroute.control_plane.replication.metrics import RedisLogCollector
from kvroute.control_plane.replication.redis_log import RedisEventLog, RedisLogConfig
from kvroute.control_plane.replication.redis_url import connect
from kvroute.control_plane.service import GRPC_MESSAGE_LIMIT, ControlPlaneService
from kvroute.fleet.state import FleetState
from kvroute.grpc_requests import add_servicer
from kvroute.listeners import GrpcListener, start_status_site
from kvroute.prefix_index import make_index
from kvroute.process import announce_when_ready, wait_for_stop_signal, write_port_file
from kvroute.status import Readiness, status_routes
from kvroute.tls import TlsFiles, grpc_message_options, server_tls
from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.control_plane")
SERVICES = (pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name,)  # for grpc.health.v1, besides ""


@dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    heartbeat_timeout_s: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None = no metrics endpoint; 0 = any free port
    speculative_ttl_s: float = 5.0  # a reservation's blocks count as cached there this long (ttl_ms = 0)
    reservation_max_age_s: float = 600.0  # reservations never released are dropped after this
    audit_interval_s: float = 0.0  # compare the index with engines serving /kvroute/blocks (0 = off)
    audit_settle_s: float = 0.5
    audit_probe: bool = False  # ... and probe the workers whose engine does not serve it
    audit_probe_deadline_s: float = 5.0
    redis_url: str = ""  # "" = embedded (one in-memory process); else a replica over Redis
    redis_shards: int = 16
    snapshot_interval_s: float = 10.0
    replica_id: str = ""  # "" = HOST-PID
    max_index_entries: int = 0  # 0 = unbounded; else drop keys not matched recently past this many entries
    index_backend: str = "auto"  # kvroute.prefix_index.backends: auto (native when built), native, bitmask
    tls: TlsFiles = field(default_factory=TlsFiles)  # none = plaintext; cert+key = TLS; + CA = mTLS with per-identity authority
    grpc_max_message_bytes: int = GRPC_MESSAGE_LIMIT
    follow_window_changes: int = 200_000  # the follow feed's window (routers that reconnect resume inside it)
    follow_window_bytes: int = 256 * 1024 * 1024


class ControlPlaneServer:
    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.metrics_registry = CollectorRegistry()
        register_build_info(self.metrics_registry, "control_plane")
        index = make_index(config.index_backend, config.max_index_entries)  # IndexBackendError: one line
        self.state = FleetState.build(
            index,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            speculative_ttl_s=config.speculative_ttl_s,
            reservation_max_age_s=config.reservation_max_age_s,
        )
        self.inflight, self.registry = self.state.inflight, self.state.registry
        self.service = ControlPlaneService(self.state, ControlPlaneMetrics(self.metrics_registry))
        self.tls = server_tls(config.tls)  # raises TlsConfigError (one line) for files that do not load
        authority = Authority(self.metrics_registry)  # its counter is exported (at 0) without mTLS too
        if config.tls.mutual:
            self.service.authority = authority
        self.replica_id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.feed = self.service.feed = FollowFeed(
            self.state, self.replica_id, config.follow_window_changes, config.follow_window_bytes
        )
        self.redis_log: RedisEventLog | None = None
        self.inflight_sync: InflightSync | None = None
        if config.redis_url:
            self.redis_log = RedisEventLog(
                self.service.applier,
                connect(parse_redis_url(config.redis_url)),
                RedisLogConfig(
                    shards=config.redis_shards, replica_id=self.replica_id, snapshot_interval_s=config.snapshot_interval_s
                ),
            )
            self.service.log = self.redis_log
            self.inflight_sync = InflightSync(self.redis_log.redis, self.inflight, self.registry, self.replica_id)
            self.service.router_events = self.inflight_sync
            self.service.refuse_routers = self._refuse_routers
            self.metrics_registry.register(RedisLogCollector(self.redis_log, self.inflight_sync))
        self.metrics_registry.register(ApplyCollector(self.service.applier))
        self.metrics_registry.register(InflightCollector(self.inflight, lambda: self.service.router_sessions))
        self.metrics_registry.register(IndexCollector(index))
        self.auditor = (
            PeriodicAuditor(
                self.registry,
                self.metrics_registry,
                config.audit_interval_s,
                settle_s=config.audit_settle_s,
                probe=config.audit_probe,
                probe_deadline_s=config.audit_probe_deadline_s,
            )
            if config.audit_interval_s > 0
            else None
        )
        self.port = 0
        self.metrics_port = 0  # the bound /metrics port, once listening
        self._grpc: GrpcListener | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._audit_task: asyncio.Task[None] | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._ready_task: asyncio.Task[None] | None = None
        self._accepting = False  # the gRPC server has started and is not stopping

    def _refuse_routers(self) -> str | None:
        if not self._replica_ready():
            return f"control plane replica {self.replica_id} is catching up with the log; try another replica"
        return None

    def _replica_ready(self) -> bool:
        """Not a replica, or caught up with the log and with the other replicas' router sessions."""
        return self.redis_log is None or (self.redis_log.ready and self.inflight_sync.ready)

    @property
    def ready(self) -> bool:
        """Serving (between start and stop) and, for a replica, caught up (`_replica_ready`)."""
        return self._accepting and self._replica_ready()

    async def start(self) -> int:
        """Listen and serve; raises ListenError (nothing left running) when a port cannot be had."""
        self._grpc = GrpcListener(
            "--listen",
            self.config.listen,
            SERVICES,
            grpc_message_options(self.config.grpc_max_message_bytes),
            credentials=self.tls.grpc_credentials() if self.tls else None,
        )
        self.port = self._grpc.port
        add_servicer(
            self._grpc.server,
            pb.DESCRIPTOR.services_by_name["ControlPlane"],
            self.service,
            on_unparseable=self.service.count_unparseable,
        )
        try:
            if self.config.metrics_port is not None:  # before serving: a busy metrics port must not leave a half-started plane
                self._metrics_runner, self.metrics_port = await start_status_site(
                    "--metrics-port",
                    self.config.metrics_host,
                    self.config.metrics_port,
                    status_routes(self.metrics_registry, health=self.health, readiness=self.readiness),
                )
            await self._grpc.start(serving=self.redis_log is None)
            self._accepting = True
        except BaseException:
            await self.stop(0)
            raise
        if self.redis_log is not None:
            await self.redis_log.start()
            # Reservations name workers: the registry is loaded from the log before they are replayed.
            await self.inflight_sync.start(lambda: self.redis_log.wait_ready(None))
            self._health_task = asyncio.create_task(self._grpc.follow(lambda: self.ready, 0.05), name="kvroute-cp-health")
        self._sweeper = asyncio.create_task(self.service.expire_forever(max(0.05, self.config.heartbeat_timeout_s / 5)))
        if self.auditor:
            self._audit_task = asyncio.create_task(self.auditor.run_forever(), name="kvroute-cp-audit")
        log.info(
            "control plane listening on %s:%d (%s; prefix index %s%s)",
            self._grpc.host,
            self.port,
            "mTLS, writes checked against client certificates" if self.config.tls.mutual else "TLS" if self.tls else "plaintext",
            type(self.registry.index).__name__,
            f", at most {self.config.max_index_entries} entries" if self.config.max_index_entries else "",
        )
        self._ready_task = asyncio.create_task(
            announce_when_ready(
                lambda: self.ready,
                lambda: log.info("control plane ready%s", " (caught up with the log)" if self.redis_log is not None else ""),
            ),
            name="kvroute-cp-ready",
        )
        return self.port

    async def stop(self, grace_s: float = 0.5) -> None:
        self._accepting = False
        await cancel_and_wait(self._sweeper, self._audit_task, self._health_task, self._ready_task)
        if self._grpc:  # health goes NOT_SERVING first, while /ready still answers 503
            await self._grpc.stop(grace_s)
        if self.inflight_sync is not None:
            await self.inflight_sync.stop()
        if self.redis_log is not None:
            await self.redis_log.stop()
        if self._metrics_runner:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    @property
    def serving(self) -> bool:
        return self._grpc is not None and self._grpc.serving

    async def wait(self) -> None:
        assert self._grpc is not None
        await self._grpc.server.wait_for_termination()

    def health(self) -> dict:
        return {"status": "ok", "workers": len(self.registry)}

    def readiness(self) -> Readiness:
        problems = [] if self._accepting else ["the gRPC server is not serving (starting or stopping)"]
        if self.redis_log is not None:
            problems += self.redis_log.problems() + self.inflight_sync.problems()
        details = {"serving": self.ready, "workers": len(self.registry)}
        if self.redis_log is not None:
            details["replica_id"] = self.replica_id
        if self.ready:  # a replica cut off from Redis serves its last state: degraded, still ready
            return Readiness(warnings=problems, details=details)
        return Readiness(fatal=problems or ["catching up with the log"], details=details)


async def serve(config: ControlPlaneConfig, port_file: str = "") -> int:
    server = ControlPlaneServer(config)
    await server.start()
    write_port_file(
        port_file, {"grpc": server.port, **({"metrics": server.metrics_port} if server.config.metrics_port is not None else {})}
    )
    await wait_for_stop_signal()
    await server.stop()
    return 0
