"""WorkerAgent: engine KV events -> BlockResolver -> ControlPlaneLink, plus its own /metrics."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from kvroute.v1 import kvroute_pb2 as pb
from worker_agent.block_resolver import BlockResolver
from worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from worker_agent.engine_metrics import EngineLoadPoller
from worker_agent.vllm_wire import BlockStored, DecodedBatch
from worker_agent.zmq_source import VllmZmqSource

log = logging.getLogger("kvroute.agent")
tracer = trace.get_tracer("kvroute.agent")


@dataclass
class AgentConfig:
    control_plane: str
    kv_events: str
    engine_url: str
    worker_id: str
    model: str
    block_size: int = 16
    engine: str = "vllm"
    replay_endpoint: str | None = None
    kv_events_bind: bool = False
    topic: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0


class WorkerAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.resolver = BlockResolver(config.model)
        self.load = EngineLoadPoller(config.engine_url)
        self.identity = WorkerIdentity(config.worker_id, config.model, config.engine, config.block_size,
                                       config.engine_url.rstrip("/"))
        self.link = ControlPlaneLink(config.control_plane, self.identity, self.resolver.snapshot,
                                     lambda: self.load.latest)
        self.source = VllmZmqSource(config.kv_events, self._on_batch, self._on_reset, config.replay_endpoint,
                                    bind=config.kv_events_bind, topic=config.topic)

    async def _on_batch(self, batch: DecodedBatch) -> None:
        with tracer.start_as_current_span("kvroute.agent.apply_batch") as span:
            for event in batch.events:
                if isinstance(event, BlockStored) and event.block_size != self.identity.block_size:
                    log.warning("engine reports block_size %d, agent was registered with %d: re-registering",
                                event.block_size, self.identity.block_size)
                    self.identity.block_size = event.block_size
                    self.resolver.clear()  # keys of the old block size are meaningless
                    self.link.reconnect()
            out = self.resolver.apply(batch.events)
            self.link.send(out)
            if span.is_recording():
                span.set_attribute("kvroute.seq", batch.seq)
                span.set_attribute("kvroute.events", len(batch.events))

    async def _on_reset(self, reason: str) -> None:
        log.warning("worker state reset (%s): clearing %d blocks", reason, len(self.resolver))
        self.resolver.clear()
        self.link.send([pb.BlockEvent(cleared=pb.AllBlocksCleared())])

    async def run(self) -> None:
        runner = await self._start_metrics() if self.config.metrics_port else None
        try:
            await asyncio.gather(self.source.run(), self.link.run(), self.load.run())
        finally:
            self.source.close()
            if runner:
                await runner.cleanup()

    def metrics_text(self) -> bytes:
        registry = CollectorRegistry()

        def gauge(name: str, doc: str, value: float) -> None:
            Gauge(name, doc, registry=registry).set(value)
        for field in self.source.counters.__slots__:
            gauge(f"kvroute_agent_{field}", f"KV event source: {field.replace('_', ' ')}", getattr(self.source.counters, field))
        for field in self.resolver.counters.__slots__:
            gauge(f"kvroute_agent_{field}", f"block resolver: {field.replace('_', ' ')}", getattr(self.resolver.counters, field))
        gauge("kvroute_agent_blocks", "blocks currently held by the worker", len(self.resolver))
        gauge("kvroute_agent_control_plane_connected", "1 while the control-plane stream is up", int(self.link.connected))
        gauge("kvroute_agent_engine_metrics_failures", "failed engine /metrics polls", self.load.failures)
        return generate_latest(registry)

    async def _start_metrics(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", lambda r: web.Response(body=self.metrics_text(),
                                                              headers={"Content-Type": CONTENT_TYPE_LATEST}))
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok", "blocks": len(self.resolver),
                                                                   "control_plane_connected": self.link.connected}))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.config.metrics_host, self.config.metrics_port).start()
        return runner
