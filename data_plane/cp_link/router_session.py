"""This router's RouterSession stream to the control plane: queries and in-flight reservations.

One bidi stream per router process (`ControlPlane.RouterSession`):
- `query()` sends a QueryRequest with a fresh `query_id` and awaits the answer with that id
  (answers come in send order). Over an open stream a query costs one message each way, about
  half a unary call's round trip, which matters inside a ~1 ms decision.
- `reserve()` / `prefill_done()` / `release()` tell the control plane about a request this router
  sent, so every other router's queries count it as load on that worker and see its prompt blocks
  there (speculatively) before the engine's events arrive. They never block: messages wait in an
  outbox that a flusher task writes, and a query writes whatever is still in the outbox before
  itself, so a later query on the stream always reflects them. Queries write to the stream
  directly (no task hop on the decision path); one lock keeps writes whole and in order.

The control plane drops a router's reservations when its stream closes, so after a reconnect the
link re-sends `reserve` (and `prefill_done`) for every reservation still live here. While the
stream is down, `query()` raises `SessionUnavailable` at once (the caller falls back to the unary
Query RPC or decides on load alone) and reservation messages are kept only as state to re-send.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvroute.aio import cancel_and_wait
from kvroute.backoff import Backoff
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.tls import ClientTls, rpc_failure_reason
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

log = logging.getLogger("kvroute.router.session")
_MAX_LATE = 1024  # queries past their deadline whose answer is still awaited (for its latency)
_STALL_S = 0.005  # a deadline timer this late means this process was held up, not the control plane
FLUSH_COALESCE_S = 0.001  # reservations wait this long for their write (other routers see them that much later)


class SessionUnavailable(RuntimeError):
    """The RouterSession stream is not open (connecting, or the control plane is down)."""


@dataclass(slots=True)
class _Live:
    message: pb.Reservation
    prefill_done: bool = False


def _retrieve(task: asyncio.Task) -> None:
    """Done callback of a write nobody may await any more: its failure is the stream's (the read
    loop reconnects), not worth a "never retrieved" warning."""
    if not task.cancelled():
        task.exception()


def default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RouterSessionLink:
    def __init__(
        self,
        stub: pb_grpc.ControlPlaneStub | Callable[[], pb_grpc.ControlPlaneStub],
        router_id: str | None = None,
        reconnect_delay_s: float = 0.2,
        max_reconnect_delay_s: float = 5.0,
        on_lost: Callable[[], bool] | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        # A stub, or a function giving the stub of the replica to use now (several replicas).
        self._stub_of = stub if callable(stub) else (lambda: stub)
        # Called when a session fails; True = another replica was picked, reconnect without a pause.
        self._on_lost = on_lost
        self._tls = tls  # the stubs' channels' TLS (None = plaintext): says what a failed handshake means
        self.router_id = router_id or default_router_id()
        self._backoff = Backoff(reconnect_delay_s, max_reconnect_delay_s)
        self._problems = RateLimitedLog(log, period_s=30.0)
        self._call = None  # the open stream, or None
        self._outbox = pb.RouterMessage()  # `ops` filled as reservations come and go; one write takes it all
        self._outbox_ready = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._pending: dict[int, asyncio.Future] = {}
        # Queries given up on (past their deadline): id -> when sent, so their late answer is timed.
        self._late: OrderedDict[int, float] = OrderedDict()
        self.on_late_answer: Callable[[float], None] | None = None  # seconds from send to a late answer
        # (reservation id, prefill tokens): the control plane charged a reservation less than announced
        self.on_trimmed: Callable[[int, int], None] | None = None
        self._query_ids = itertools.count(1)
        self._reservation_ids = itertools.count(1)
        self._live: dict[int, _Live] = {}
        self._task: asyncio.Task | None = None
        self.connected = False
        self.sessions = 0  # streams opened (1 + reconnects)
        self.stalled_deadlines = 0  # deadlines whose timer fired late: waited once more (see query)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run_forever(), name="kvroute-router-session")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._fail_pending(SessionUnavailable("router session closed"))

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.connected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return self.connected

    # ------------------------------------------------------------ queries

    async def query(self, message: pb.RouterMessage, timeout_s: float) -> pb.QueryResponse:
        """`message.query` filled in but for its id. Raises SessionUnavailable (stream down or lost
        meanwhile) or TimeoutError."""
        if not self.connected or self._call is None:
            raise SessionUnavailable("router session is not connected")
        query_id = next(self._query_ids)
        message.query.query_id = query_id
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[query_id] = future
        sent = time.perf_counter()
        # The write runs as its own task: a deadline (or a client going away) that cancelled a
        # grpc.aio write half-way would end the whole stream ("RPC already finished" for every
        # query after it, until the reconnect); the write finishes and the answer counts as late.
        write = loop.create_task(self._write(message))
        write.add_done_callback(_retrieve)
        try:
            try:
                return await self._answer(write, future, timeout_s)
            except TimeoutError:
                # The deadline measures the control plane, not this process: if the timer itself fired
                # late (this process waited for a CPU), the answer may be here unread. Wait as long again
                # as the stall, once, within one more deadline.
                overdue = time.perf_counter() - sent - timeout_s
                if overdue < _STALL_S:
                    raise
                self.stalled_deadlines += 1
                return await self._answer(write, future, min(overdue, timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise SessionUnavailable(f"router session lost: {exc.code().name}") from None
        except asyncio.InvalidStateError:  # grpc: the call ended between our check and the write
            raise SessionUnavailable("router session lost: the stream had ended") from None
        except TimeoutError:
            self._late[query_id] = sent
            if len(self._late) > _MAX_LATE:
                self._late.popitem(last=False)
            raise
        finally:
            self._pending.pop(query_id, None)
            if future.done() and not future.cancelled():
                # Retrieved: a session lost while the write was pending fails the answer's future with
                # nobody awaiting it yet (asyncio would log "exception was never retrieved").
                future.exception()

    @staticmethod
    async def _answer(write: asyncio.Task, future: asyncio.Future, timeout_s: float) -> pb.QueryResponse:
        """The query's answer within `timeout_s`; neither the write nor the answer is cancelled by a
        timeout (shielded), so a second wait can pick them up."""
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(write)
            return await asyncio.shield(future)

    # ------------------------------------------------------------ reservations

    def reserve(self, worker_id: str, block_size: int, block_keys, prefill_tokens: int, prompt_tokens: int = 0) -> int:
        """Announce a request just sent to `worker_id`; returns the reservation id."""
        reservation_id = next(self._reservation_ids)
        message = pb.Reservation(
            reservation_id=reservation_id,
            worker_id=worker_id,
            block_size=block_size,
            block_keys=block_keys,
            prefill_tokens=max(0, prefill_tokens),
            prompt_tokens=max(0, prompt_tokens),
        )
        self._live[reservation_id] = _Live(message)
        if self.connected:  # else: kept in _live, re-sent after the reconnect
            self._outbox.ops.reserve.append(message)
            self._outbox_ready.set()
        return reservation_id

    def prefill_done(self, reservation_id: int) -> None:
        live = self._live.get(reservation_id)
        if live is not None and not live.prefill_done:
            live.prefill_done = True
            if self.connected:
                self._outbox.ops.prefill_done.append(reservation_id)
                self._outbox_ready.set()

    def release(self, reservation_id: int) -> None:
        if self._live.pop(reservation_id, None) is not None and self.connected:
            self._outbox.ops.release.append(reservation_id)
            self._outbox_ready.set()

    async def _write(self, message: pb.RouterMessage | None = None) -> None:
        """Write the outbox (what accumulated since the last write, one message), then `message`, as one
        uninterrupted run."""
        async with self._write_lock:
            call = self._call
            if call is None:
                raise SessionUnavailable("router session is not connected")
            while self._outbox.HasField("ops"):
                batch, self._outbox = self._outbox, pb.RouterMessage()
                await call.write(batch)
            if message is not None:
                await call.write(message)

    async def _flush_forever(self) -> None:
        while True:
            await self._outbox_ready.wait()
            # A write on the stream costs more than a request's bookkeeping, and it runs on this event
            # loop: written FLUSH_COALESCE_S later it is off the path of the request that reserved (its
            # answer is usually relayed by then) and carries the ops of every request of that moment.
            await asyncio.sleep(FLUSH_COALESCE_S)
            self._outbox_ready.clear()
            await self._write()

    # ------------------------------------------------------------ the stream

    async def _run_forever(self) -> None:
        while True:
            try:
                await self._session()
                self._backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the link must never die
                if self.connected:  # it was up: its loss is news, not more of an outage already logged
                    self._problems.recovered("lost")
                reason = rpc_failure_reason(exc, self._tls)
                self._problems.warning(
                    "lost",
                    "router session to the control plane failed (%s); queries go unary "
                    "and in-flight state stays local until it is back",
                    reason,
                )
            finally:
                self.connected = False
                self._fail_pending(SessionUnavailable("router session lost"))
            if self._on_lost is not None and self._on_lost():
                continue  # another replica: reconnect there at once
            await self._backoff.sleep()

    async def _session(self) -> None:
        call = self._stub_of().RouterSession()
        flusher = None
        try:
            await call.write(pb.RouterMessage(hello=pb.RouterHello(router_id=self.router_id)))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("body") != "welcome":
                raise RuntimeError("control plane did not welcome the router session")
            # Re-announce what is still in flight (the control plane dropped it with the old stream).
            self._outbox = pb.RouterMessage()
            for live in self._live.values():
                self._outbox.ops.reserve.append(live.message)
                if live.prefill_done:
                    self._outbox.ops.prefill_done.append(live.message.reservation_id)
            self._call = call
            self.connected = True
            self.sessions += 1
            if self.sessions > 1:
                log.info("router session re-established (%d reservations re-sent)", len(self._live))
            flusher = asyncio.create_task(self._flush_forever(), name="kvroute-router-session-flush")
            self._outbox_ready.set()
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise RuntimeError("control plane closed the router session")
                body = reply.WhichOneof("body")
                if body == "trimmed":
                    if self.on_trimmed is not None:
                        self.on_trimmed(reply.trimmed.reservation_id, reply.trimmed.prefill_tokens)
                elif body == "result":
                    future = self._pending.get(reply.result.query_id)
                    if future is not None and not future.done():
                        future.set_result(reply.result)
                    elif self._late:
                        sent = self._late.pop(reply.result.query_id, None)
                        if sent is not None and self.on_late_answer is not None:
                            self.on_late_answer(time.perf_counter() - sent)
        finally:
            self._call = None
            self.connected = False
            self._outbox = pb.RouterMessage()
            await cancel_and_wait(flusher)
            call.cancel()

    def _fail_pending(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
