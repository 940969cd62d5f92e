"""The agent's side of `ControlPlane.Connect`: register, snapshot, deltas, heartbeats, reconnect.

One session = one gRPC stream:
  register -> wait `Registered` -> EventBatch(seq=1, snapshot=True, one BlocksStored per tier) ->
  incremental EventBatches (seq 2, 3, ...: whatever accumulated since the last send) and
  heartbeats carrying WorkerLoad and the engine's LoRA adapters every min(1 s, heartbeat_timeout_ms / 3).
Acks are read concurrently. A batch not acked within `ack_timeout_s`, a missing `Registered`,
or any stream error ends the session; the link then reconnects with exponential backoff and
jitter (0.1 s doubling to 5 s). While the control plane is unreachable (UNAVAILABLE) the wait
also ends as soon as a probe channel connects to it (`probe_interval_s`, gRPC's own reconnect
attempts), so a restarted control plane gets its snapshots within about that interval instead
of after a backoff grown during the outage. Deltas produced while disconnected are not queued: the snapshot
sent first on the next session is taken from the resolver, which kept applying engine events,
so it supersedes them (and any batch sent but never acked).

A control plane that refuses the worker id because another agent's stream for it is live
(ALREADY_EXISTS: two agents started with one --worker-id) is logged once per episode, as an error
naming the other agent's address, and retried with a backoff starting at `refused_backoff_s`; the
link's `not_connected_reason` (the agent's /ready) says so meanwhile. A re-registration (the
engine's block size changed) half-closes the stream and waits for the control plane to end it, so
the id is free again before the new `register` arrives.

`send()` never blocks (the ZMQ reader calls it); the gRPC writes happen in the link's own task.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import grpc

from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent.block_deltas import BlockDelta, to_block_events

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
    data_parallel_rank: int | None = None   # set for one rank of a data-parallel engine
    lora_adapters: list[str] = field(default_factory=list)  # what the engine serves now (updated by the agent)

    def register_message(self) -> pb.AgentMessage:
        return pb.AgentMessage(register=pb.RegisterWorker(
            worker_id=self.worker_id, model=self.model, engine=self.engine, block_size=self.block_size,
            endpoint=self.endpoint, engine_version=self.engine_version, lora_adapters=self.lora_adapters,
            data_parallel_rank=self.data_parallel_rank))


@dataclass(slots=True)
class LinkCounters:
    sessions: int = 0            # streams that got `Registered`
    connect_failures: int = 0    # attempts or sessions that ended in an error
    snapshots_sent: int = 0
    batches_sent: int = 0        # incremental batches
    events_sent: int = 0
    batches_acked: int = 0
    heartbeats_sent: int = 0
    dropped_while_disconnected: int = 0  # delta batches not sent (superseded by the next snapshot)
    overflow_resyncs: int = 0    # backlog grew past max_pending_events: replaced by a snapshot
    refusals: int = 0            # Connect refused: the worker id is held by another live agent

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _EndSession(Exception):
    pass


class _Reregister(Exception):
    pass


# The control plane's answer to a `register` for a worker id that another live stream holds.
WORKER_ID_IN_USE = grpc.StatusCode.ALREADY_EXISTS


class ControlPlaneLink:
    def __init__(self, address: str, identity: WorkerIdentity, snapshot: Callable[[], list[BlockDelta]],
                 load: Callable[[], pb.WorkerLoad], *, heartbeat_interval_s: float | None = None,
                 register_timeout_s: float = 5.0, ack_timeout_s: float = 15.0, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 5.0, max_pending_events: int = 100_000, stable_session_s: float = 5.0,
                 probe_interval_s: float = 0.25, refused_backoff_s: float = 2.0) -> None:
        self.address, self.identity = address, identity
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
        self.connected = False       # registered and the snapshot written
        self.not_connected_reason = "connecting"  # while not connected: why (the agent's /ready)
        self.refused: str | None = None  # the control plane's refusal while the worker id is held elsewhere
        self._episode_refusals = 0
        self.last_sent_seq = 0
        self.acked_seq = 0
        self.connected_event = asyncio.Event()  # set while connected (tests and /health)
        self._pending: list[pb.BlockEvent] = []
        self._resync = False
        self._reregister = False
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ producer side (never blocks)

    def send(self, deltas: list[BlockDelta]) -> None:
        """Queue deltas for the next batch; dropped while disconnected (the next snapshot covers them)."""
        if not deltas:
            return
        if not self.connected:
            self.counters.dropped_while_disconnected += 1
            return
        if self._resync:
            return  # a snapshot is due anyway
        self._pending.extend(to_block_events(deltas))
        if len(self._pending) > self.max_pending_events:
            self.counters.overflow_resyncs += 1
            log.warning("control plane backlog of %d events: sending a snapshot instead", len(self._pending))
            self.resync()
            return
        self._wake.set()

    def resync(self) -> None:
        """Replace queued deltas by a fresh snapshot (after the worker's state was reset)."""
        self._pending = []
        self._resync = True
        self._wake.set()

    def reregister(self) -> None:
        """End the current session and register again at once (the identity changed)."""
        self._reregister = True
        self._wake.set()

    # ------------------------------------------------------------------ sessions

    async def run(self) -> None:
        """Keep a session up forever; never raises (except cancellation)."""
        backoff = self.backoff_initial_s
        failures = 0
        while True:
            registered_before = self.counters.sessions
            started = time.monotonic()
            unreachable = refused = False
            try:
                await self._session()
            except asyncio.CancelledError:
                self.connected = False
                self.connected_event.clear()
                raise
            except _Reregister:
                log.info("re-registering with control plane %s as %s (block_size %d)", self.address,
                         self.identity.worker_id, self.identity.block_size)
                continue
            except grpc.aio.AioRpcError as exc:
                failures += 1
                refused = exc.code() == WORKER_ID_IN_USE
                unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
                if refused:
                    self._on_refused(exc.details() or "")
                else:
                    self._log_failure(failures, f"{exc.code().name}: {exc.details()}", unreachable)
            except Exception as exc:  # noqa: BLE001 - the link must never die
                failures += 1
                self._log_failure(failures, f"{type(exc).__name__}: {exc}", False)
            finally:
                self._disconnected()
            self.counters.connect_failures += 1
            if self.counters.sessions > registered_before and time.monotonic() - started > self.stable_session_s:
                backoff, failures = self.backoff_initial_s, 0  # the session was up for a while: start over
            if refused:  # the other agent will not go away in a moment: no quick retries
                backoff = max(backoff, self.refused_backoff_s)
            delay = backoff * random.uniform(0.5, 1.5)
            if unreachable:
                await self._wait_reachable(delay)
            else:  # reachable but the session failed (e.g. superseded by another agent): back off in full
                await asyncio.sleep(delay)
            backoff = min(backoff * 2, self.backoff_max_s)

    async def _wait_reachable(self, timeout_s: float) -> None:
        """Up to `timeout_s`, or until a fresh channel connects to the control plane."""
        options = [*GRPC_OPTIONS, ("grpc.initial_reconnect_backoff_ms", int(self.probe_interval_s * 1000)),
                   ("grpc.max_reconnect_backoff_ms", int(self.probe_interval_s * 1000))]
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout_s)
            except TimeoutError:
                pass

    def _log_failure(self, failures: int, why: str, unreachable: bool) -> None:
        self.not_connected_reason = f"control plane {self.address} {'unreachable' if unreachable else 'failed'}: {why}"
        if failures <= 3 or failures % 20 == 0:
            log.warning("control plane %s unavailable (attempt %d): %s", self.address, failures, why)

    def _on_refused(self, details: str) -> None:
        self.counters.refusals += 1
        self._episode_refusals += 1
        self.not_connected_reason = f"refused by control plane {self.address}: {details}"
        if self.refused is None:  # once per episode; it ends when a registration succeeds
            log.error("control plane %s refused worker id %r: %s. Retrying every few seconds until that agent "
                      "goes away.", self.address, self.identity.worker_id, details)
        self.refused = details

    def _disconnected(self) -> None:
        if self.connected:
            log.warning("control plane %s: stream closed; reconnecting", self.address)
        self.connected = False
        self.not_connected_reason = self.not_connected_reason or "reconnecting"
        self.connected_event.clear()
        self._pending = []

    async def _session(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS) as channel:
            call = pb_grpc.ControlPlaneStub(channel).Connect()
            try:
                await self._run_stream(call)
            finally:
                call.cancel()

    async def _end_stream(self, call: grpc.aio.StreamStreamCall, reader: asyncio.Task[None],
                          timeout_s: float = 2.0) -> None:
        """Half-close and wait (briefly) until the control plane ended the stream: it has released the
        worker id then, so the next `register` is not refused as a second agent's."""
        try:
            await call.done_writing()
            await asyncio.wait_for(reader, timeout_s)  # reads acks until the control plane's EOF
        except Exception as exc:  # noqa: BLE001 - EOF (_EndSession), a stream error or the timeout: all mean done
            log.debug("stream to %s ended for re-registration: %r", self.address, exc)

    async def _run_stream(self, call: grpc.aio.StreamStreamCall) -> None:
        await call.write(self.identity.register_message())
        reply = await asyncio.wait_for(call.read(), self.register_timeout_s)
        if reply is grpc.aio.EOF or reply.WhichOneof("body") != "registered":
            raise _EndSession(f"expected `registered`, got {reply!r}")
        self.counters.sessions += 1
        if self.refused is not None:
            log.info("control plane %s accepted worker id %r after %d refusals", self.address,
                     self.identity.worker_id, self._episode_refusals)
            self.refused, self._episode_refusals = None, 0
        timeout_ms = reply.registered.heartbeat_timeout_ms
        interval = self.heartbeat_interval_s or (min(1.0, timeout_ms / 3000) if timeout_ms else 1.0)
        log.info("registered with control plane %s as %s (model %s, block_size %d)", self.address,
                 self.identity.worker_id, self.identity.model, self.identity.block_size)

        unacked: deque[tuple[int, float]] = deque()
        seq = 0

        async def read_acks() -> None:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise _EndSession("control plane closed the stream")
                if message.WhichOneof("body") == "ack":
                    acked = message.ack.seq
                    self.acked_seq = acked
                    while unacked and unacked[0][0] <= acked:
                        unacked.popleft()
                        self.counters.batches_acked += 1

        async def write_batch(snapshot: bool, events: list[pb.BlockEvent]) -> None:
            nonlocal seq
            seq += 1
            unacked.append((seq, time.monotonic()))
            self.last_sent_seq = seq
            await call.write(pb.AgentMessage(batch=pb.EventBatch(seq=seq, snapshot=snapshot, events=events)))
            if snapshot:
                self.counters.snapshots_sent += 1
            else:
                self.counters.batches_sent += 1
                self.counters.events_sent += len(events)

        # The snapshot and `connected` are taken in one step (no await in between), so every later
        # delta is either in the snapshot or queued after it.
        self._pending, self._resync, self._reregister = [], False, False
        self._wake.clear()
        snapshot = to_block_events(self._snapshot())
        self.connected = True
        self.not_connected_reason = ""
        self.connected_event.set()
        reader = asyncio.create_task(read_acks())
        reader.add_done_callback(lambda _: self._wake.set())
        try:
            await write_batch(True, snapshot)
            next_heartbeat = time.monotonic()
            while True:
                now = time.monotonic()
                if now >= next_heartbeat:
                    await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(
                        load=self._load(), lora_adapters=self.identity.lora_adapters)))
                    self.counters.heartbeats_sent += 1
                    next_heartbeat = now + interval
                if unacked and now - unacked[0][1] > self.ack_timeout_s:
                    raise _EndSession(f"batch {unacked[0][0]} not acked within {self.ack_timeout_s:.0f}s")
                if not self._wake.is_set():
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.0, next_heartbeat - time.monotonic()))
                    except TimeoutError:
                        continue
                self._wake.clear()
                if reader.done():
                    reader.result()  # raises why the stream ended
                    raise _EndSession("ack reader stopped")
                if self._reregister:
                    await self._end_stream(call, reader)
                    raise _Reregister()
                if self._resync:
                    self._resync, self._pending = False, []
                    await write_batch(True, to_block_events(self._snapshot()))
                elif self._pending:
                    events, self._pending = self._pending, []
                    await write_batch(False, events)
        finally:
            reader.cancel()
