"""WorkerAgent: engine KV events -> BlockResolver -> ControlPlaneLink, plus its own /metrics and /health.

One agent per engine. A data-parallel engine is one kvroute worker per rank (`<id>-dp<rank>`, each
registered with its rank): each rank has its own publisher, sequence, resolver and control-plane
stream. Event sources by engine and transport:
- ZMQ (vLLM, SGLang, TRT-LLM's streaming publisher): one `ZmqEventSource` per rank on the rank's
  offset endpoints, decoding the engine's dialect;
- HTTP (TRT-LLM's pull path): one `TrtllmEventPoller` for the server, its events routed by
  attention-DP rank.
Tasks (one asyncio loop): the event sources (decode + resolve run inline, no I/O), one control-plane
link per worker (gRPC writes in their own tasks, so a slow or absent control plane never stalls
the event readers), the engine load poller, the model / LoRA adapter poller, a watch that checks
once a second that the agent follows its engine, and the optional metrics HTTP server: `/metrics`,
`/health` (liveness: always 200 with the agent's state) and `/ready` (200 or 503 with what is
wrong, `WorkerAgent.readiness`).

Following the engine:
- a worker is registered (its control-plane link runs) only while the engine answers `GET
  /v1/models`: not before its first answer, and not after `engine_gone_after_s` without one. Then
  the links end, the control plane drops the workers after its heartbeat timeout (routers stop
  sending there) and the agent registers them again, with a snapshot, when the engine answers.
  Until that bound the routers' own backend health covers requests that fail (a busy engine may
  miss a poll or two; a restarted one takes minutes to load its weights anyway);
- the event sources start once the served model is known (it namespaces every block key);
- a ZMQ publisher not connected for `PUBLISHER_GRACE_S` is logged (rate-limited) until it is;
- a stream silent while the engine's own counters prove it stored new blocks
  (`worker_agent/event_silence.py`) is logged, not ready, and `kvroute_agent_event_stream_silent`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq.asyncio
from aiohttp import web
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvroute.aio import cancel_and_wait
from kvroute.build_info import register_build_info
from kvroute.listeners import start_status_site
from kvroute.process import write_port_file
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.status import Readiness, status_routes
from kvroute.tls import TlsFiles, client_tls
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent import sglang_wire, vllm_wire
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from kvroute.worker_agent.dp_endpoints import check_no_overlap, offset_endpoint, rank_endpoints
from kvroute.worker_agent.engine_metrics import EngineLoadPoller
from kvroute.worker_agent.engine_models import EngineModelsPoller
from kvroute.worker_agent.event_silence import SILENCE_WINDOWS_S, SilenceWatch
from kvroute.worker_agent.events import DecodedBatch
from kvroute.worker_agent.limits import (
    DEFAULT_GRPC_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_BATCH_EVENTS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_POLL_BYTES,
)
from kvroute.worker_agent.trtllm_events import TrtllmEventConverter
from kvroute.worker_agent.trtllm_poller import TrtllmEventPoller
from kvroute.worker_agent.zmq_source import ZmqEventSource

log = logging.getLogger("kvroute.agent")
tracer = trace.get_tracer("kvroute.agent")

SUPPORTED_ENGINES = ("vllm", "sglang", "trtllm")
TRANSPORTS = ("zmq", "http")
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}
WATCH_INTERVAL_S = 1.0
PUBLISHER_GRACE_S = 10.0  # a publisher not connected this long is logged (ZMQ reconnects within 0.1 s of its return)
PROBLEM_LOG_PERIOD_S = 60.0

# Counters exported as kvroute_agent_<name>_total (summed over a data-parallel engine's ranks): name -> help text.
COUNTER_HELP = {
    "batches": "KV event batches applied (live or replayed)",
    "malformed_frames": "ZMQ messages or HTTP bodies that could not be decoded (dropped)",
    "malformed_events": "single events rejected inside otherwise good batches",
    "unknown_events": "events with an unknown type tag (skipped)",
    "unknown_fields": "events carrying fields this agent does not know (dropped; the event applies)",
    "gaps": "sequence gaps in the engine's KV event stream",
    "unrecoverable_gaps": "gaps the replay could not fill (worker state reset)",
    "replays": "replay requests sent to the engine",
    "replay_timeouts": "replay requests without a complete answer in time",
    "sequence_resets": "sequence went backwards: engine restarted (worker state reset)",
    "duplicate_batches": "live copies of batches a replay already applied",
    "incomplete_catch_ups": "starts where the engine no longer had its first events",
    "rank_mismatches": "batches or events naming a data-parallel rank other than the socket's or the agent's",
    "reconnects": "KV event connections to the engine's publisher re-established",
    "reconnect_resets": "reconnects to a publisher with another history (engine restarted): worker state reset",
    "window_filtered_events": "TRT-LLM events of a sliding window, not the full-attention one (skipped)",
    "updated_events": "TRT-LLM `updated` events (cache level / priority; ignored)",
    "polls": "POST /kv_cache_events answered (TRT-LLM pull path)",
    "poll_failures": "POST /kv_cache_events that failed (TRT-LLM pull path)",
    "orphan_blocks": "stored blocks whose parent block is unknown (cannot be keyed)",
    "duplicate_stores": "stores of a block already held (no-op)",
    "unknown_removes": "removals of a block not held (no-op)",
    "short_token_ids": "stored blocks with fewer token ids than blocks x block_size",
    "invalid_token_ids": "stored blocks with token ids outside u32",
    "unkeyable_blocks": "held blocks with multimodal or embedded content (no key: a text router cannot match them)",
    "partial_blocks": "held partial blocks, smaller than the block size (no key)",
    "remote_blocks": "blocks of events whose locality is not LOCAL (another instance's; skipped)",
    "unknown_medium_blocks": "blocks on a medium name the agent does not know (indexed as disk)",
    "unnamed_lora_blocks": "blocks of a LoRA adapter the engine names only by int id (never matched)",
    "skipped_group_blocks": "blocks of a KV group other than the main full-attention one",
    "state_resets": "worker state resets (cleared and resynced)",
    "engine_metrics_failures": "failed polls of the engine's /metrics",
    "engine_models_failures": "failed polls of the engine's /v1/models",
    "control_plane_sessions": "control-plane streams registered",
    "control_plane_failures": "control-plane connection attempts or sessions that failed",
    "control_plane_refusals": "control-plane connections refused because another live agent holds the worker id",
    "callback_errors": "internal errors while applying a batch",
    "oversize_frames": "KV-event connections ZMQ closed for a frame over --kv-events-max-frame-bytes (reconnected)",
    "oversize_batches": "KV event batches with more events than --kv-events-max-batch-events (dropped undecoded)",
    "oversize_bodies": "POST /kv_cache_events bodies over --kv-events-max-poll-bytes or the event limit (dropped)",
}


@dataclass
class AgentConfig:
    control_plane: str = "127.0.0.1:50051"
    kv_events: str = "tcp://127.0.0.1:5557"
    engine_url: str = "http://127.0.0.1:8000"
    worker_id: str | None = None  # default: default_worker_id(engine_url); "-dp<rank>" added per DP rank
    model: str | None = None  # default: asked from the engine's GET /v1/models
    block_size: int = 16
    engine: str = "vllm"
    role: str = ""  # "prefill", "decode", or "" for both (kvroute/roles.py)
    kv_events_transport: str | None = None  # None: "http" for trtllm (its pull path), "zmq" otherwise
    replay_endpoint: str | None = None
    kv_events_bind: bool = False
    topic: str = ""
    data_parallel_size: int | None = None  # None: not a data-parallel engine (one worker, no rank)
    data_parallel_rank_start: int = 0  # first global DP rank this agent serves
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None = no status listener; 0 = any free port
    port_file: str = ""  # where the bound metrics port goes (kvroute.process.write_port_file)
    engine_poll_interval_s: float = 0.5
    models_poll_interval_s: float = 5.0
    kv_events_poll_interval_s: float = 0.1  # TRT-LLM pull path
    kv_events_max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # worker_agent/limits.py: why these defaults
    kv_events_max_batch_events: int = DEFAULT_MAX_BATCH_EVENTS
    kv_events_max_poll_bytes: int = DEFAULT_MAX_POLL_BYTES
    replay_timeout_s: float = 1.0
    engine_gone_after_s: float = 30.0  # no answer from GET /v1/models this long: stop advertising the workers
    heartbeat_interval_s: float | None = None  # None: min(1 s, control plane's heartbeat_timeout / 3)
    tls: TlsFiles = field(default_factory=TlsFiles)  # to the control plane: none = plaintext (kvroute/tls.py)
    grpc_max_message_bytes: int = DEFAULT_GRPC_MAX_MESSAGE_BYTES

    @property
    def transport(self) -> str:
        return self.kv_events_transport or ("http" if self.engine == "trtllm" else "zmq")

    @property
    def ranks(self) -> list[int] | None:
        if self.data_parallel_size is None:
            return None
        return list(range(self.data_parallel_rank_start, self.data_parallel_rank_start + self.data_parallel_size))

    def check(self) -> None:
        """Raise ValueError naming what is wrong with this configuration."""
        if self.engine not in SUPPORTED_ENGINES:
            raise ValueError(f"unsupported engine {self.engine!r}: supported engines are {', '.join(SUPPORTED_ENGINES)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.engine_gone_after_s > 0:
            raise ValueError(f"engine_gone_after_s must be positive, got {self.engine_gone_after_s}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown KV event transport {self.transport!r}: choose zmq or http")
        if self.transport == "http" and self.engine != "trtllm":
            raise ValueError(
                f"{self.engine} publishes KV events over ZMQ only; the http transport is TensorRT-LLM's "
                "pull path (POST /kv_cache_events)"
            )
        if self.transport == "http" and (self.replay_endpoint or self.kv_events_bind):
            raise ValueError(
                "TensorRT-LLM's pull path (http) has no replay endpoint and nothing to bind: "
                "drop --replay-endpoint / --kv-events-bind, or use --kv-events-transport zmq"
            )
        if self.data_parallel_size is not None and self.data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be positive, got {self.data_parallel_size}")
        if self.data_parallel_rank_start < 0:
            raise ValueError(f"data_parallel_rank_start must be >= 0, got {self.data_parallel_rank_start}")
        if self.data_parallel_size is None and self.data_parallel_rank_start:
            raise ValueError("data_parallel_rank_start needs data_parallel_size (how many ranks this agent serves)")
        if self.transport == "zmq":
            ranks = self.ranks or [0]
            live = rank_endpoints(self.kv_events, ranks, self.engine)
            if self.replay_endpoint:
                check_no_overlap(live, rank_endpoints(self.replay_endpoint, ranks, self.engine))


def default_worker_id(engine_url: str) -> str:
    """HOST:PORT of the engine URL; a loopback / unspecified host is replaced by this machine's hostname."""
    parts = urllib.parse.urlsplit(engine_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if host in _LOOPBACK_HOSTS or host.startswith("127."):
        host = socket.gethostname()
    return f"{host}:{port}"


class RankWorker:
    """One kvroute worker: the whole engine, or one data-parallel rank of it (resolver + control-plane link)."""

    def __init__(self, config: AgentConfig, identity: WorkerIdentity, load: Callable[[], pb.WorkerLoad]) -> None:
        self.identity = identity
        self.rank = identity.data_parallel_rank
        self.resolver = BlockResolver(identity.model, config.block_size)
        self.link = ControlPlaneLink(
            config.control_plane,
            identity,
            self.resolver.snapshot_events,
            load,
            heartbeat_interval_s=config.heartbeat_interval_s,
            tls=client_tls(config.tls),
            max_message_bytes=config.grpc_max_message_bytes,
        )
        self.source: ZmqEventSource | None = None  # ZMQ transports: this rank's publisher
        self.state_resets = 0
        self.last_batch_at: float | None = None  # monotonic; when the last KV event batch arrived

    def set_model(self, model: str) -> None:
        self.identity.model = model
        self.resolver.model = model

    def on_batch(self, batch: DecodedBatch) -> None:
        self.last_batch_at = time.monotonic()
        with tracer.start_as_current_span("kvroute.agent.apply_batch") as span:
            out = self.resolver.apply(batch.events)
            if out:
                self.link.send(out)
            observed = self.resolver.observed_block_size
            if observed is not None and observed != self.identity.block_size:
                log.warning(
                    "%s: engine KV events carry block_size %d but the agent registered %d: re-registering",
                    self.identity.worker_id,
                    observed,
                    self.identity.block_size,
                )
                self.identity.block_size = observed
                self.link.reregister()
            if span.is_recording():
                span.set_attribute("kvroute.worker", self.identity.worker_id)
                span.set_attribute("kvroute.seq", batch.seq)
                span.set_attribute("kvroute.events", len(batch.events))
                span.set_attribute("kvroute.block_events", len(out))

    def on_reset(self, reason: str) -> None:
        self.state_resets += 1
        log.warning(
            "%s: worker state unknown (%s): clearing %d blocks and resyncing the control plane",
            self.identity.worker_id,
            reason,
            len(self.resolver),
        )
        self.resolver.clear()
        self.link.resync()

    @property
    def last_seq(self) -> int | None:
        return self.source.last_seq if self.source else None


class _AgentCollector:
    def __init__(self, agent: WorkerAgent) -> None:
        self.agent = agent

    def collect(self):
        agent = self.agent
        for name, value in agent.counters.items():
            if name in COUNTER_HELP:
                yield CounterMetricFamily(f"kvroute_agent_{name}", COUNTER_HELP[name], value=value)
        yield GaugeMetricFamily(
            "kvroute_agent_blocks",
            "distinct GPU block keys the agent's workers hold",
            value=sum(len(w.resolver) for w in agent.workers),
        )
        yield GaugeMetricFamily(
            "kvroute_agent_control_plane_connected",
            "1 while every worker's control-plane stream is up",
            value=int(all(w.link.connected for w in agent.workers)),
        )
        yield GaugeMetricFamily(
            "kvroute_agent_engine_answering",
            "1 while the engine answers GET /v1/models (the agent registers its workers only then)",
            value=int(agent.models.answering),
        )
        yield GaugeMetricFamily(
            "kvroute_agent_event_stream_silent",
            "1 while no KV event arrives although the engine's own counters show it stored new blocks",
            value=int(agent.silence.silent),
        )
        tiers = GaugeMetricFamily(
            "kvroute_agent_tier_blocks", "distinct block keys held, per worker and tier", labels=["worker", "medium"]
        )
        last_seq = GaugeMetricFamily(
            "kvroute_agent_last_seq",
            "last engine KV event sequence number (or event_id) applied, per worker (-1: none yet)",
            labels=["worker"],
        )
        for w in agent.workers:
            for medium, count in w.resolver.tier_sizes().items():
                tiers.add_metric([w.identity.worker_id, medium], count)
            seq = agent.last_seq(w)
            last_seq.add_metric([w.identity.worker_id], -1 if seq is None else seq)
        yield tiers
        yield last_seq


class WorkerAgent:
    def __init__(self, config: AgentConfig) -> None:
        config.check()
        self.config = config
        ranks = config.ranks
        base_id = config.worker_id or default_worker_id(config.engine_url)
        endpoint = config.engine_url.rstrip("/")
        self.load = EngineLoadPoller(config.engine_url, engine=config.engine, interval_s=config.engine_poll_interval_s)
        self.models = EngineModelsPoller(
            config.engine_url, config.model, self._set_adapters, interval_s=config.models_poll_interval_s
        )
        self.workers = [
            RankWorker(
                config,
                WorkerIdentity(
                    base_id if rank is None else f"{base_id}-dp{rank}",
                    config.model or "",
                    config.engine,
                    config.block_size,
                    endpoint,
                    data_parallel_rank=rank,
                    role=config.role,
                ),
                lambda: self.load.latest,
            )
            for rank in (ranks or [None])
        ]
        self._by_rank = {w.rank: w for w in self.workers}
        self._zmq: zmq.asyncio.Context | None = None
        self.poller: TrtllmEventPoller | None = None
        if config.transport == "zmq":
            self._zmq = zmq.asyncio.Context()
            decoder = sglang_wire.DECODER if config.engine == "sglang" else vllm_wire.DECODER
            decode = functools.partial(decoder.decode_payload, max_events=config.kv_events_max_batch_events)
            for w in self.workers:
                rank = w.rank or 0
                replay = offset_endpoint(config.replay_endpoint, rank, config.engine) if config.replay_endpoint else None
                w.source = ZmqEventSource(
                    offset_endpoint(config.kv_events, rank, config.engine),
                    w.on_batch,
                    w.on_reset,
                    replay,
                    decode=decode,
                    expected_rank=w.rank,
                    bind=config.kv_events_bind,
                    topic=config.topic,
                    replay_timeout_s=config.replay_timeout_s,
                    max_frame_bytes=config.kv_events_max_frame_bytes,
                    context=self._zmq,
                )
        else:
            self.poller = TrtllmEventPoller(
                config.engine_url,
                TrtllmEventConverter(ranks, max_events=config.kv_events_max_batch_events),
                self._on_rank_batch,
                self._on_rank_reset,
                interval_s=config.kv_events_poll_interval_s,
                max_body_bytes=config.kv_events_max_poll_bytes,
            )
        self.metrics_port: int | None = None  # the bound port once the metrics server runs
        self.metrics_registry = CollectorRegistry()
        register_build_info(self.metrics_registry, "agent")
        self.metrics_registry.register(_AgentCollector(self))
        self._metrics_runner: web.AppRunner | None = None
        self.model_known = bool(config.model)  # False until the engine's GET /v1/models answered
        self.silence = SilenceWatch(SILENCE_WINDOWS_S[config.engine])
        self.advertised = False  # the workers' control-plane links run (the engine answers)
        self._tasks: asyncio.TaskGroup | None = None
        self._links: list[asyncio.Task] = []
        self._events_started = False
        self._registered_once = False
        self._unfollowed_since: dict[str, float] = {}  # worker id -> since when its publisher is not connected
        self._problems = RateLimitedLog(log, period_s=PROBLEM_LOG_PERIOD_S)

    # ------------------------------------------------------------------ engine state

    def _on_rank_batch(self, rank: int | None, batch: DecodedBatch) -> None:
        self._by_rank[rank].on_batch(batch)

    def _on_rank_reset(self, rank: int | None, reason: str) -> None:
        self._by_rank[rank].on_reset(reason)

    def _set_adapters(self, adapters: list[str]) -> None:
        for w in self.workers:  # in place: the links read the identity at every heartbeat
            w.identity.lora_adapters[:] = adapters

    def last_seq(self, worker: RankWorker) -> int | None:
        if self.poller is not None:
            return self.poller.converter.last_event_id(worker.rank)
        return worker.last_seq

    @property
    def counters(self) -> dict[str, int]:
        """Every agent counter by name, summed over the workers (tests and /metrics)."""
        out: dict[str, int] = {}

        def add(values: dict[str, int], prefix: str = "") -> None:
            for k, v in values.items():
                out[prefix + k] = out.get(prefix + k, 0) + v

        for w in self.workers:
            if w.source is not None:
                add(w.source.counters.as_dict())
            add(w.resolver.counters.as_dict())
            add(w.link.counters.as_dict(), "control_plane_")
            add({"control_plane_failures": w.link.counters.connect_failures, "state_resets": w.state_resets})
        if self.poller is not None:
            add(self.poller.counter_values())
        out["engine_metrics_failures"] = self.load.failures
        out["engine_models_failures"] = self.models.failures
        out["blocks"] = sum(len(w.resolver) for w in self.workers)
        out["control_plane_connected"] = int(all(w.link.connected for w in self.workers))
        return out

    # ------------------------------------------------------------------ lifecycle

    # ------------------------------------------------------------------ readiness

    def readiness(self) -> Readiness:
        """Ready: the engine answers GET /v1/models (so its model is known and its workers are
        advertised), and every worker (DP rank) is registered with the control plane over a live stream
        and follows the engine's KV events: its ZMQ SUB has a connection to the publisher (a handshake
        and no disconnect since), or, on TRT-LLM's pull path, a poll was answered within two poll
        timeouts; and the event stream is not silent while the engine works."""
        problems: list[str] = []
        engine = self._engine_problem()
        if engine is not None:
            problems.append(engine)
        workers = []
        for w in self.workers:
            wid = w.identity.worker_id
            if self.advertised and not w.link.connected:
                problems.append(f"{wid}: not connected to the control plane: {w.link.not_connected_reason}")
            following = self._following(w)
            if not following and w.source is not None:
                problems.append(f"{wid}: not receiving KV events ({self._publisher_problem(w.source)})")
            workers.append(
                {
                    "worker_id": wid,
                    "registered": self.advertised,
                    "control_plane_connected": w.link.connected,
                    "control_plane": w.link.not_connected_reason or "connected",
                    "following_events": following,
                }
            )
        poller = self.poller
        if poller is not None and self._events_started and not self._poller_fresh():
            fresh = 2 * poller.timeout_s
            problems.append(
                f"not receiving KV events: no POST {poller.url} answered in the last {fresh:g}s"
                + (f" ({poller.last_error})" if poller.last_error else "")
            )
        if self.silence.silent:
            problems.append(f"KV event stream silent: {self.silence.reason}")
        return Readiness(
            fatal=problems,
            details={"engine_answering": self.models.answering, "event_stream_silent": self.silence.silent, "workers": workers},
        )

    def _engine_problem(self) -> str | None:
        """Why the workers are not (or soon no longer) registered: the engine does not answer."""
        models = self.models
        if models.answering and self.advertised:
            return None
        url = f"{self.config.engine_url.rstrip('/')}/v1/models"
        why = f" ({models.last_error})" if models.last_error else ""
        ids = ", ".join(w.identity.worker_id for w in self.workers)
        if models.answering:
            return f"engine {url} answers: registering {ids}"
        if not self._registered_once:
            state = "does not answer" if models.failures else "not asked yet"
            return f"engine {url} {state}{why}: {ids} not registered until it answers"
        down = time.monotonic() - (models.failing_since or time.monotonic())
        if self.advertised:
            return (
                f"engine {url} has not answered for {down:.0f}s{why}: {ids} withdrawn from the control plane after "
                f"{self.config.engine_gone_after_s:g}s"
            )
        return f"engine {url} has not answered for {down:.0f}s{why}: {ids} withdrawn from the control plane until it answers"

    def _publisher_problem(self, source: ZmqEventSource) -> str:
        if source.bind:
            return f"bound to {source.bound_endpoint or source.endpoint}, no engine connected"
        return f"no connection to the engine's publisher at {source.endpoint}"

    def _poller_fresh(self) -> bool:
        poller = self.poller
        return (
            poller is not None
            and poller.last_success is not None
            and time.monotonic() - poller.last_success <= 2 * poller.timeout_s
        )

    def _following(self, w: RankWorker) -> bool:
        return w.source.publisher_connected if w.source is not None else self._poller_fresh()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Raises ListenError (one line naming the flag) when a --kv-events-bind endpoint or the
        metrics port cannot be had; otherwise runs until cancelled."""
        try:
            for w in self.workers:  # sockets first: a bind that fails must fail before anything waits
                if w.source is not None:
                    w.source.open()
            if self.config.metrics_port is not None:
                write_port_file(self.config.port_file, {"metrics": await self.start_metrics_server()})
            c = self.config
            log.info(
                "agent for %s engine %s: workers %s, model %s, KV events %s (%s), control plane %s; the workers "
                "register once the engine answers GET /v1/models",
                c.engine,
                c.engine_url,
                ", ".join(w.identity.worker_id for w in self.workers),
                c.model or "asked from the engine",
                c.engine_url + "/kv_cache_events" if self.poller else c.kv_events,
                c.transport if self.poller else ("bind" if c.kv_events_bind else "connect"),
                c.control_plane,
            )
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                tasks.create_task(self.load.run())
                tasks.create_task(self._follow_engine())
                tasks.create_task(self._watch())
                if self.model_known:
                    self._start_events()
        finally:
            self._tasks, self._links, self.advertised = None, [], False
            if self._zmq is not None:
                self._zmq.destroy(linger=0)
            await self.stop_metrics_server()

    def _start_events(self) -> None:
        """Read the engine's KV events (once the model, which namespaces every key, is known)."""
        if self._events_started or self._tasks is None:
            return
        self._events_started = True
        for w in self.workers:
            if w.source is not None:
                self._tasks.create_task(w.source.run())
        if self.poller is not None:
            self._tasks.create_task(self.poller.run())

    async def _follow_engine(self) -> None:
        """Advertise the workers (run their control-plane links) only while the engine answers."""
        models, ids = self.models, ", ".join(w.identity.worker_id for w in self.workers)
        async with models.session() as http:
            while True:
                model = await models.until_answering(http)
                if not self.model_known:
                    for w in self.workers:
                        w.set_model(model)
                    self.model_known = True
                for w in self.workers:
                    w.identity.engine_version = models.engine_version
                self._start_events()
                log.info(
                    "engine %s answers (model %s): registering %s with the control plane",
                    self.config.engine_url,
                    self.workers[0].identity.model,
                    ids,
                )
                self._advertise()
                await models.until_gone(http, self.config.engine_gone_after_s)
                log.warning(
                    "engine %s has not answered GET /v1/models for %gs (%s): withdrawing %s from the control "
                    "plane (it drops them after its heartbeat timeout) until the engine answers again",
                    self.config.engine_url,
                    self.config.engine_gone_after_s,
                    models.last_error,
                    ids,
                )
                await self._withdraw()

    def _advertise(self) -> None:
        assert self._tasks is not None
        self._links = [self._tasks.create_task(w.link.run()) for w in self.workers]
        self.advertised = self._registered_once = True

    async def _withdraw(self) -> None:
        links, self._links, self.advertised = self._links, [], False
        await cancel_and_wait(*links)

    async def _watch(self) -> None:
        """Once a second: log a publisher that stays unconnected, and judge whether the event stream is
        silent while the engine works (on each new sample of the engine's counters)."""
        sampled_at: float | None = None
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self._events_started:
                continue
            self._check_publishers(time.monotonic())
            last_event = max((w.last_batch_at for w in self.workers if w.last_batch_at is not None), default=None)
            was_silent = self.silence.silent
            load = self.load
            if load.work is not None and load.work_at is not None and load.work_at != sampled_at:
                sampled_at = load.work_at
                self.silence.observe(load.work_at, load.work, last_event, self.workers[0].identity.block_size)
            else:
                self.silence.events_seen(last_event)
            if self.silence.silent:
                self._problems.warning(
                    "silent",
                    "KV event stream silent: %s. The control plane learns none of this engine's blocks: check %s",
                    self.silence.reason,
                    self._stream_hint(),
                )
            elif was_silent:
                self._problems.recovered("silent", "KV events arrive again")

    def _stream_hint(self) -> str:
        c = self.config
        if self.poller is not None:
            return (
                "that the engine's kv_cache_config has event_buffer_max_size > 0 and block reuse on "
                f"(POST {self.poller.url} answers without events)"
            )
        where = "--kv-events-bind" if c.kv_events_bind else "--kv-events"
        return (
            f"that {where} {c.kv_events} and --topic {c.topic!r} are the engine's kv-events-config endpoint and "
            "topic, and that its prefix caching and KV events are on"
        )

    def _check_publishers(self, now: float) -> None:
        for w in self.workers:
            source, wid = w.source, w.identity.worker_id
            if source is None:
                continue
            kind = f"publisher {wid}"
            if source.publisher_connected:
                self._unfollowed_since.pop(wid, None)
                self._problems.recovered(
                    kind, "%s: connected to the engine's KV event publisher at %s", wid, source.bound_endpoint or source.endpoint
                )
                continue
            since = self._unfollowed_since.setdefault(wid, now)
            if now - since >= PUBLISHER_GRACE_S:
                self._problems.warning(
                    kind,
                    "%s: %s for %.0fs: the control plane learns none of its blocks (check "
                    "%s against the engine's kv-events-config endpoint)",
                    wid,
                    self._publisher_problem(source),
                    now - since,
                    "--kv-events-bind" if source.bind else "--kv-events",
                )

    async def start_metrics_server(self) -> int:
        self._metrics_runner, self.metrics_port = await start_status_site(
            "--metrics-port",
            self.config.metrics_host,
            self.config.metrics_port,
            status_routes(self.metrics_registry, health=self.health, readiness=self.readiness),
        )
        log.info("agent metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port)
        return self.metrics_port

    async def stop_metrics_server(self) -> None:
        if self._metrics_runner:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    def health(self) -> dict:
        first = self.workers[0]
        return {
            "status": "ok",
            "engine": self.config.engine,
            "model": first.identity.model,
            "worker_id": first.identity.worker_id if len(self.workers) == 1 else None,
            "block_size": first.identity.block_size,
            "blocks": sum(len(w.resolver) for w in self.workers),
            "control_plane_connected": all(w.link.connected for w in self.workers),
            "last_seq": self.last_seq(first),
            "engine_answering": self.models.answering,
            "registered": self.advertised,
            "event_stream_silent": self.silence.silent,
            "lora_adapters": first.identity.lora_adapters,
            "workers": [
                {
                    "worker_id": w.identity.worker_id,
                    "data_parallel_rank": w.rank,
                    "blocks": w.resolver.tier_sizes(),
                    "control_plane_connected": w.link.connected,
                    "last_seq": self.last_seq(w),
                }
                for w in self.workers
            ],
        }
