"""gRPC ControlPlane service (grpc.aio): agent streams in, router queries out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from control_plane.registry import WorkerRecord, WorkerRegistry
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

log = logging.getLogger("kvroute.control_plane")
tracer = trace.get_tracer("kvroute.control_plane")

# Snapshots of large caches exceed gRPC's 4 MB default (a million keys is ~9 MB).
GRPC_MESSAGE_LIMIT = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
]


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.workers = Gauge("kvroute_cp_workers", "Registered live workers", registry=registry)
        self.index_entries = Gauge("kvroute_cp_index_entries", "(block key, worker) pairs in the index",
                                   registry=registry)
        self.batches = Counter("kvroute_cp_event_batches_total", "Event batches applied", ["kind"],
                               registry=registry)
        self.block_events = Counter("kvroute_cp_block_events_total", "Block keys applied", ["op"],
                                    registry=registry)
        self.stream_errors = Counter("kvroute_cp_stream_errors_total", "Agent streams rejected", ["reason"],
                                     registry=registry)
        self.expired = Counter("kvroute_cp_workers_expired_total", "Workers dropped for missing heartbeats",
                               registry=registry)
        self.query_seconds = Histogram("kvroute_cp_query_seconds", "Query handling time", registry=registry,
                                       buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2))


def load_to_pb(record: WorkerRecord) -> pb.WorkerLoad:
    load = record.load
    return pb.WorkerLoad(running_requests=load.running_requests, waiting_requests=load.waiting_requests,
                         kv_usage=load.kv_usage, observed_unix_ms=load.observed_unix_ms)


class ControlPlaneService(pb_grpc.ControlPlaneServicer):
    def __init__(self, registry: WorkerRegistry, metrics: ControlPlaneMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    # ------------------------------------------------------------ agent stream

    async def Connect(self, request_iterator: AsyncIterator[pb.AgentMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ControlMessage]:
        record: WorkerRecord | None = None
        generation = 0
        async for message in request_iterator:
            body = message.WhichOneof("body")
            if record is None:
                if body != "register":
                    await self._reject(context, "not_registered", grpc.StatusCode.FAILED_PRECONDITION,
                                       "first message on a Connect stream must be `register`")
                record, generation = await self._register(message.register, context)
                yield pb.ControlMessage(registered=pb.Registered(
                    worker_id=record.worker_id,
                    heartbeat_timeout_ms=int(self.registry.heartbeat_timeout_s * 1000)))
                continue
            if record.generation != generation or self.registry.get(record.worker_id) is not record:
                await self._reject(context, "superseded", grpc.StatusCode.ABORTED,
                                   f"worker {record.worker_id!r} was re-registered or expired; reconnect")
            self.registry.touch(record)
            if body == "batch":
                applied = await self._apply_batch(record, message.batch, context)
                yield pb.ControlMessage(ack=pb.Ack(seq=message.batch.seq, applied_events=applied))
            elif body == "heartbeat":
                load = message.heartbeat.load
                state = record.load
                state.running_requests = load.running_requests
                state.waiting_requests = load.waiting_requests
                state.kv_usage = load.kv_usage
                state.observed_unix_ms = load.observed_unix_ms or int(time.time() * 1000)
            elif body == "register":
                await self._reject(context, "double_register", grpc.StatusCode.FAILED_PRECONDITION,
                                   "register may only be sent once per stream")

    async def _register(self, req: pb.RegisterWorker,
                        context: grpc.aio.ServicerContext) -> tuple[WorkerRecord, int]:
        try:
            record = self.registry.register(req.worker_id, req.model, req.engine, req.block_size,
                                            req.endpoint, req.engine_version)
        except ValueError as exc:
            await self._reject(context, "bad_register", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("worker registered: %s model=%s engine=%s block_size=%d endpoint=%s", record.worker_id,
                 record.model, record.engine, record.block_size, record.endpoint)
        self.metrics.workers.set(len(self.registry))
        return record, record.generation

    async def _apply_batch(self, record: WorkerRecord, batch: pb.EventBatch,
                           context: grpc.aio.ServicerContext) -> int:
        if batch.seq != record.last_seq + 1:
            await self._reject(context, "sequence", grpc.StatusCode.FAILED_PRECONDITION,
                               f"worker {record.worker_id!r}: expected batch seq {record.last_seq + 1}, "
                               f"got {batch.seq}; reconnect and send a snapshot")
        record.last_seq = batch.seq
        index, slot = self.registry.index, record.slot
        with tracer.start_as_current_span("kvroute.cp.apply_batch") as span:
            if batch.snapshot:
                keys: list[int] = []
                for event in batch.events:
                    if event.WhichOneof("kind") == "stored":
                        keys.extend(event.stored.block_keys)
                index.replace(slot, keys)
                self.metrics.batches.labels("snapshot").inc()
                self.metrics.block_events.labels("snapshot").inc(len(keys))
            else:
                for event in batch.events:
                    kind = event.WhichOneof("kind")
                    if kind == "stored":
                        index.store(slot, event.stored.block_keys)
                        self.metrics.block_events.labels("stored").inc(len(event.stored.block_keys))
                    elif kind == "removed":
                        index.remove(slot, event.removed.block_keys)
                        self.metrics.block_events.labels("removed").inc(len(event.removed.block_keys))
                    elif kind == "cleared":
                        index.clear(slot)
                        self.metrics.block_events.labels("cleared").inc()
                self.metrics.batches.labels("delta").inc()
            if span.is_recording():
                span.set_attribute("kvroute.worker_id", record.worker_id)
                span.set_attribute("kvroute.events", len(batch.events))
        self.metrics.index_entries.set(index.entry_count())
        return len(batch.events)

    async def _reject(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode,
                      detail: str) -> None:
        self.metrics.stream_errors.labels(reason).inc()
        log.warning("rejecting agent stream: %s", detail)
        await context.abort(code, detail)

    # ------------------------------------------------------------ router side

    async def Query(self, request: pb.QueryRequest, context: grpc.aio.ServicerContext) -> pb.QueryResponse:
        started = time.perf_counter()
        index = self.registry.index
        matches_by_block_size = {chain.block_size: index.match(list(chain.block_keys)) for chain in request.chains}
        workers = []
        for record in self.registry.workers(request.model):
            matched = matches_by_block_size.get(record.block_size, {}).get(record.slot, 0)
            workers.append(pb.WorkerMatch(worker_id=record.worker_id, endpoint=record.endpoint,
                                          block_size=record.block_size, matched_blocks=matched,
                                          load=load_to_pb(record)))
        self.metrics.query_seconds.observe(time.perf_counter() - started)
        return pb.QueryResponse(workers=workers)

    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        index = self.registry.index
        return pb.ListWorkersResponse(workers=[
            pb.WorkerInfo(worker_id=r.worker_id, model=r.model, engine=r.engine, block_size=r.block_size,
                          endpoint=r.endpoint, load=load_to_pb(r), cached_blocks=index.worker_block_count(r.slot),
                          last_seq=r.last_seq)
            for r in self.registry.workers(request.model)
        ])

    # ------------------------------------------------------------ liveness

    async def expire_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            for worker_id in self.registry.expire():
                log.warning("worker %s missed heartbeats for %.1fs: dropped with its blocks", worker_id,
                            self.registry.heartbeat_timeout_s)
                self.metrics.expired.inc()
            self.metrics.workers.set(len(self.registry))
            self.metrics.index_entries.set(self.registry.index.entry_count())
