"""Routers on different replicas see each other's in-flight reservations, a replica started after
they were made included.

    sync = InflightSync(redis, inflight, registry, replica_id)
    await sync.start(registry_loaded)  # replays the stream's recent past, then follows it; `ready` once replayed
    sync.opened(session); sync.reserved(session, ...); sync.closed(session)  # as local router sessions do it
    await sync.stop()

Every replica publishes what its router sessions do (open, reserve, prefill_done, release, close)
to one Redis stream, batched per event-loop turn, plus a beat every second; every replica applies
the others' to its own `InflightTracker` under the same router ids, so queries answered anywhere
count them. Nothing here is on a query's path.

State entries: every `state_s` (2 s), first thing after start and after a failed write, a replica's
entry also carries its state: each live local router session with its reservations (worker,
pending prefill, what is left of the max age, the claimed keys and what is left of their TTL),
built in the event-loop turn that took the entry's ops, so it is exactly the state those ops leave
behind (one task writes, in order). A replica applying another's state reconciles its mirror of
that replica with it: sessions and reservations it lacks are restored, those the state no longer
lists are dropped. Hence:
- a replica starting replays the last `replay_s` (2 x `state_s`) of the stream, which holds a
  state of every live replica, before it is ready: it knows the sessions opened before it started;
- an op that never reached a replica (the writer could not reach Redis, entries trimmed while the
  reader was cut off) is repaired by the writer's next state; an op for a session not mirrored
  here is counted (`unknown_session`, logged at most once a minute; `before_state` for a replica
  whose first state this one has not read yet, which that state covers; `superseded` for a
  router's session older than one it opened since, where it re-sent its reservations), never
  dropped unseen;
- nothing released, expired or past its claims' TTL comes back: a state lists only live
  reservations, and the time from an entry to its reading (stream ids: Redis' clock, not the
  hosts') is taken off their ages, as it is off replayed reserves'.
The state is in the stream rather than beside it because the stream orders it with the ops for
free (a key per replica would need a script tying it to a stream position, would not repair lost
ops for replicas already running, and would outlive its replica); a replay alone cannot work, as a
router opens its session once and keeps it for hours. Its cost is the live reservations' size
every `state_s` (docs/architecture.md, "In-flight reservations across replicas"); the stream is
trimmed to `retain_s` (60 s) by time at each state entry and capped at `max_len` entries.

Soft state: a replica silent for `silent_after_s` has its routers' sessions dropped by the others; a
router that opens a session on one replica has its sessions from other replicas dropped (it re-sends
its live reservations to the new one), and the old replica's later states do not bring them back;
Redis down means each replica sees only its own routers until it is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from redis.exceptions import RedisError

from kvroute.aio import cancel_and_wait
from kvroute.control_plane.replication.redis_log import NO_ID, parse_id, raise_if_cancelled
from kvroute.control_plane.replication.redis_url import redis_backoff
from kvroute.fleet.entries import pack_keys, unpack_keys
from kvroute.fleet.inflight import DuplicateReservation, InflightTracker, Reservation, RouterSessionState
from kvroute.fleet.registry import WorkerRecord, WorkerRegistry
from kvroute.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvroute.control_plane.inflight_sync")

STREAM = "kvroute:{kvroute:inflight}:log"
OPEN, RESERVE, PREFILL_DONE, RELEASE, CLOSE, BEAT = range(6)
_OP_NAMES = ("open", "reserve", "prefill_done", "release", "close", "beat")


class RouterOp(msgspec.Struct, array_like=True):
    kind: int
    router_id: str = ""
    session: int = 0  # the session's number on the publishing replica
    reservation_id: int = 0
    worker_id: str = ""
    block_size: int = 0
    keys: bytes = b""
    prefill_tokens: int = 0
    ttl_ms: int = 0
    prompt_tokens: int = 0


class HeldReservation(msgspec.Struct, array_like=True):
    """A live reservation in a state entry; its ages are what was left when the entry was built."""

    reservation_id: int
    worker_id: str
    block_size: int
    prefill_tokens: int  # still pending (0 after prefill_done)
    max_age_ms: int
    claim_ttl_ms: int = 0  # 0: no live claims
    keys: bytes = b""  # the keys it claims (pack_keys)


class HeldSession(msgspec.Struct, array_like=True):
    router_id: str
    session: int
    reservations: list[HeldReservation]


_OPS = msgspec.msgpack.Decoder(list[RouterOp])
_STATE = msgspec.msgpack.Decoder(list[HeldSession])
_ENCODE = msgspec.msgpack.Encoder().encode


@dataclass(slots=True)
class SyncCounters:
    published: int = 0
    applied: int = 0
    publish_failures: int = 0  # ops lost while Redis was unreachable (the next state repairs them)
    unknown_worker: int = 0  # a reservation on a worker this replica does not know (yet)
    dropped_silent_replicas: int = 0
    states_published: int = 0
    states_applied: int = 0
    unknown_session: int = 0  # reserve/prefill_done/release for a session not mirrored here (ops lost)
    before_state: int = 0  # the same from a replica whose first state this one has not read yet
    superseded: int = 0  # the same for a router's older session after it opened a newer one (its
    # reservations were re-sent there: nothing lost)
    restored_sessions: int = 0  # sessions a state held that the ops had not opened here (all, at start)
    restored_reservations: int = 0  # the same for reservations
    dropped_by_state: int = 0  # sessions and reservations a state no longer held (they ended at their
    # origin without an op reaching here, or expired there first)
    malformed_entries: int = 0  # entries that did not decode (skipped)


class InflightSync:
    def __init__(
        self,
        redis,
        inflight: InflightTracker,
        registry: WorkerRegistry,
        replica_id: str,
        silent_after_s: float = 3.0,
        beat_s: float = 1.0,
        max_len: int = 100_000,
        state_s: float = 2.0,
        replay_s: float | None = None,
        retain_s: float = 60.0,
        read_count: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis, self.inflight, self.registry = redis, inflight, registry
        self.replica_id = replica_id.encode()
        self.silent_after_s, self.beat_s, self.max_len = silent_after_s, beat_s, max_len
        self.state_s = state_s
        self.replay_s = 2 * state_s if replay_s is None else replay_s
        self.retain_s = max(retain_s, self.replay_s)
        self.read_count = read_count
        self.clock = clock
        self.counters = SyncCounters()
        self.ready = False  # the stream's recent past is replayed
        self._outbox: list[RouterOp] = []
        self._state_due = False
        self._local: dict[int, RouterSessionState] = {}  # this replica's router sessions, by session id
        self._remote: dict[tuple[bytes, str, int], RouterSessionState] = {}  # (replica, router, session)
        # router -> (replica, session) of its latest open (this replica's included): its older sessions
        # are gone for the others even while the replica that held one still lists it.
        self._latest: dict[str, tuple[bytes, int]] = {}
        self._heard: dict[bytes, float] = {}
        self._states_read: set[bytes] = set()  # replicas whose state this one holds (applied, not dropped since)
        self._latest_ms = 0  # the newest stream id's time seen: Redis' clock
        self._replay: tuple[bytes, bytes] | None = None  # (from, to) while replaying
        self._problems = RateLimitedLog(log, period_s=60.0)
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._stopping = False

    # ------------------------------------------------------------ what local routers do

    def opened(self, session: RouterSessionState) -> None:
        router_id = session.router.router_id
        self._drop_remote_router(router_id)  # it moved here
        self._local[session.session_id] = session
        self._latest[router_id] = (self.replica_id, session.session_id)
        self._publish(RouterOp(OPEN, router_id, session.session_id))

    def reserved(
        self,
        session: RouterSessionState,
        reservation_id: int,
        worker_id: str,
        block_size: int,
        keys,
        prefill_tokens: int,
        ttl_ms: int,
        prompt_tokens: int,
    ) -> None:
        self._publish(
            RouterOp(
                RESERVE,
                session.router.router_id,
                session.session_id,
                reservation_id,
                worker_id,
                block_size,
                pack_keys(keys),
                prefill_tokens,
                ttl_ms,
                prompt_tokens,
            )
        )

    def prefill_done(self, session: RouterSessionState, reservation_id: int) -> None:
        self._publish(RouterOp(PREFILL_DONE, session.router.router_id, session.session_id, reservation_id))

    def released(self, session: RouterSessionState, reservation_id: int) -> None:
        self._publish(RouterOp(RELEASE, session.router.router_id, session.session_id, reservation_id))

    def closed(self, session: RouterSessionState) -> None:
        self._local.pop(session.session_id, None)
        self._forget_if_gone(session.router.router_id)
        self._publish(RouterOp(CLOSE, session.router.router_id, session.session_id))

    def _publish(self, op: RouterOp) -> None:
        self._outbox.append(op)
        self._wake.set()

    async def _flush_forever(self) -> None:
        """One task writes, so ops go out in order (a release never overtakes its reserve), each XADD
        carrying whatever accumulated meanwhile and, when one is due, the state those ops leave."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ops, self._outbox = self._outbox, []
            state = self._state() if self._state_due else None
            self._state_due = False
            if ops or state is not None:
                await self._xadd(ops, state)

    async def _xadd(self, ops: list[RouterOp], state: list[HeldSession] | None) -> None:
        fields = {"r": self.replica_id, "d": _ENCODE(ops)}
        trim: dict[str, object] = {"maxlen": self.max_len}
        if state is not None:
            fields["s"] = _ENCODE(state)
            oldest_ms = self._latest_ms - int(self.retain_s * 1000)
            if oldest_ms > 0:  # by Redis' clock (stream ids), once per state entry
                trim = {"minid": f"{oldest_ms}-0"}
        try:
            await self.redis.xadd(STREAM, fields, approximate=True, **trim)
            self.counters.published += len(ops)
            if state is not None:
                self.counters.states_published += 1
        except (RedisError, OSError):
            raise_if_cancelled()
            self.counters.publish_failures += len(ops)
            self._state_due = True  # the next entry carries a state: the others repair what this one lost

    def _state(self) -> list[HeldSession]:
        """This replica's live router sessions and reservations, ages as left now."""
        self.inflight.expire()  # nothing due goes out
        now = self.inflight.clock()
        workers = {record.slot: record for record in self.registry.workers()}
        return [
            HeldSession(
                s.router.router_id,
                s.session_id,
                [_held(r, workers[r.slot], now) for r in s.reservations.values() if r.slot in workers],
            )
            for s in self._local.values()
        ]

    # ------------------------------------------------------------ what other replicas' routers do

    async def start(self, registry_loaded: Callable[[], Awaitable[object]] | None = None) -> None:
        """Publish a state at once (the others drop what a previous process of this replica id left),
        then replay the stream's last `replay_s` and follow it; `registry_loaded` is awaited before
        the replay (reservations name workers the registry must know)."""
        self._state_due = True
        self._wake.set()
        self._tasks.append(asyncio.create_task(self._tail_forever(registry_loaded), name="kvroute-inflight-sync"))
        self._tasks.append(asyncio.create_task(self._beat_forever(), name="kvroute-inflight-beat"))
        self._tasks.append(asyncio.create_task(self._flush_forever(), name="kvroute-inflight-publish"))

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(*self._tasks, timeout_s=2.0)
        self._tasks.clear()

    def problems(self) -> list[str]:
        return [] if self.ready else ["the other replicas' router sessions not replayed yet"]

    async def _beat_forever(self) -> None:
        next_state = self.clock() + self.state_s
        while True:
            await asyncio.sleep(self.beat_s)
            now = self.clock()
            if now >= next_state:  # a state entry is a beat too
                self._state_due = True
                next_state = now + self.state_s
            else:
                self._outbox.append(RouterOp(BEAT))
            self._wake.set()
            self._drop_silent()

    def _drop_silent(self) -> None:
        now = self.clock()
        for replica, heard in list(self._heard.items()):
            if now - heard > self.silent_after_s:
                del self._heard[replica]
                self._drop_replica(replica)

    async def _tail_forever(self, registry_loaded: Callable[[], Awaitable[object]] | None) -> None:
        if registry_loaded is not None:
            await registry_loaded()
        position = b""
        backoff = redis_backoff()
        while True:
            try:
                if not position:
                    position = await self._replay_recent()
                    self.ready = True
                    self._drop_silent()  # replicas whose last entry was already old
                    log.info(
                        "router sessions of other replicas replayed: %d sessions, %d reservations",
                        len(self._remote),
                        self.inflight.reservation_count(),
                    )
                reply = await self.redis.xread({STREAM: position}, count=self.read_count, block=1000)
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
                    self._entry(entry_id, fields)

    async def _replay_recent(self) -> bytes:
        """Apply the stream's entries of the last `replay_s` up to its head as of the first call (a
        retry after a Redis error goes on where it stopped); returns that head."""
        if self._replay is None:
            last = await self.redis.xrevrange(STREAM, count=1)
            if not last:
                return NO_ID
            head = last[0][0]
            self._latest_ms = max(self._latest_ms, parse_id(head)[0])
            self._replay = (f"{max(0, self._latest_ms - int(self.replay_s * 1000))}-0".encode(), head)
        start, head = self._replay
        while True:
            entries = await self.redis.xrange(STREAM, min=start, max=head, count=self.read_count)
            for entry_id, fields in entries:
                start = b"(" + entry_id
                self._replay = (start, head)
                self._entry(entry_id, fields)
            if len(entries) < self.read_count:
                return head

    def _entry(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        at_ms = parse_id(entry_id)[0]
        self._latest_ms = max(self._latest_ms, at_ms)
        replica = fields.get(b"r", b"")
        if replica == self.replica_id:
            return
        age_s = (self._latest_ms - at_ms) / 1000  # > 0 only while replaying, or reading behind
        try:
            ops = _OPS.decode(fields[b"d"])
            state = _STATE.decode(fields[b"s"]) if b"s" in fields else None
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.counters.malformed_entries += 1
            self._problems.warning(
                "malformed", "in-flight stream entry %s from %r does not decode (skipped): %s", entry_id.decode(), replica, exc
            )
            return
        self._heard[replica] = self.clock() - age_s
        for op in ops:
            self._apply(replica, op, age_s, repaired=state is not None)
        if state is not None:
            self._reconcile(replica, state, age_s)

    def _apply(self, replica: bytes, op: RouterOp, age_s: float, repaired: bool) -> None:
        """`repaired`: the entry's own state follows and covers an op for a session not mirrored here."""
        self.counters.applied += 1
        if op.kind == BEAT:
            return
        key = (replica, op.router_id, op.session)
        if op.kind == OPEN:
            self._drop_remote_router(op.router_id)
            # Named by its origin and its number there: the follow feed tells routers' views so.
            self._remote[key] = self.inflight.open_session(op.router_id, replica.decode(), op.session)
            self._latest[op.router_id] = (replica, op.session)
            return
        session = self._remote.get(key)
        if session is None:
            if op.kind != CLOSE and not repaired:  # closing what is not here loses nothing (the router moved)
                self._unknown_session(replica, op)
            return
        if op.kind == RESERVE:
            self._reserve(session, op, age_s)
        elif op.kind == PREFILL_DONE:
            self.inflight.prefill_done(session, op.reservation_id)
        elif op.kind == RELEASE:
            self.inflight.release(session, op.reservation_id)
        elif op.kind == CLOSE:
            self._close(key)

    def _unknown_session(self, replica: bytes, op: RouterOp) -> None:
        if self._superseded(op.router_id, replica, op.session):
            self.counters.superseded += 1
            return
        if replica not in self._states_read:
            self.counters.before_state += 1
            return
        self.counters.unknown_session += 1
        self._problems.warning(
            "unknown_session",
            "replica %s: %s for router %s's session %d, which this replica "
            "does not mirror (ops lost while Redis was unreachable, or trimmed); that replica's "
            "next state repairs it",
            replica.decode(errors="replace"),
            _OP_NAMES[op.kind],
            op.router_id,
            op.session,
        )

    def _reserve(self, session: RouterSessionState, op: RouterOp, age_s: float) -> None:
        record = self._worker(op.worker_id)
        if record is None:
            return
        keys = unpack_keys(op.keys) if op.block_size == record.block_size else []
        ttl_ms, max_age_s = op.ttl_ms, None
        if age_s > 0:  # read late (a replay): what is left of its ages
            max_age_s = self.inflight.max_age_s - age_s
            if max_age_s <= 0:
                return
            ttl_ms = math.ceil((op.ttl_ms or self.inflight.default_ttl_s * 1000) - age_s * 1000)
            if ttl_ms <= 0:
                keys, ttl_ms = [], 0
        try:
            self.inflight.reserve(
                session,
                op.reservation_id,
                record.slot,
                keys,
                op.prefill_tokens,
                ttl_ms,
                op.prompt_tokens,
                record.block_size,
                max_age_s,
            )
        except DuplicateReservation:
            pass

    def _reconcile(self, replica: bytes, state: list[HeldSession], age_s: float) -> None:
        """Make this replica's mirror of `replica` what its state says."""
        self.counters.states_applied += 1
        self._states_read.add(replica)
        held_there = {(held.router_id, held.session) for held in state}
        for router_id, (at, session) in list(self._latest.items()):
            if at == replica and (router_id, session) not in held_there:
                del self._latest[router_id]  # that session ended there (or that replica restarted)
        listed = set()
        for held in state:
            key = (replica, held.router_id, held.session)
            session = self._remote.get(key)
            if session is None:
                if self._superseded(held.router_id, replica, held.session):
                    continue  # the router opened a session since: that one counts
                session = self._remote[key] = self.inflight.open_session(held.router_id, replica.decode(), held.session)
                self.counters.restored_sessions += 1
            listed.add(key)
            wanted = {r.reservation_id for r in held.reservations}
            for reservation_id in [rid for rid in session.reservations if rid not in wanted]:
                self.inflight.release(session, reservation_id)
                self.counters.dropped_by_state += 1
            for reservation in held.reservations:
                mirrored = session.reservations.get(reservation.reservation_id)
                if mirrored is None:
                    self._restore(session, reservation, age_s)
                elif mirrored.prefill_tokens and not reservation.prefill_tokens:
                    self.inflight.prefill_done(session, reservation.reservation_id)
        for key in [k for k in self._remote if k[0] == replica and k not in listed]:
            self._close(key)
            self.counters.dropped_by_state += 1

    def _superseded(self, router_id: str, replica: bytes, session: int) -> bool:
        """The router has opened a session since `replica`'s `session`."""
        latest = self._latest.get(router_id)
        return latest is not None and (latest[0] != replica or session < latest[1])

    def _restore(self, session: RouterSessionState, held: HeldReservation, age_s: float) -> None:
        max_age_s = held.max_age_ms / 1000 - age_s
        record = self._worker(held.worker_id) if max_age_s > 0 else None
        if record is None:
            return
        ttl_ms = math.ceil(held.claim_ttl_ms - age_s * 1000) if held.claim_ttl_ms else 0
        keys = unpack_keys(held.keys) if ttl_ms > 0 and held.block_size == record.block_size else []
        # The prefill is the origin's, already capped there: no prompt_tokens to cap it again.
        self.inflight.reserve(
            session,
            held.reservation_id,
            record.slot,
            keys,
            held.prefill_tokens,
            ttl_ms if keys else 0,
            0,
            record.block_size,
            max_age_s,
        )
        self.counters.restored_reservations += 1

    def _worker(self, worker_id: str) -> WorkerRecord | None:
        record = self.registry.get(worker_id)
        if record is None:
            self.counters.unknown_worker += 1
        return record

    def _close(self, key: tuple[bytes, str, int]) -> None:
        self.inflight.close_session(self._remote.pop(key))
        self._forget_if_gone(key[1])

    def _forget_if_gone(self, router_id: str) -> None:
        if router_id not in self.inflight.routers:
            self._latest.pop(router_id, None)

    def _drop_remote_router(self, router_id: str) -> None:
        for key in [k for k in self._remote if k[1] == router_id]:
            self.inflight.close_session(self._remote.pop(key))

    def _drop_replica(self, replica: bytes) -> None:
        keys = [k for k in self._remote if k[0] == replica]
        if keys:
            log.warning("replica %s silent for %.0fs: dropping its routers' reservations", replica.decode(), self.silent_after_s)
            self.counters.dropped_silent_replicas += 1
        for key in keys:
            self._close(key)
        for router_id in [r for r, (at, _) in self._latest.items() if at == replica]:
            del self._latest[router_id]
        self._states_read.discard(replica)  # what it sends before its next state: that state covers it


def _held(reservation: Reservation, record: WorkerRecord, now: float) -> HeldReservation:
    claimed = reservation.claimed_keys
    return HeldReservation(
        reservation.reservation_id,
        record.worker_id,
        record.block_size,
        reservation.prefill_tokens,
        max(1, math.ceil((reservation.expires_at - now) * 1000)),
        max(1, math.ceil((reservation.claims_expire_at - now) * 1000)) if claimed else 0,
        pack_keys(claimed) if claimed else b"",
    )
