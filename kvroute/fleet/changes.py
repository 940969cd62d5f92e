"""The follow stream's changes (`kvroute.v1.FleetChange`): what the control plane applied, and the one
code that applies them to a follower's `FleetState`.

Control plane side:

    encoder = ChangeEncoder(state, origin=replica_id, emit=feed.append)   # hears every change...
    state.applier.listener = state.inflight.listener = encoder           # ...once it applied
    snapshot_changes(state, origin, models)                             # the state, rebuilt from nothing

Follower side:

    apply_change(state, change)   # raises MalformedChange (nothing applied) for a change it cannot apply

A change carries the result of what the control plane applied, not the request that led to it: a
reservation's prefill is the one it charged (already trimmed by what the worker held), so the
follower's tracker does no trimming of its own. What happens on its own on both sides (reservations
and claims expiring by age, claims confirmed by a worker's stored blocks, a dropped worker's
reservations going with it) is derived by the follower from the changes, never sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from kvroute.fleet.entries import BlockOp, HeartbeatBody, Op, RegisterBody, key_array, pack_keys
from kvroute.fleet.inflight import DuplicateReservation, Reservation, RouterSessionState
from kvroute.fleet.registry import WorkerRecord
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import TIERS, tier_of_wire
from kvroute.v1 import kvroute_pb2 as pb

# Keys per PackedBlockOp in a snapshot: a worker with a million cached blocks is 8 MB of keys, sent
# as 128 changes of 64 kB instead of one message near gRPC's limits; a follower applies one in a few
# ms, so a router building a new snapshot lets its decisions run between them (data_plane/cp_link/fleet_view.py).
SNAPSHOT_CHUNK_KEYS = 8_192

_OP_KIND = {Op.STORED: pb.BLOCKS_STORED, Op.REMOVED: pb.BLOCKS_REMOVED, Op.CLEARED: pb.BLOCKS_CLEARED}
_KIND_OP = {v: k for k, v in _OP_KIND.items()}

# Emitted with the model the change concerns ("" = every follower wants it: router sessions' own events).
Emit = Callable[[pb.FleetChange, str], None]


class MalformedChange(ValueError):
    """A change a follower cannot apply as sent (the view would diverge): resynchronise."""


def now_us() -> int:
    return time.time_ns() // 1000


# ---------------------------------------------------------------- the control plane's side


class ChangeEncoder:
    """The `ApplyListener` and `InflightListener` of the control plane's state: each change it hears
    becomes one FleetChange, handed to `emit` with the model it concerns."""

    def __init__(self, state: FleetState, origin: str, emit: Emit) -> None:
        self.registry = state.registry
        self.origin = origin  # the name of this control plane's own router sessions
        self.emit = emit

    # ApplyListener

    def joined(self, record: WorkerRecord, body: RegisterBody, resume: bool) -> None:
        change = pb.FleetChange(applied_unix_us=now_us())
        _fill_joined(change.joined, record, resume)
        self.emit(change, record.model)

    def blocks(self, record: WorkerRecord, seq: int, snapshot: bool, ops: Sequence[BlockOp]) -> None:
        change = pb.FleetChange(applied_unix_us=now_us())
        blocks = change.blocks
        blocks.worker_id, blocks.seq, blocks.snapshot = record.worker_id, seq, snapshot
        add = blocks.ops.add
        for op in ops:
            add(kind=_OP_KIND[op.op], tier=op.tier, keys=pack_keys(op.keys) if op.keys else b"")
        self.emit(change, record.model)

    def heartbeat(self, record: WorkerRecord, body: HeartbeatBody) -> None:
        change = pb.FleetChange(applied_unix_us=now_us())
        _fill_heartbeat(change.heartbeat, record)
        self.emit(change, record.model)

    def left(self, record: WorkerRecord, expired: bool) -> None:
        change = pb.FleetChange(applied_unix_us=now_us())
        change.left.worker_id, change.left.expired = record.worker_id, expired
        self.emit(change, record.model)

    # InflightListener

    def session_opened(self, session: RouterSessionState) -> None:
        self.emit(self._router(pb.ROUTER_SESSION_OPENED, session), "")

    def reserved(self, reservation: Reservation, worker_keys: Sequence[int], block_size: int, ttl_ms: int) -> None:
        record = self.registry.at_slot(reservation.slot)
        if record is None:  # reserve() is only called for a known worker's slot
            return
        change = self._router(pb.ROUTER_RESERVED, reservation.session, reservation.reservation_id)
        router = change.router
        router.worker_id, router.block_size = record.worker_id, block_size if worker_keys else 0
        router.prefill_tokens, router.ttl_ms = reservation.prefill_tokens, ttl_ms
        if worker_keys:
            router.keys = pack_keys(worker_keys)
        self.emit(change, record.model)

    def prefill_done(self, reservation: Reservation) -> None:
        self.emit(self._router(pb.ROUTER_PREFILL_DONE, reservation.session, reservation.reservation_id), "")

    def released(self, session: RouterSessionState, reservation_id: int) -> None:
        self.emit(self._router(pb.ROUTER_RELEASED, session, reservation_id), "")

    def session_closed(self, session: RouterSessionState) -> None:
        self.emit(self._router(pb.ROUTER_SESSION_CLOSED, session), "")

    def _router(self, kind: int, session: RouterSessionState, reservation_id: int = 0) -> pb.FleetChange:
        change = pb.FleetChange(applied_unix_us=now_us())
        router = change.router
        router.kind, router.origin, router.session = kind, session.origin or self.origin, session.number
        router.router_id, router.reservation_id = session.router.router_id, reservation_id
        return change


def _fill_joined(joined: pb.WorkerJoined, record: WorkerRecord, resume: bool) -> None:
    joined.worker_id, joined.model, joined.engine = record.worker_id, record.model, record.engine
    joined.block_size, joined.endpoint, joined.engine_version = record.block_size, record.endpoint, record.engine_version
    joined.lora_adapters.extend(record.lora_adapters)
    if record.data_parallel_rank is not None:
        joined.data_parallel_rank = record.data_parallel_rank
    joined.agent_instance, joined.resume, joined.role = record.agent_instance, resume, record.role


def _fill_heartbeat(heartbeat: pb.WorkerHeartbeat, record: WorkerRecord) -> None:
    load = record.load
    heartbeat.worker_id = record.worker_id
    heartbeat.load.running_requests, heartbeat.load.waiting_requests = load.running_requests, load.waiting_requests
    heartbeat.load.kv_usage, heartbeat.load.observed_unix_ms = load.kv_usage, load.observed_unix_ms
    heartbeat.load.kv_capacity_tokens = load.kv_capacity_tokens
    heartbeat.lora_adapters.extend(record.lora_adapters)


def snapshot_changes(state: FleetState, origin: str, models: Collection[str] = ()) -> list[pb.FleetChange]:
    """The changes that make an empty state equal `state` (the workers of `models`, empty = all): per
    worker its registration, its blocks (one snapshot batch, then stores in chunks) and its load;
    then every open router session and its live reservations (claims as they stand, prefill as still
    pending, claim TTLs as what is left of them)."""
    stamp = now_us()
    out = []
    index = state.index
    for record in state.registry.workers():
        if models and record.model not in models:
            continue
        change = pb.FleetChange(applied_unix_us=stamp)
        _fill_joined(change.joined, record, resume=False)
        out.append(change)
        first = True
        for tier in TIERS:
            keys = list(index.worker_keys(record.slot, tier))
            for start in range(0, len(keys), SNAPSHOT_CHUNK_KEYS) if keys else ():
                out.append(_blocks_change(record, stamp, first, tier, keys[start : start + SNAPSHOT_CHUNK_KEYS]))
                first = False
        if first:  # holds nothing: still a snapshot, so that the follower's copy is empty too
            out.append(_blocks_change(record, stamp, True, TIERS[0], []))
        change = pb.FleetChange(applied_unix_us=stamp)
        _fill_heartbeat(change.heartbeat, record)
        out.append(change)
    encoder = ChangeEncoder(state, origin, lambda change, model: None)
    now = state.inflight.clock()
    for session in state.inflight.sessions.values():
        out.append(encoder._router(pb.ROUTER_SESSION_OPENED, session))
        for reservation in session.reservations.values():
            record = state.registry.at_slot(reservation.slot)
            if record is None or (models and record.model not in models):
                continue
            change = encoder._router(pb.ROUTER_RESERVED, session, reservation.reservation_id)
            router = change.router
            router.worker_id, router.prefill_tokens = record.worker_id, reservation.prefill_tokens
            if reservation.claimed_keys:
                router.block_size, router.keys = record.block_size, pack_keys(reservation.claimed_keys)
                router.ttl_ms = max(1, int((reservation.claims_expire_at - now) * 1000))
            out.append(change)
    for change in out:
        change.applied_unix_us = stamp
    return out


def _blocks_change(record: WorkerRecord, stamp: int, snapshot: bool, tier: int, keys: list[int]) -> pb.FleetChange:
    change = pb.FleetChange(applied_unix_us=stamp)
    blocks = change.blocks
    blocks.worker_id, blocks.seq, blocks.snapshot = record.worker_id, record.last_seq, snapshot
    blocks.ops.add(kind=pb.BLOCKS_STORED, tier=tier, keys=pack_keys(keys))
    return change


# ---------------------------------------------------------------- the follower's side


def apply_change(state: FleetState, change: pb.FleetChange) -> None:
    """Apply one change as the control plane did. MalformedChange when it cannot be applied as sent
    (checked before anything changes)."""
    kind = change.WhichOneof("change")
    if kind == "blocks":
        _apply_blocks(state, change.blocks)
    elif kind == "heartbeat":
        heartbeat = change.heartbeat
        record = _known(state, heartbeat.worker_id)
        load = heartbeat.load
        if not 0.0 <= load.kv_usage <= 1.0:
            raise MalformedChange(f"worker {heartbeat.worker_id!r}: kv_usage {load.kv_usage} is not in 0..1")
        state.applier.heartbeat(
            record,
            HeartbeatBody(
                load.running_requests,
                load.waiting_requests,
                load.kv_usage,
                load.observed_unix_ms,
                list(heartbeat.lora_adapters),
                load.kv_capacity_tokens,
            ),
        )
    elif kind == "router":
        _apply_router(state, change.router)
    elif kind == "joined":
        joined = change.joined
        if not joined.worker_id or not joined.model or joined.block_size <= 0:
            raise MalformedChange(
                f"a joined worker needs an id, a model and a block size: {joined.worker_id!r}, "
                f"{joined.model!r}, {joined.block_size}"
            )
        body = RegisterBody(
            joined.model,
            joined.engine,
            joined.block_size,
            joined.endpoint,
            joined.engine_version,
            list(joined.lora_adapters),
            joined.data_parallel_rank if joined.HasField("data_parallel_rank") else None,
            joined.agent_instance,
            "",
            joined.role,
        )
        state.applier.register(joined.worker_id, body, joined.resume)
    elif kind == "left":
        state.applier.drop(change.left.worker_id, change.left.expired)
    else:
        raise MalformedChange("a FleetChange with no change set")


def _known(state: FleetState, worker_id: str) -> WorkerRecord:
    record = state.registry.get(worker_id)
    if record is None:
        raise MalformedChange(f"a change for worker {worker_id!r}, which never joined")
    return record


def _keys(data: bytes) -> Sequence[int]:
    if len(data) % 8:
        raise MalformedChange(f"packed block keys of {len(data)} bytes: not a whole number of 8-byte keys")
    return key_array(data)


def _apply_blocks(state: FleetState, blocks: pb.WorkerBlocks) -> None:
    record = _known(state, blocks.worker_id)
    ops = []
    for op in blocks.ops:
        kind = _KIND_OP.get(op.kind)
        tier = tier_of_wire(op.tier)
        if kind is None or tier is None:
            raise MalformedChange(f"worker {blocks.worker_id!r}: block op kind {op.kind} / tier {op.tier} unknown")
        ops.append(BlockOp(kind, tier, _keys(op.keys)))
    state.applier.apply_batch(record, blocks.seq, blocks.snapshot, ops)


def _apply_router(state: FleetState, router: pb.RouterChange) -> None:
    sessions, kind = state.sessions, router.kind
    if kind == pb.ROUTER_SESSION_OPENED:
        if not router.router_id:
            raise MalformedChange("a router session opened without a router id")
        sessions.open(router.origin, router.session, router.router_id)
        return
    if kind == pb.ROUTER_SESSION_CLOSED:
        sessions.close(router.origin, router.session)
        return
    session = sessions.get(router.origin, router.session)
    if session is None:
        raise MalformedChange(f"router change {kind} for session {router.origin}/{router.session}, which is not open")
    if kind == pb.ROUTER_RESERVED:
        record = _known(state, router.worker_id)
        keys = _keys(router.keys) if router.keys and router.block_size == record.block_size else []
        try:
            state.inflight.reserve(session, router.reservation_id, record.slot, keys, router.prefill_tokens, router.ttl_ms)
        except DuplicateReservation as exc:
            raise MalformedChange(str(exc)) from None
    elif kind == pb.ROUTER_PREFILL_DONE:
        state.inflight.prefill_done(session, router.reservation_id)
    elif kind == pb.ROUTER_RELEASED:
        state.inflight.release(session, router.reservation_id)
    else:
        raise MalformedChange(f"router change kind {kind} unknown")
