"""LogApplier: the one place that changes registry, index and speculative claims for an agent's
messages, in both modes (the embedded control plane applies each accepted message at once; a
replica applies each log entry when its tail reaches it). Replicas that apply the same entries in
the same order hold the same state, which is what makes the index a function of the log."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.fleet.entries import (
    BlockOp,
    HeartbeatBody,
    Op,
    PackedOp,
    RegisterBody,
    WorkerSnapshot,
    pack_keys,
    unpack_keys,
)
from kvroute.fleet.inflight import InflightTracker
from kvroute.fleet.registry import WorkerRecord, WorkerRegistry
from kvroute.prefix_index import TIERS, Tier


@dataclass(slots=True)
class ApplyCounters:
    """What the applier applied, as plain counters (a process exports them at scrape time)."""

    snapshot_batches: int = 0
    delta_batches: int = 0
    snapshot_keys: int = 0
    stored_keys: int = 0
    removed_keys: int = 0
    cleared: int = 0
    expired_workers: int = 0  # dropped for missing heartbeats


class ApplyListener(Protocol):
    """Told of every change once it applied (the control plane's follow feed)."""

    def joined(self, record: WorkerRecord, body: RegisterBody, resume: bool) -> None: ...

    def blocks(self, record: WorkerRecord, seq: int, snapshot: bool, ops: Sequence[BlockOp]) -> None: ...

    def heartbeat(self, record: WorkerRecord, body: HeartbeatBody) -> None: ...

    def left(self, record: WorkerRecord, expired: bool) -> None: ...


class LogApplier:
    def __init__(self, registry: WorkerRegistry, inflight: InflightTracker) -> None:
        self.registry = registry
        self.inflight = inflight
        self.counters = ApplyCounters()
        self.listener: ApplyListener | None = None

    def register(self, worker_id: str, body: RegisterBody, resume: bool) -> WorkerRecord:
        """(Re)register; with `resume` the worker's sequence runs on (the same agent instance
        continues), else it starts over and the agent's next batch is a snapshot."""
        old = self.registry.get(worker_id)
        last_seq = old.last_seq if resume and old is not None else 0
        record = self.registry.register(
            worker_id,
            body.model,
            body.engine,
            body.block_size,
            body.endpoint,
            body.engine_version,
            body.lora_adapters,
            body.data_parallel_rank,
            body.peer,
            body.role,
        )
        record.agent_instance = body.instance
        record.last_seq = last_seq
        if self.listener is not None:
            self.listener.joined(record, body, resume)
        return record

    def apply_batch(self, record: WorkerRecord, seq: int, snapshot: bool, ops: Sequence[BlockOp]) -> int:
        """Apply one accepted batch (its sequence already checked); returns how many ops it had."""
        record.last_seq = seq
        index, slot, inflight, counters = self.registry.index, record.slot, self.inflight, self.counters
        count = 0
        if snapshot:
            # One STORED op per tier; a tier the snapshot does not name is empty now.
            by_tier: dict[Tier, list[int]] = {}
            for op in ops:
                count += 1
                if op.op == Op.STORED:
                    by_tier.setdefault(Tier(op.tier), []).extend(op.keys)
            index.replace_all(slot, by_tier)
            for keys in by_tier.values():
                inflight.confirm(slot, keys)
            counters.snapshot_batches += 1
            counters.snapshot_keys += sum(len(keys) for keys in by_tier.values())
        else:
            for op in ops:
                count += 1
                if op.op == Op.STORED:
                    index.store(slot, op.keys, Tier(op.tier))
                    inflight.confirm(slot, op.keys)
                    counters.stored_keys += len(op.keys)
                elif op.op == Op.REMOVED:
                    index.remove(slot, op.keys, Tier(op.tier))
                    counters.removed_keys += len(op.keys)
                elif op.op == Op.CLEARED:
                    index.clear(slot)
                    inflight.slot_cleared(slot)
                    counters.cleared += 1
            counters.delta_batches += 1
        if self.listener is not None:
            self.listener.blocks(record, seq, snapshot, ops)
        return count

    def heartbeat(self, record: WorkerRecord, body: HeartbeatBody) -> None:
        self.registry.touch(record)
        self.registry.update_load(
            record, body.running_requests, body.waiting_requests, body.kv_usage, body.observed_unix_ms, body.kv_capacity_tokens
        )
        if tuple(body.lora_adapters) != record.lora_adapters:
            self.registry.set_lora_adapters(record, body.lora_adapters)
        if self.listener is not None:
            self.listener.heartbeat(record, body)

    def drop(self, worker_id: str, expired: bool = False) -> bool:
        """Forget the worker and its blocks; `expired`: for missing heartbeats (counted)."""
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.registry.drop(worker_id)
        if expired:
            self.counters.expired_workers += 1
        if self.listener is not None:
            self.listener.left(record, expired)
        return True

    # ------------------------------------------------------------ snapshots

    def snapshot_of(self, record: WorkerRecord, epoch: int) -> WorkerSnapshot:
        index, load = self.registry.index, record.load
        tiers = []
        for tier in TIERS:
            keys = index.worker_keys(record.slot, tier)
            if keys:
                tiers.append(PackedOp(Op.STORED, tier, pack_keys(keys)))
        register = RegisterBody(
            record.model,
            record.engine,
            record.block_size,
            record.endpoint,
            record.engine_version,
            list(record.lora_adapters),
            record.data_parallel_rank,
            record.agent_instance,
            record.peer,
            record.role,
        )
        heartbeat = HeartbeatBody(
            load.running_requests,
            load.waiting_requests,
            load.kv_usage,
            load.observed_unix_ms,
            list(record.lora_adapters),
            load.kv_capacity_tokens,
        )
        return WorkerSnapshot(record.worker_id, epoch, record.last_seq, register, heartbeat, tiers)

    def restore(self, snap: WorkerSnapshot) -> WorkerRecord:
        """Make the worker exactly what the snapshot says (identity, sequence, load, keys)."""
        record = self.register(snap.worker_id, snap.register, resume=False)
        self.apply_batch(record, snap.last_seq, True, [BlockOp(t.op, t.tier, unpack_keys(t.keys)) for t in snap.tiers])
        self.heartbeat(record, snap.load)
        return record
