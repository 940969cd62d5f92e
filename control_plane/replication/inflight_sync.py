"""Routers on different replicas see each other's in-flight reservations.

Every replica publishes what its router sessions do (open, reserve, prefill_done, release, close)
to one Redis stream, batched per event-loop turn, plus a beat every second; every replica applies
the others' to its own `InflightTracker` under the same router ids, so queries answered anywhere
count them. Soft state: a replica silent for `silent_after_s` has its routers' sessions dropped by
the others; a router that opens a session on one replica has its sessions from other replicas
dropped (it re-sends its live reservations to the new one); Redis down means each replica sees
only its own routers until it is back. Nothing here is on a query's path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from redis.exceptions import RedisError

from kvroute.control_plane.replication.redis_log import raise_if_cancelled
from kvroute.control_plane.replication.redis_url import redis_backoff
from kvroute.fleet.entries import pack_keys, unpack_keys
from kvroute.fleet.inflight import DuplicateReservation, RouterSessionState
from kvroute.fleet.state import FleetState

log = logging.getLogger("kvroute.control_plane.inflight_sync")

STREAM = "kvroute:{kvroute:inflight}:log"
OPEN, RESERVE, PREFILL_DONE, RELEASE, CLOSE, BEAT = range(6)


class RouterOp(msgspec.Struct, array_like=True):
    kind: int
    router_id: str = ""
    session: int = 0            # the session's number on the publishing replica
    reservation_id: int = 0
    worker_id: str = ""
    block_size: int = 0
    keys: bytes = b""
    prefill_tokens: int = 0
    ttl_ms: int = 0
    prompt_tokens: int = 0


_OPS = msgspec.msgpack.Decoder(list[RouterOp])
_ENCODE = msgspec.msgpack.Encoder().encode


@dataclass(slots=True)
class SyncCounters:
    published: int = 0
    applied: int = 0
    publish_failures: int = 0        # ops lost while Redis was unreachable
    unknown_worker: int = 0          # a reservation on a worker this replica does not know (yet)
    dropped_silent_replicas: int = 0


class InflightSync:
    def __init__(self, redis, state: FleetState, replica_id: str,
                 silent_after_s: float = 3.0, beat_s: float = 1.0, max_len: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis, self.inflight, self.registry, self.sessions = redis, state.inflight, state.registry, state.sessions
        self.replica_id = replica_id.encode()
        self.silent_after_s, self.beat_s, self.max_len = silent_after_s, beat_s, max_len
        self.clock = clock
        self.counters = SyncCounters()
        self._outbox: list[RouterOp] = []
        self._heard: dict[bytes, float] = {}
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._stopping = False

    # ------------------------------------------------------------ what local routers do

    def opened(self, session: RouterSessionState) -> None:
        self.sessions.drop_router(session.router.router_id)  # it moved here
        self._publish(RouterOp(OPEN, session.router.router_id, session.session_id))

    def reserved(self, session: RouterSessionState, reservation_id: int, worker_id: str, block_size: int,
                 keys, prefill_tokens: int, ttl_ms: int, prompt_tokens: int) -> None:
        self._publish(RouterOp(RESERVE, session.router.router_id, session.session_id, reservation_id, worker_id,
                               block_size, pack_keys(keys), prefill_tokens, ttl_ms, prompt_tokens))

    def prefill_done(self, session: RouterSessionState, reservation_id: int) -> None:
        self._publish(RouterOp(PREFILL_DONE, session.router.router_id, session.session_id, reservation_id))

    def released(self, session: RouterSessionState, reservation_id: int) -> None:
        self._publish(RouterOp(RELEASE, session.router.router_id, session.session_id, reservation_id))

    def closed(self, session: RouterSessionState) -> None:
        self._publish(RouterOp(CLOSE, session.router.router_id, session.session_id))

    def _publish(self, op: RouterOp) -> None:
        self._outbox.append(op)
        self._wake.set()

    async def _flush_forever(self) -> None:
        """One task writes, so ops go out in order (a release never overtakes its reserve), each XADD
        carrying whatever accumulated meanwhile."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ops, self._outbox = self._outbox, []
            if ops:
                await self._xadd(ops)

    async def _xadd(self, ops: list[RouterOp]) -> None:
        try:
            await self.redis.xadd(STREAM, {"r": self.replica_id, "d": _ENCODE(ops)}, maxlen=self.max_len,
                                  approximate=True)
            self.counters.published += len(ops)
        except (RedisError, OSError):
            raise_if_cancelled()
            self.counters.publish_failures += len(ops)

    # ------------------------------------------------------------ what other replicas' routers do

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._tail_forever(), name="kvroute-inflight-sync"))
        self._tasks.append(asyncio.create_task(self._beat_forever(), name="kvroute-inflight-beat"))
        self._tasks.append(asyncio.create_task(self._flush_forever(), name="kvroute-inflight-publish"))

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.beat_s)
            self._publish(RouterOp(BEAT))
            now = self.clock()
            for replica, heard in list(self._heard.items()):
                if now - heard > self.silent_after_s:
                    del self._heard[replica]
                    self._drop_replica(replica)

    async def _tail_forever(self) -> None:
        position = b"$"
        backoff = redis_backoff()
        while True:
            try:
                if position == b"$":  # from now on: reservations older than this replica are not replayed
                    last = await self.redis.xrevrange(STREAM, count=1)
                    position = last[0][0] if last else b"0-0"
                reply = await self.redis.xread({STREAM: position}, count=1000, block=1000)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                raise_if_cancelled()
                if self._stopping:
                    return
                await backoff.sleep()
                continue
            if self._stopping:
                return
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    position = entry_id
                    replica = fields[b"r"]
                    if replica != self.replica_id:
                        self._heard[replica] = self.clock()
                        for op in _OPS.decode(fields[b"d"]):
                            self._apply(replica, op)

    def _apply(self, replica: bytes, op: RouterOp) -> None:
        self.counters.applied += 1
        origin = replica.decode()
        if op.kind == OPEN:
            self.sessions.open(origin, op.session, op.router_id)
            return
        if op.kind == CLOSE:
            self.sessions.close(origin, op.session)
            return
        session = self.sessions.get(origin, op.session)
        if session is None:
            return
        if op.kind == RESERVE:
            record = self.registry.get(op.worker_id)
            if record is None:
                self.counters.unknown_worker += 1
                return
            keys = unpack_keys(op.keys) if op.block_size == record.block_size else []
            try:
                self.inflight.reserve(session, op.reservation_id, record.slot, keys, op.prefill_tokens, op.ttl_ms,
                                      op.prompt_tokens, record.block_size)
            except DuplicateReservation:
                pass
        elif op.kind == PREFILL_DONE:
            self.inflight.prefill_done(session, op.reservation_id)
        elif op.kind == RELEASE:
            self.inflight.release(session, op.reservation_id)

    def _drop_replica(self, replica: bytes) -> None:
        if self.sessions.drop_origin(replica.decode()):
            log.warning("replica %s silent for %.0fs: dropping its routers' reservations", replica.decode(),
                        self.silent_after_s)
            self.counters.dropped_silent_replicas += 1
