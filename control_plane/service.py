"""gRPC ControlPlane service (grpc.aio): agent streams in, router queries out, audit reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from opentelemetry import propagate, trace

from kvroute.bad_request import BadRequest
from kvroute.control_plane.audit import eviction_metadata
from kvroute.control_plane.authority import Authority, Refused
from kvroute.control_plane.metrics import ControlPlaneMetrics
from kvroute.control_plane.replication.event_log import AgentSession, EventLog, LocalEventLog, LogRefusal
from kvroute.fleet.answer import answer_columns
from kvroute.fleet.entries import BlockOp, HeartbeatBody, ops_from_events
from kvroute.fleet.inflight import DuplicateReservation, RouterSessionState, RouterTally
from kvroute.fleet.registry import WorkerRecord
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import TIERS, Tier, is_bounded, tier_of_wire

if TYPE_CHECKING:
    from kvroute.control_plane.follow import FollowFeed
    from kvroute.control_plane.replication.inflight_sync import InflightSync
from kvroute.roles import parse_role
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


def load_to_pb(record: WorkerRecord) -> pb.WorkerLoad:
    load = record.load
    return pb.WorkerLoad(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_usage=load.kv_usage,
        observed_unix_ms=load.observed_unix_ms,
        kv_capacity_tokens=load.kv_capacity_tokens,
    )


def match_template(record: WorkerRecord) -> pb.WorkerMatch:
    """The per-worker part of every answer, built once per change of the record."""
    template = record.match_template
    if template is None:
        template = pb.WorkerMatch(
            worker_id=record.worker_id,
            endpoint=record.endpoint,
            block_size=record.block_size,
            load=load_to_pb(record),
            data_parallel_rank=record.data_parallel_rank,
        )
        record.match_template = template
    return template  # type: ignore[return-value]


def check_query(request: pb.QueryRequest) -> None:
    block_sizes = [chain.block_size for chain in request.chains]
    if 0 in block_sizes:
        raise BadRequest("every KeyChain needs a block_size (got 0)")
    if len(set(block_sizes)) != len(block_sizes):
        raise BadRequest(f"one KeyChain per block size, got block sizes {block_sizes}")


class ControlPlaneService(pb_grpc.ControlPlaneServicer):
    def __init__(self, state: FleetState, metrics: ControlPlaneMetrics, event_log: EventLog | None = None) -> None:
        self.state = state
        self.registry = state.registry
        self.inflight = state.inflight
        self.metrics = metrics
        self.applier = state.applier
        self._unknown_media_seen: set[int] = set()
        # Where agents' messages go: applied at once (embedded), or through Redis (replicas).
        self.log: EventLog = event_log or LocalEventLog(self.applier)
        # Why routers must ask another replica now (a replica still catching up), or None.
        self.refuse_routers: Callable[[], str | None] = lambda: None
        # Replicas: tells the other replicas what this one's router sessions do (None: embedded).
        self.router_events: InflightSync | None = None
        self.router_sessions = 0  # RouterSession streams past their hello, open now
        self._bound_reached = False  # logged once
        # With mTLS (--tls-ca): what each peer's certificate allows; None = every peer may do everything.
        self.authority: Authority | None = None
        # Every applied change, numbered, for routers that follow the fleet (set by the server).
        self.feed: FollowFeed | None = None

    async def _authorize(self, context: grpc.aio.ServicerContext, check: Callable[..., None], *args: str) -> None:
        """`check(context, *args)` of the authority (when there is one); PERMISSION_DENIED when it refuses."""
        if self.authority is not None:
            try:
                check(context, *args)
            except Refused as refused:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(refused))

    def count_unparseable(self, rpc: str) -> None:
        """A request whose bytes are not the method's message (answered INVALID_ARGUMENT by grpc_requests)."""
        if rpc == "Connect":
            self.metrics.stream_errors.labels("unparseable").inc()
        else:
            self.metrics.bad_requests.labels(rpc, "unparseable").inc()

    async def _check_serving(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        why = self.refuse_routers()
        if why is not None:
            self.metrics.bad_requests.labels(rpc, "not_ready").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    # ------------------------------------------------------------ agent stream

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ControlMessage]:
        session: AgentSession | None = None
        try:
            async for message in request_iterator:
                body = message.WhichOneof("body")
                try:
                    if session is None:
                        if body != "register":
                            raise LogRefusal(
                                grpc.StatusCode.FAILED_PRECONDITION,
                                "not_registered",
                                "first message on a Connect stream must be `register`",
                            )
                        session = await self._register(message.register, context)
                        yield pb.ControlMessage(
                            registered=pb.Registered(
                                worker_id=session.worker_id,
                                heartbeat_timeout_ms=int(self.log.heartbeat_timeout_s * 1000),
                                epoch=session.epoch,
                                resume=session.resume,
                                last_seq=session.last_seq,
                            )
                        )
                    elif body == "batch":
                        batch = message.batch
                        ops = self._ops(batch)
                        parent = propagate.extract({"traceparent": batch.traceparent}) if batch.traceparent else None
                        with tracer.start_as_current_span(
                            "kvroute.cp.apply_batch", context=parent, kind=trace.SpanKind.CONSUMER
                        ) as span:
                            await self.log.append_batch(session, batch.seq, batch.snapshot, ops, source=batch)
                            if span.is_recording():
                                span.set_attribute("kvroute.worker_id", session.worker_id)
                                span.set_attribute("kvroute.events", len(ops))
                        yield pb.ControlMessage(ack=pb.Ack(seq=batch.seq, applied_events=len(ops)))
                    elif body == "heartbeat":
                        heartbeat = message.heartbeat
                        load = heartbeat.load
                        if not 0.0 <= load.kv_usage <= 1.0:  # NaN too: policies compare and add it
                            raise LogRefusal(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                "bad_heartbeat",
                                f"kv_usage must be a fraction in 0..1, got {load.kv_usage}",
                            )
                        await self.log.heartbeat(
                            session,
                            HeartbeatBody(
                                load.running_requests,
                                load.waiting_requests,
                                load.kv_usage,
                                load.observed_unix_ms or int(time.time() * 1000),
                                list(heartbeat.lora_adapters),
                                load.kv_capacity_tokens,
                            ),
                        )
                    elif body == "register":
                        raise LogRefusal(
                            grpc.StatusCode.FAILED_PRECONDITION, "double_register", "register may only be sent once per stream"
                        )
                except LogRefusal as refusal:
                    await self._reject(context, refusal.reason, refusal.code, refusal.detail)
        finally:  # ended, failed or cancelled: the worker id is free for the next stream
            if session is not None:
                await self.log.release(session)

    async def _register(self, req: pb.RegisterWorker, context: grpc.aio.ServicerContext) -> AgentSession:
        if self.authority is not None:  # before the log sees anything: a refused stream writes nothing
            await self._authorize(context, self.authority.check_writer, req.worker_id)
        session = await self.log.register(req, context.peer() or "unknown peer")
        log.info(
            "worker registered: %s model=%s engine=%s %s block_size=%d endpoint=%s dp_rank=%s role=%s adapters=%s epoch=%d%s",
            req.worker_id,
            req.model,
            req.engine,
            req.engine_version or "-",
            req.block_size,
            req.endpoint,
            req.data_parallel_rank if req.HasField("data_parallel_rank") else "-",
            parse_role(req.role) or "both",
            ",".join(req.lora_adapters) or "-",
            session.epoch,
            f" resuming after seq {session.last_seq}" if session.resume else "",
        )
        return session

    def _ops(self, batch: pb.EventBatch) -> list[BlockOp]:
        """The batch as the log's block ops (keys stay the message's own containers)."""
        return ops_from_events(batch.events, self._tier)

    def _tier(self, value: int) -> Tier:
        tier = tier_of_wire(value)
        if tier is not None:
            return tier
        # The agent maps engine media to gpu/cpu/disk; a tier value newer than this control plane is some slower store.
        self.metrics.unknown_media.inc()
        if value not in self._unknown_media_seen:
            self._unknown_media_seen.add(value)
            log.warning("unknown block tier %d: indexed as disk", value)
        return Tier.DISK

    async def _reject(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode, detail: str) -> None:
        self.metrics.stream_errors.labels(reason).inc()
        log.warning("rejecting agent stream: %s", detail)
        await context.abort(code, detail)

    # ------------------------------------------------------------ router side

    async def Query(self, request: pb.QueryRequest, context: grpc.aio.ServicerContext) -> pb.QueryResponse:
        if self.authority is not None:
            await self._authorize(context, self.authority.check_reader)
        await self._check_serving(context, "Query")
        response = pb.QueryResponse()
        try:
            self.answer(request, response, asking=None)
        except BadRequest as exc:
            self.metrics.bad_requests.labels("Query", "bad_query").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return response

    def answer(self, request: pb.QueryRequest, response: pb.QueryResponse, asking: RouterTally | None) -> None:
        """Fill `response` for `request`: every live worker of the model (and adapter) with its match
        (index on any tier, or speculative) and the in-flight work every router but `asking` reserved
        (`kvroute.fleet.answer`, the builder routers' own views use too)."""
        started = time.perf_counter()
        check_query(request)
        chains = {chain.block_size: chain.block_keys for chain in request.chains}
        answer = answer_columns(self.state, request.model, chains, request.lora_name, asking)
        response.query_id = request.query_id
        if request.columnar:
            columns = response.columns
            columns.worker_id.extend(answer.worker_id)
            columns.matched_blocks.extend(answer.matched_blocks)
            columns.cpu_blocks.extend(answer.cpu_blocks)
            columns.disk_blocks.extend(answer.disk_blocks)
            columns.speculative_blocks.extend(answer.speculative_blocks)
            columns.reserved_requests.extend(answer.reserved_requests)
            columns.reserved_prefill_tokens.extend(answer.reserved_prefill_tokens)
            columns.running_requests.extend(answer.running_requests)
            columns.waiting_requests.extend(answer.waiting_requests)
            columns.kv_usage.extend(answer.kv_usage)
            columns.cached_blocks.extend(answer.cached_blocks)
            columns.kv_capacity_tokens.extend(answer.kv_capacity_tokens)
            columns.other_routers = answer.other_routers
        else:
            add, get = response.workers.add, self.registry.get
            for i, worker_id in enumerate(answer.worker_id):
                worker = add()
                worker.CopyFrom(match_template(get(worker_id)))
                worker.matched_blocks, worker.cpu_blocks = answer.matched_blocks[i], answer.cpu_blocks[i]
                worker.disk_blocks, worker.speculative_blocks = answer.disk_blocks[i], answer.speculative_blocks[i]
                worker.reserved_requests = answer.reserved_requests[i]
                worker.reserved_prefill_tokens = answer.reserved_prefill_tokens[i]
        self.metrics.query_seconds.observe(time.perf_counter() - started)

    async def RouterSession(
        self, request_iterator: AsyncIterator[pb.RouterMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterReply]:
        session: RouterSessionState | None = None
        try:
            async for message in request_iterator:
                body = message.WhichOneof("body")
                if session is None:
                    if self.authority is not None:
                        await self._authorize(context, self.authority.check_router)
                    await self._check_serving(context, "RouterSession")
                    if body != "hello":
                        await self._reject_router(
                            context,
                            "not_hello",
                            grpc.StatusCode.FAILED_PRECONDITION,
                            "first message on a RouterSession stream must be `hello`",
                        )
                    if not message.hello.router_id:
                        await self._reject_router(
                            context,
                            "bad_hello",
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "hello needs a router_id (unique per router process)",
                        )
                    session = self.inflight.open_session(message.hello.router_id)
                    self.router_sessions += 1
                    if self.router_events is not None:
                        self.router_events.opened(session)
                    yield pb.RouterReply(
                        welcome=pb.RouterWelcome(
                            router_id=message.hello.router_id, reservation_max_age_ms=int(self.inflight.max_age_s * 1000)
                        )
                    )
                elif body == "query":
                    reply = pb.RouterReply()
                    reply.result.SetInParent()
                    try:
                        self.answer(message.query, reply.result, asking=session.router)
                    except BadRequest as exc:
                        await self._reject_router(
                            context, "bad_query", grpc.StatusCode.INVALID_ARGUMENT, f"query {message.query.query_id}: {exc}"
                        )
                    yield reply
                elif body == "ops":
                    ops = message.ops
                    trimmed = [await self._reserve(session, reservation, context) for reservation in ops.reserve]
                    for reservation_id in ops.prefill_done:
                        self._prefill_done(session, reservation_id)
                    for reservation_id in ops.release:
                        self._release(session, reservation_id)
                    for reply in trimmed:
                        if reply is not None:
                            yield reply
                elif body == "reserve":
                    reply = await self._reserve(session, message.reserve, context)
                    if reply is not None:
                        yield reply
                elif body == "prefill_done":
                    self._prefill_done(session, message.prefill_done.reservation_id)
                elif body == "release":
                    self._release(session, message.release.reservation_id)
                elif body == "hello":
                    await self._reject_router(
                        context, "double_hello", grpc.StatusCode.FAILED_PRECONDITION, "hello may only be sent once per stream"
                    )
                else:
                    await self._reject_router(
                        context,
                        "empty_message",
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "RouterMessage with no body (hello, query, reserve, prefill_done, release or ops)",
                    )
        finally:
            if session is not None:
                self.inflight.close_session(session)
                self.router_sessions -= 1
                if self.router_events is not None:
                    self.router_events.closed(session)

    def _prefill_done(self, session: RouterSessionState, reservation_id: int) -> None:
        self.inflight.prefill_done(session, reservation_id)
        if self.router_events is not None:
            self.router_events.prefill_done(session, reservation_id)

    def _release(self, session: RouterSessionState, reservation_id: int) -> None:
        self.inflight.release(session, reservation_id)
        if self.router_events is not None:
            self.router_events.released(session, reservation_id)

    async def _reserve(
        self, session: RouterSessionState, reservation: pb.Reservation, context: grpc.aio.ServicerContext
    ) -> pb.RouterReply | None:
        """Apply it; the reply telling the router when its prefill was charged less than it said."""
        if not reservation.worker_id:
            await self._reject_router(
                context,
                "bad_reservation",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reservation {reservation.reservation_id} needs a worker_id",
            )
        record = self.registry.get(reservation.worker_id)
        if record is None:
            self.inflight.counters.unknown_worker += 1  # dropped meanwhile, or not yet registered
            return None
        keys = reservation.block_keys
        if keys and reservation.block_size != record.block_size:
            self.inflight.counters.block_size_mismatch += 1  # the load still counts, the keys cannot
            keys = ()
        try:
            held = self.inflight.reserve(
                session,
                reservation.reservation_id,
                record.slot,
                keys,
                reservation.prefill_tokens,
                reservation.ttl_ms,
                reservation.prompt_tokens,
                record.block_size,
            )
        except DuplicateReservation as exc:
            await self._reject_router(context, "duplicate_reservation", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.router_events is not None:
            self.router_events.reserved(
                session,
                reservation.reservation_id,
                record.worker_id,
                record.block_size,
                keys,
                reservation.prefill_tokens,
                reservation.ttl_ms,
                reservation.prompt_tokens,
            )
        if held.prefill_tokens < reservation.prefill_tokens:
            return pb.RouterReply(
                trimmed=pb.ReservationTrimmed(reservation_id=reservation.reservation_id, prefill_tokens=held.prefill_tokens)
            )
        return None

    async def _reject_router(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode, detail: str) -> None:
        self.metrics.bad_requests.labels("RouterSession", reason).inc()
        log.warning("rejecting router stream: %s", detail)
        await context.abort(code, detail)

    async def Follow(self, request: pb.FollowRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if self.authority is not None:
            await self._authorize(context, self.authority.check_router)
        await self._check_serving(context, "Follow")
        if self.feed is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this control plane keeps no follow feed")
        async for message in self.feed.follow(request):
            yield message

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        if self.authority is not None:
            await self._authorize(context, self.authority.check_reader)
        await self._check_serving(context, "ListWorkers")
        index = self.registry.index
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerInfo(
                    worker_id=r.worker_id,
                    model=r.model,
                    engine=r.engine,
                    block_size=r.block_size,
                    endpoint=r.endpoint,
                    load=load_to_pb(r),
                    last_seq=r.last_seq,
                    cached_blocks=index.worker_block_count(r.slot, Tier.GPU),
                    lora_adapters=r.lora_adapters,
                    engine_version=r.engine_version,
                    data_parallel_rank=r.data_parallel_rank,
                    role=r.role,
                )
                for r in self.registry.workers(request.model)
            ]
        )

    # ------------------------------------------------------------ audit

    async def GetWorkerKeys(
        self, request: pb.GetWorkerKeysRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetWorkerKeysResponse:
        if self.authority is not None:
            await self._authorize(context, self.authority.check_reader)
        await self._check_serving(context, "GetWorkerKeys")
        record = self.registry.get(request.worker_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live worker {request.worker_id!r}")
        index = self.registry.index
        evicted = index.evicted_entries(record.slot)  # keys it may hold that a bounded index forgot: the audit's due
        response = pb.GetWorkerKeysResponse(
            worker_id=record.worker_id,
            block_size=record.block_size,
            tiers=[pb.TierKeys(tier=tier, block_keys=sorted(index.worker_keys(record.slot, tier))) for tier in TIERS],
        )
        if evicted:
            await context.send_initial_metadata(eviction_metadata({tier.label: n for tier, n in evicted.items()}))
        return response

    # ------------------------------------------------------------ liveness

    async def expire_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            for worker_id in await self.log.expire_silent():
                log.warning(
                    "worker %s missed heartbeats for %.1fs: dropped with its blocks", worker_id, self.registry.heartbeat_timeout_s
                )
            self.inflight.expire()  # claims and reservations time out even when no router asks
            self._note_bound_reached()

    def _note_bound_reached(self) -> None:
        index = self.registry.index
        if is_bounded(index) and index.counters.entries and not self._bound_reached:
            self._bound_reached = True
            log.warning(
                "the index reached --max-index-entries %d: dropping keys not matched recently (routers "
                "under-estimate those caches; kvroute_cp_index_evicted_entries_total)",
                index.max_entries,
            )
