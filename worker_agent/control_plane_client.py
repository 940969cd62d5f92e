"""The agent's side of `ControlPlane.Connect`: register, snapshot or resume, deltas, heartbeats, failover.

One session = one gRPC stream to one control-plane replica:
  register (with this agent's random `agent_instance` and the last seq it saw acked) -> wait
  `Registered` -> either a snapshot (EventBatch(seq = last_seq + 1, snapshot=True), one BlocksStored
  per tier) or, when the control plane answers `resume` with the log's `last_seq` for this agent,
  the batches after `last_seq` that the agent still holds -> incremental EventBatches (whatever
  accumulated since the last send) and heartbeats carrying WorkerLoad and the engine's LoRA
  adapters every min(1 s, heartbeat_timeout_ms / 3).
The sequence runs on across sessions. Every batch is held until acked, and deltas produced while
disconnected are held too, up to `max_pending_events` events in all; past that they are dropped
(`overflow_resyncs`) and the next batch is a snapshot. A registration without `resume` (a control
plane that restarted, a worker that expired) gets a snapshot taken from the resolver, which kept
applying engine events, so it supersedes whatever was held (`dropped_while_disconnected`).

Acks are read concurrently. A batch not acked within `ack_timeout_s`, a missing `Registered`, or any
stream error ends the session. `address` may name several replicas (comma-separated, or a name that
resolves to several, `kvroute.addresses`): after a failure the link tries the next one at once, and
backs off (0.1 s doubling to 5 s, with jitter) only once every address failed in a row. While they
are unreachable (UNAVAILABLE) the wait also ends as soon as a probe channel connects to one of them
(`probe_interval_s`, gRPC's own reconnect attempts), so a restarted control plane gets the agent
within about that interval instead of after a backoff grown during the outage.

A control plane that refuses the worker id because another agent's stream for it is live
(ALREADY_EXISTS: two agents started with one --worker-id) is logged once per episode, as an error
naming the other agent's address, and retried with a backoff starting at `refused_backoff_s`; the
link's `not_connected_reason` (the agent's /ready) says so meanwhile. A re-registration (the
engine's block size changed) half-closes the stream and waits for the control plane to end it, so
the id is free again before the new `register` arrives; its next batch is a snapshot.

`send()` never blocks (the ZMQ reader calls it); the gRPC writes happen in the link's own task.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import grpc
from opentelemetry import propagate, trace

from kvroute.addresses import AddressRotation
from kvroute.backoff import Backoff
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.telemetry import tracing_active
from kvroute.tls import ClientTls, describe_rpc_error, grpc_message_options, open_channel
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent.block_deltas import BlockDelta, to_block_events

tracer = trace.get_tracer("kvroute.agent")
log = logging.getLogger("kvroute.agent.cp")
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    # Detect a control plane that vanished without closing the TCP connection.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass
class WorkerIdentity:
    worker_id: str
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str = ""
    data_parallel_rank: int | None = None  # set for one rank of a data-parallel engine
    role: str = ""  # "prefill", "decode", or "" for both (RegisterWorker.role)
    lora_adapters: list[str] = field(default_factory=list)  # what the engine serves now (updated by the agent)

    def register_message(self, agent_instance: str = "", acked_seq: int = 0) -> pb.AgentMessage:
        return pb.AgentMessage(
            register=pb.RegisterWorker(
                worker_id=self.worker_id,
                model=self.model,
                engine=self.engine,
                block_size=self.block_size,
                endpoint=self.endpoint,
                engine_version=self.engine_version,
                lora_adapters=self.lora_adapters,
                data_parallel_rank=self.data_parallel_rank,
                agent_instance=agent_instance,
                acked_seq=acked_seq,
                role=self.role,
            )
        )


@dataclass(slots=True)
class LinkCounters:
    sessions: int = 0  # streams that got `Registered`
    connect_failures: int = 0  # attempts or sessions that ended in an error
    snapshots_sent: int = 0
    batches_sent: int = 0  # incremental batches
    events_sent: int = 0
    batches_acked: int = 0
    heartbeats_sent: int = 0
    dropped_while_disconnected: int = 0  # held batches and deltas dropped: a snapshot superseded them
    overflow_resyncs: int = 0  # held + queued events grew past max_pending_events: replaced by a snapshot
    refusals: int = 0  # Connect refused: the worker id is held by another live agent
    resumes: int = 0  # sessions that continued the sequence (no snapshot)
    batches_resent: int = 0  # held batches sent again to another stream after a resume
    failovers: int = 0  # sessions started on another address than the previous one

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _EndSession(Exception):
    pass


class _Reregister(Exception):
    pass


# The control plane's answer to a `register` for a worker id that another live stream holds.
WORKER_ID_IN_USE = grpc.StatusCode.ALREADY_EXISTS


@dataclass(slots=True)
class _HeldBatch:
    """A batch sent (or to be re-sent) and not acked yet."""

    seq: int
    snapshot: bool
    events: list[pb.BlockEvent]
    sent_at: float = 0.0


class ControlPlaneLink:
    def __init__(
        self,
        address: str,
        identity: WorkerIdentity,
        snapshot: Callable[[], list[BlockDelta]],
        load: Callable[[], pb.WorkerLoad],
        *,
        heartbeat_interval_s: float | None = None,
        register_timeout_s: float = 5.0,
        ack_timeout_s: float = 15.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        max_pending_events: int = 100_000,
        stable_session_s: float = 5.0,
        probe_interval_s: float = 0.25,
        refused_backoff_s: float = 2.0,
        addresses: AddressRotation | None = None,
        tls: ClientTls | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.addresses = addresses or AddressRotation(address)
        # TLS (--tls-*): each session opens its channel with the certificate files as they are then,
        # so a rotated certificate is used from the next session on.
        self.tls = tls
        self.grpc_options = (
            GRPC_OPTIONS if max_message_bytes is None else [*grpc_message_options(max_message_bytes), *GRPC_OPTIONS[2:]]
        )
        self.address = self.addresses.entries[0]  # the replica of the current (or last) session
        self.identity = identity
        self._snapshot, self._load = snapshot, load
        self.heartbeat_interval_s = heartbeat_interval_s  # None: min(1 s, heartbeat_timeout_ms / 3)
        self.register_timeout_s, self.ack_timeout_s = register_timeout_s, ack_timeout_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.max_pending_events = max_pending_events
        # Backoff restarts from backoff_initial_s only after a session that lasted this long (two agents
        # fighting over one worker id must not reconnect in a tight loop).
        self.stable_session_s = stable_session_s
        self.probe_interval_s = probe_interval_s
        self.refused_backoff_s = refused_backoff_s
        self.counters = LinkCounters()
        # This agent process for this worker: the control plane lets it resume and never refuses it as
        # a second agent.
        self.instance = uuid.uuid4().hex[:16]
        self.connected = False  # registered and the first batch written
        self.not_connected_reason = "connecting"  # while not connected: why (the agent's /ready)
        self.refused: str | None = None  # the control plane's refusal while the worker id is held elsewhere
        self._episode_refusals = 0
        self._problems = RateLimitedLog(log, period_s=30.0)  # connection failures: a line per 30 s at most
        self.last_sent_seq = 0
        self.acked_seq = 0
        self.connected_event = asyncio.Event()  # set while connected (tests and /health)
        self._seq = 0  # the last seq given to a batch (runs on across sessions)
        self._held: deque[_HeldBatch] = deque()  # seq order, contiguous up to _seq
        self._held_events = 0
        self._pending: list[pb.BlockEvent] = []
        self._resync = False
        self._reregister = False
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ producer side (never blocks)

    def send(self, deltas: list[BlockDelta]) -> None:
        """Queue deltas for the next batch (also while disconnected, up to the bound)."""
        if not deltas:
            return
        if self._resync:
            return  # a snapshot is due anyway
        self._pending.extend(to_block_events(deltas))
        if self._held_events + len(self._pending) > self.max_pending_events:
            self.counters.overflow_resyncs += 1
            log.warning("control plane backlog of %d events: sending a snapshot instead", self._held_events + len(self._pending))
            self.resync()
            return
        self._wake.set()

    def resync(self) -> None:
        """Replace queued and held deltas by a fresh snapshot (after the worker's state was reset)."""
        self._pending = []
        self._drop_held()
        self._resync = True
        self._wake.set()

    def reregister(self) -> None:
        """End the current session and register again at once (the identity changed)."""
        self._reregister = True
        self._wake.set()

    def _drop_held(self) -> None:
        self._held.clear()
        self._held_events = 0

    # ------------------------------------------------------------------ sessions

    async def run(self) -> None:
        """Keep a session up forever; never raises (except cancellation)."""
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s, jitter=0.5)
        failures = 0
        previous = ""
        while True:
            registered_before = self.counters.sessions
            started = time.monotonic()
            unreachable = refused = False
            address, _ = self.addresses.next()
            self.address = address
            try:
                await self._session(address, failover=bool(previous) and previous != address)
            except asyncio.CancelledError:
                self.connected = False
                self.connected_event.clear()
                raise
            except _Reregister:
                log.info(
                    "re-registering with control plane %s as %s (block_size %d)",
                    self.address,
                    self.identity.worker_id,
                    self.identity.block_size,
                )
                self._resync = True  # the worker's keys may have changed meaning
                continue
            except grpc.aio.AioRpcError as exc:
                failures += 1
                refused = exc.code() == WORKER_ID_IN_USE
                unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
                if refused:
                    self._on_refused(exc.details() or "")
                else:
                    self._log_failure(failures, describe_rpc_error(exc, self.tls), unreachable)
            except Exception as exc:  # noqa: BLE001 - the link must never die
                failures += 1
                self._log_failure(failures, f"{type(exc).__name__}: {exc}", False)
            finally:
                self._disconnected()
                if self.counters.sessions > registered_before:
                    previous = address
            self.counters.connect_failures += 1
            if self.counters.sessions > registered_before and time.monotonic() - started > self.stable_session_s:
                backoff.reset()  # the session was up for a while: start over
                failures = 0
            if not refused and self.addresses.several and not self._round_exhausted():
                continue  # another replica is untried in this round: go there now
            if refused:  # the other agent will not go away in a moment: no quick retries
                backoff.at_least(self.refused_backoff_s)
            delay = backoff.next_delay()
            if unreachable:
                await self._wait_reachable(delay)
            else:  # reachable but the session failed (e.g. superseded by another agent): back off in full
                await asyncio.sleep(delay)

    def _round_exhausted(self) -> bool:
        """Every address of the current round has been tried (the next `next()` starts a round)."""
        return self.addresses.round_done

    async def _wait_reachable(self, timeout_s: float) -> None:
        """Up to `timeout_s`, or until a fresh channel connects to one of the control planes."""
        options = [
            *self.grpc_options,
            ("grpc.initial_reconnect_backoff_ms", int(self.probe_interval_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.probe_interval_s * 1000)),
        ]
        channels = [open_channel(a, self.tls, options) for a in self.addresses.round_addresses()]
        waits = [asyncio.ensure_future(c.channel_ready()) for c in channels]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            for channel in channels:
                await channel.close()

    def _log_failure(self, failures: int, why: str, unreachable: bool) -> None:
        self.not_connected_reason = f"control plane {self.address} {'unreachable' if unreachable else 'failed'}: {why}"
        self._problems.warning("unavailable", "control plane %s unavailable (attempt %d): %s", self.address, failures, why)

    def _on_refused(self, details: str) -> None:
        self.counters.refusals += 1
        self._episode_refusals += 1
        self.not_connected_reason = f"refused by control plane {self.address}: {details}"
        if self.refused is None:  # once per episode; it ends when a registration succeeds
            log.error(
                "control plane %s refused worker id %r: %s. Retrying every few seconds until that agent goes away.",
                self.address,
                self.identity.worker_id,
                details,
            )
        self.refused = details

    def _disconnected(self) -> None:
        if self.connected:
            log.warning("control plane %s: stream closed; reconnecting", self.address)
        self.connected = False
        self.not_connected_reason = self.not_connected_reason or "reconnecting"
        self.connected_event.clear()

    async def _session(self, address: str, failover: bool) -> None:
        async with open_channel(address, self.tls, self.grpc_options) as channel:
            call = pb_grpc.ControlPlaneStub(channel).Connect()
            try:
                await self._run_stream(call, failover)
            finally:
                call.cancel()

    async def _end_stream(self, call: grpc.aio.StreamStreamCall, reader: asyncio.Task[None], timeout_s: float = 2.0) -> None:
        """Half-close and wait (briefly) until the control plane ended the stream: it has released the
        worker id then, so the next `register` is not refused as a second agent's."""
        try:
            await call.done_writing()
            await asyncio.wait_for(reader, timeout_s)  # reads acks until the control plane's EOF
        except Exception as exc:  # noqa: BLE001 - EOF (_EndSession), a stream error or the timeout: all mean done
            log.debug("stream to %s ended for re-registration: %r", self.address, exc)

    def _can_resume(self, last_seq: int) -> bool:
        """Do we hold every batch after the log's `last_seq` (contiguously up to our own last one)?"""
        if self._resync or last_seq > self._seq:
            return False
        return last_seq == self._seq or bool(self._held) and self._held[0].seq <= last_seq + 1

    def _acked(self, seq: int) -> None:
        held = self._held
        while held and held[0].seq <= seq:
            self._held_events -= len(held.popleft().events)
            self.counters.batches_acked += 1
        self.acked_seq = max(self.acked_seq, seq)

    async def _run_stream(self, call: grpc.aio.StreamStreamCall, failover: bool) -> None:
        await call.write(self.identity.register_message(self.instance, self.acked_seq))
        reply = await asyncio.wait_for(call.read(), self.register_timeout_s)
        if reply is grpc.aio.EOF or reply.WhichOneof("body") != "registered":
            raise _EndSession(f"expected `registered`, got {reply!r}")
        registered = reply.registered
        self.counters.sessions += 1
        if failover:
            self.counters.failovers += 1
        if self.refused is not None:
            log.info(
                "control plane %s accepted worker id %r after %d refusals",
                self.address,
                self.identity.worker_id,
                self._episode_refusals,
            )
            self.refused, self._episode_refusals = None, 0
        timeout_ms = registered.heartbeat_timeout_ms
        interval = self.heartbeat_interval_s or (min(1.0, timeout_ms / 3000) if timeout_ms else 1.0)

        async def read_acks() -> None:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise _EndSession("control plane closed the stream")
                if message.WhichOneof("body") == "ack":
                    self._acked(message.ack.seq)

        async def write(batch: _HeldBatch) -> None:
            batch.sent_at = time.monotonic()
            self.last_sent_seq = batch.seq
            message = pb.AgentMessage(batch=pb.EventBatch(seq=batch.seq, snapshot=batch.snapshot, events=batch.events))
            if tracing_active():  # sampled by OTEL_TRACES_SAMPLER; the control plane's apply span joins it
                with tracer.start_as_current_span(
                    "kvroute.agent.send_batch",
                    kind=trace.SpanKind.PRODUCER,
                    attributes={
                        "kvroute.worker_id": self.identity.worker_id,
                        "kvroute.seq": batch.seq,
                        "kvroute.events": len(batch.events),
                        "kvroute.snapshot": batch.snapshot,
                    },
                ) as span:
                    if span.is_recording():
                        carrier: dict[str, str] = {}
                        propagate.inject(carrier)
                        message.batch.traceparent = carrier.get("traceparent", "")
                    await call.write(message)
            else:
                await call.write(message)
            if batch.snapshot:
                self.counters.snapshots_sent += 1
            else:
                self.counters.batches_sent += 1
                self.counters.events_sent += len(batch.events)

        def new_batch(snapshot: bool, events: list[pb.BlockEvent]) -> _HeldBatch:
            self._seq += 1
            batch = _HeldBatch(self._seq, snapshot, events)
            self._held.append(batch)
            self._held_events += len(events)
            return batch

        # The snapshot (or the decision to resume) and `connected` are taken in one step (no await in
        # between), so every later delta is either in the snapshot / held batches or queued after them.
        resume = registered.resume and self._can_resume(registered.last_seq)
        self._reregister = False
        self._wake.clear()
        if resume:
            self._acked(registered.last_seq)  # the log has these: as good as acked
            first: list[_HeldBatch] = list(self._held)
            self.counters.batches_resent += sum(1 for batch in first if batch.sent_at)
            if self._pending:
                events, self._pending = self._pending, []
                first.append(new_batch(False, events))
            self.counters.resumes += 1
        else:
            if self._held or self._pending:
                self.counters.dropped_while_disconnected += len(self._held) + (1 if self._pending else 0)
            self._drop_held()
            self._pending, self._resync = [], False
            self._seq = registered.last_seq if registered.resume else 0
            first = [new_batch(True, to_block_events(self._snapshot()))]
        self.connected = True
        self.not_connected_reason = ""
        self.connected_event.set()
        self._problems.recovered("unavailable")  # the line below says it is back
        log.info(
            "registered with control plane %s as %s (model %s, block_size %d, epoch %d): %s",
            self.address,
            self.identity.worker_id,
            self.identity.model,
            self.identity.block_size,
            registered.epoch,
            f"resuming after seq {registered.last_seq}, {len(first)} batches to send"
            if resume
            else f"snapshot as seq {self._seq}",
        )
        reader = asyncio.create_task(read_acks())
        reader.add_done_callback(lambda _: self._wake.set())
        try:
            for batch in first:
                await write(batch)
            next_heartbeat = time.monotonic()
            while True:
                now = time.monotonic()
                if now >= next_heartbeat:
                    await call.write(
                        pb.AgentMessage(heartbeat=pb.Heartbeat(load=self._load(), lora_adapters=self.identity.lora_adapters))
                    )
                    self.counters.heartbeats_sent += 1
                    next_heartbeat = now + interval
                if self._held and self._held[0].sent_at and now - self._held[0].sent_at > self.ack_timeout_s:
                    raise _EndSession(f"batch {self._held[0].seq} not acked within {self.ack_timeout_s:.0f}s")
                if not self._wake.is_set():
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.0, next_heartbeat - time.monotonic()))
                    except TimeoutError:
                        continue
                    finally:
                        # Python 3.11's wait_for returns the result, not CancelledError, when the event is set
                        # in the same turn as the cancellation (the reader's done callback sets it): stop anyway.
                        if (task := asyncio.current_task()) is not None and task.cancelling():
                            raise asyncio.CancelledError()
                self._wake.clear()
                if reader.done():
                    reader.result()  # raises why the stream ended
                    raise _EndSession("ack reader stopped")
                if self._reregister:
                    await self._end_stream(call, reader)
                    raise _Reregister()
                if self._resync:
                    self._resync, self._pending = False, []
                    self._drop_held()
                    await write(new_batch(True, to_block_events(self._snapshot())))
                elif self._pending:
                    events, self._pending = self._pending, []
                    await write(new_batch(False, events))
        finally:
            reader.cancel()
