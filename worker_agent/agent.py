"""WorkerAgent: engine KV events -> BlockResolver -> ControlPlaneLink, plus its own /metrics and /health.

Tasks (one asyncio loop): the ZMQ source (decode + resolve run inline, no I/O), the control-plane
link (gRPC writes in its own task, so a slow or absent control plane never stalls the ZMQ
reader), the engine /metrics poller, and the optional metrics HTTP server.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker_agent.block_resolver import BlockResolver
from worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from worker_agent.engine_metrics import EngineLoadPoller
from worker_agent.vllm_wire import DecodedBatch
from worker_agent.zmq_source import VllmZmqSource

log = logging.getLogger("kvroute.agent")
tracer = trace.get_tracer("kvroute.agent")

SUPPORTED_ENGINES = ("vllm",)
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}

# Counters exported as kvroute_agent_<name>_total: name -> help text.
COUNTER_HELP = {
    "batches": "KV event batches applied (live or replayed)",
    "malformed_frames": "ZMQ messages that could not be decoded (dropped)",
    "malformed_events": "single events rejected inside otherwise good batches",
    "unknown_events": "events with an unknown type tag (skipped)",
    "gaps": "sequence gaps in the engine's KV event stream",
    "unrecoverable_gaps": "gaps the replay could not fill (worker state reset)",
    "replays": "replay requests sent to the engine",
    "replay_timeouts": "replay requests without a complete answer in time",
    "sequence_resets": "sequence went backwards: engine restarted (worker state reset)",
    "duplicate_batches": "live copies of batches a replay already applied",
    "orphan_blocks": "stored blocks whose parent block is unknown (cannot be keyed)",
    "duplicate_stores": "stores of a block already held (no-op)",
    "unknown_removes": "removals of a block not held (no-op)",
    "short_token_ids": "stored blocks with fewer token ids than blocks x block_size",
    "unkeyable_blocks": "held blocks with multimodal or embedded content (no key: a text router cannot match them)",
    "partial_blocks": "held partial blocks, smaller than the block size (no key)",
    "remote_blocks": "blocks of events whose locality is not LOCAL (another instance's; skipped)",
    "unknown_medium_blocks": "blocks on a medium name the agent does not know (indexed as disk)",
    "unnamed_lora_blocks": "blocks of a LoRA adapter the engine names only by int id (never matched)",
    "skipped_group_blocks": "blocks of a KV group other than the main full-attention one",
    "state_resets": "worker state resets (cleared and resynced)",
    "engine_metrics_failures": "failed polls of the engine's /metrics",
    "control_plane_sessions": "control-plane streams registered",
    "control_plane_failures": "control-plane connection attempts or sessions that failed",
    "callback_errors": "internal errors while applying a batch",
}


@dataclass
class AgentConfig:
    control_plane: str = "127.0.0.1:50051"
    kv_events: str = "tcp://127.0.0.1:5557"
    engine_url: str = "http://127.0.0.1:8000"
    worker_id: str | None = None      # default: default_worker_id(engine_url)
    model: str | None = None          # default: asked from the engine's GET /v1/models
    block_size: int = 16
    engine: str = "vllm"
    replay_endpoint: str | None = None
    kv_events_bind: bool = False
    topic: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0             # 0 = off
    engine_poll_interval_s: float = 0.5
    replay_timeout_s: float = 1.0
    heartbeat_interval_s: float | None = None  # None: min(1 s, control plane's heartbeat_timeout / 3)


def default_worker_id(engine_url: str) -> str:
    """HOST:PORT of the engine URL; a loopback / unspecified host is replaced by this machine's hostname."""
    parts = urllib.parse.urlsplit(engine_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if host in _LOOPBACK_HOSTS or host.startswith("127."):
        host = socket.gethostname()
    return f"{host}:{port}"


class _AgentCollector:
    def __init__(self, agent: WorkerAgent) -> None:
        self.agent = agent

    def collect(self):
        for name, value in self.agent.counters.items():
            if name in COUNTER_HELP:
                yield CounterMetricFamily(f"kvroute_agent_{name}", COUNTER_HELP[name], value=value)
        yield GaugeMetricFamily("kvroute_agent_blocks", "distinct block keys the worker holds", value=len(self.agent.resolver))
        yield GaugeMetricFamily("kvroute_agent_control_plane_connected", "1 while the control-plane stream is up",
                                value=int(self.agent.link.connected))
        last_seq = self.agent.source.last_seq
        yield GaugeMetricFamily("kvroute_agent_last_seq", "last engine KV event sequence number applied",
                                value=-1 if last_seq is None else last_seq)


class WorkerAgent:
    def __init__(self, config: AgentConfig) -> None:
        if config.engine not in SUPPORTED_ENGINES:
            raise ValueError(f"unsupported engine {config.engine!r}: supported engines are {', '.join(SUPPORTED_ENGINES)}")
        if config.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {config.block_size}")
        self.config = config
        endpoint = config.engine_url.rstrip("/")
        self.identity = WorkerIdentity(config.worker_id or default_worker_id(config.engine_url), config.model or "",
                                       config.engine, config.block_size, endpoint)
        self.resolver = BlockResolver(config.model or "", config.block_size)
        self.load = EngineLoadPoller(config.engine_url, interval_s=config.engine_poll_interval_s)
        self.link = ControlPlaneLink(config.control_plane, self.identity, self.resolver.snapshot_events, lambda: self.load.latest,
                                     heartbeat_interval_s=config.heartbeat_interval_s)
        self.source = VllmZmqSource(config.kv_events, self._on_batch, self._on_reset, config.replay_endpoint,
                                    bind=config.kv_events_bind, topic=config.topic,
                                    replay_timeout_s=config.replay_timeout_s)
        self.state_resets = 0
        self.metrics_port: int | None = None  # the bound port once the metrics server runs
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(_AgentCollector(self))
        self._metrics_runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ event path

    def _on_batch(self, batch: DecodedBatch) -> None:
        with tracer.start_as_current_span("kvroute.agent.apply_batch") as span:
            out = self.resolver.apply(batch.events)
            if out:
                self.link.send(out)
            observed = self.resolver.observed_block_size
            if observed is not None and observed != self.identity.block_size:
                log.warning("engine KV events carry block_size %d but the agent registered %d: re-registering",
                            observed, self.identity.block_size)
                self.identity.block_size = observed
                self.link.reregister()
            if span.is_recording():
                span.set_attribute("kvroute.seq", batch.seq)
                span.set_attribute("kvroute.events", len(batch.events))
                span.set_attribute("kvroute.block_events", len(out))

    def _on_reset(self, reason: str) -> None:
        self.state_resets += 1
        log.warning("worker state unknown (%s): clearing %d blocks and resyncing the control plane", reason,
                    len(self.resolver))
        self.resolver.clear()
        self.link.resync()

    @property
    def counters(self) -> dict[str, int]:
        """Every agent counter by name (tests and /metrics)."""
        out: dict[str, int] = {}
        out.update(self.source.counters.as_dict())
        out.update(self.resolver.counters.as_dict())
        link = self.link.counters
        out.update({f"control_plane_{k}": v for k, v in link.as_dict().items()})
        out["control_plane_failures"] = link.connect_failures
        out["engine_metrics_failures"] = self.load.failures
        out["state_resets"] = self.state_resets
        out["blocks"] = len(self.resolver)
        out["control_plane_connected"] = int(self.link.connected)
        return out

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        if self.config.metrics_port:
            await self.start_metrics_server()
        try:
            if not self.config.model:
                await self._discover_model()
            log.info("agent %s: model %s, KV events %s (%s), control plane %s", self.identity.worker_id,
                     self.identity.model, self.config.kv_events, "bind" if self.config.kv_events_bind else "connect",
                     self.config.control_plane)
            await asyncio.gather(self.source.run(), self.link.run(), self.load.run())
        finally:
            self.source.close()
            await self.stop_metrics_server()

    async def _discover_model(self) -> None:
        """GET /v1/models until the engine answers (it may start after the agent)."""
        url = self.config.engine_url.rstrip("/")
        delay, attempt = 0.5, 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                attempt += 1
                try:
                    async with session.get(url + "/v1/models") as resp:
                        resp.raise_for_status()
                        model = (await resp.json())["data"][0]["id"]
                    if not isinstance(model, str) or not model:
                        raise ValueError(f"bad model id {model!r}")
                    break
                except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as exc:
                    if attempt in (1, 5) or attempt % 30 == 0:
                        log.warning("--model not given and %s/v1/models did not name one yet (attempt %d): %s",
                                    url, attempt, exc or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            try:
                async with session.get(url + "/version") as resp:
                    if resp.status == 200:
                        self.identity.engine_version = str((await resp.json()).get("version", ""))
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                pass
        log.info("engine %s serves model %s", url, model)
        self.identity.model = model
        self.resolver.model = model

    async def start_metrics_server(self) -> int:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, self.config.metrics_host, self.config.metrics_port)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("agent metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port)
        return self.metrics_port

    async def stop_metrics_server(self) -> None:
        if self._metrics_runner:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics_registry)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({
            "status": "ok", "worker_id": self.identity.worker_id, "model": self.identity.model,
            "block_size": self.identity.block_size, "blocks": len(self.resolver),
            "control_plane_connected": self.link.connected, "last_seq": self.source.last_seq})
