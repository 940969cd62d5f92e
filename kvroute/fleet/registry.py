"""Worker registry: who is serving what, where, how loaded, and whether it is still alive.

Each registered worker gets a small integer slot (reused after the worker is dropped) that
the prefix index uses as its bit position. A worker that stops heartbeating for
`heartbeat_timeout_s` is dropped together with its blocks: a router must never send
traffic on the belief that a dead GPU holds a prefix. A `SlotWatcher` (the in-flight tracker)
hears when a slot's blocks become meaningless or the slot is freed, so nothing keyed by slot
outlives the worker it meant.

One live agent stream per worker id: `holder()` is the record whose stream is still open and was
heard from within the heartbeat timeout; the service refuses a second stream for that id (two
agents started with the same --worker-id would otherwise replace each other's blocks every
second). A stream that ended (`release()`) or went silent past the timeout no longer holds it, so
the same agent reconnecting, or its replacement, registers as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.prefix_index import PrefixIndex


@dataclass(slots=True)
class WorkerLoadState:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    observed_unix_ms: int = 0
    kv_capacity_tokens: int = 0  # 0 = the engine did not say


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    slot: int
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str = ""
    lora_adapters: tuple[str, ...] = ()  # adapters the engine serves now (requests name them as `model`)
    data_parallel_rank: int | None = None  # None: not one rank of a data-parallel engine
    role: str = ""  # "prefill", "decode", or "" for both (RegisterWorker.role)
    load: WorkerLoadState = field(default_factory=WorkerLoadState)
    last_seen: float = 0.0
    last_seq: int = 0
    # Incremented on every (re)registration so a superseded stream can tell it lost ownership.
    generation: int = 0
    # gRPC peer of the agent stream that registered it last, "" once that stream ended.
    peer: str = ""
    # The registering agent's random per-process id (RegisterWorker.agent_instance): the same agent
    # coming back may resume its sequence; "" = unknown.
    agent_instance: str = ""
    # The service's pre-built answer for this worker (a WorkerMatch without per-query fields),
    # cached because building it per query dominated Query time; None after any change to it.
    match_template: object | None = None


class SlotWatcher(Protocol):
    def slot_cleared(self, slot: int) -> None:
        """The worker in `slot` no longer holds anything (its keys changed meaning)."""

    def slot_dropped(self, slot: int) -> None:
        """The worker in `slot` is gone; the slot may be handed to another worker."""


class WorkerRegistry:
    def __init__(
        self,
        index: PrefixIndex,
        heartbeat_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        watcher: SlotWatcher | None = None,
    ) -> None:
        self.index = index
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.watcher = watcher
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._by_slot: dict[int, WorkerRecord] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._generations = 0
        # workers() per (model, adapter), answered on every query; forgotten whenever membership,
        # model or adapters change (load changes mutate the records in place).
        self._rosters: dict[tuple[str, str], tuple[WorkerRecord, ...]] = {}
        self.roster_version = 0  # +1 whenever a roster may have changed (what callers cache per roster keys on)

    def register(
        self,
        worker_id: str,
        model: str,
        engine: str,
        block_size: int,
        endpoint: str,
        engine_version: str = "",
        lora_adapters: Iterable[str] = (),
        data_parallel_rank: int | None = None,
        peer: str = "",
        role: str = "",
    ) -> WorkerRecord:
        """(Re)register a worker. Its blocks are kept until the agent's snapshot replaces them,
        so a reconnecting agent does not blank the worker for routers in between."""
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not model:
            raise ValueError("model must not be empty")
        self._generations += 1
        self._forget_rosters()
        record = self._workers.get(worker_id)
        if record is not None and (record.block_size != block_size or record.model != model):
            # Keys of another block size or model are meaningless now.
            self.index.clear(record.slot)
            if self.watcher:
                self.watcher.slot_cleared(record.slot)
        if record is None:
            record = WorkerRecord(
                worker_id=worker_id, slot=self._take_slot(), model=model, engine=engine, block_size=block_size, endpoint=endpoint
            )
            self._workers[worker_id] = record
            self._by_slot[record.slot] = record
        record.model, record.engine, record.block_size = model, engine, block_size
        record.endpoint, record.engine_version = endpoint, engine_version
        record.lora_adapters = tuple(lora_adapters)
        record.data_parallel_rank = data_parallel_rank
        record.role = role
        record.last_seen = self._clock()
        record.last_seq = 0
        record.generation = self._generations
        record.peer = peer
        record.match_template = None
        return record

    def holder(self, worker_id: str) -> WorkerRecord | None:
        """The worker's record while the stream that registered it is open and heard from within the
        heartbeat timeout (another stream must not take the id over), else None."""
        record = self._workers.get(worker_id)
        if record is None or not record.peer or self._clock() - record.last_seen > self.heartbeat_timeout_s:
            return None
        return record

    def release(self, record: WorkerRecord, generation: int) -> None:
        """The stream that registered `record` as `generation` ended (a later registration keeps the id)."""
        if record.generation == generation:
            record.peer = ""

    def touch(self, record: WorkerRecord) -> None:
        record.last_seen = self._clock()

    def update_load(
        self,
        record: WorkerRecord,
        running_requests: int,
        waiting_requests: int,
        kv_usage: float,
        observed_unix_ms: int,
        kv_capacity_tokens: int,
    ) -> None:
        load = record.load
        load.running_requests, load.waiting_requests = running_requests, waiting_requests
        load.kv_usage, load.observed_unix_ms, load.kv_capacity_tokens = kv_usage, observed_unix_ms, kv_capacity_tokens
        record.match_template = None

    def set_lora_adapters(self, record: WorkerRecord, adapters: Iterable[str]) -> None:
        record.lora_adapters = tuple(adapters)
        self._forget_rosters()
        record.match_template = None

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def at_slot(self, slot: int) -> WorkerRecord | None:
        return self._by_slot.get(slot)

    def workers(self, model: str = "", lora_name: str = "") -> tuple[WorkerRecord, ...]:
        """Live workers of `model` ("" = every model) serving adapter `lora_name` ("" = the base model)."""
        roster = self._rosters.get((model, lora_name))
        if roster is None:
            roster = self._rosters[(model, lora_name)] = tuple(
                record
                for record in self._workers.values()
                if (not model or record.model == model) and (not lora_name or lora_name in record.lora_adapters)
            )
        return roster

    def __len__(self) -> int:
        return len(self._workers)

    def drop(self, worker_id: str) -> bool:
        record = self._workers.pop(worker_id, None)
        if record is None:
            return False
        del self._by_slot[record.slot]
        self._forget_rosters()
        self.index.clear(record.slot)
        if self.watcher:
            self.watcher.slot_dropped(record.slot)
        self._free_slots.append(record.slot)
        return True

    def silent(self) -> list[str]:
        """Workers not heard from within the heartbeat timeout (the caller drops them through its applier)."""
        deadline = self._clock() - self.heartbeat_timeout_s
        return [w.worker_id for w in self._workers.values() if w.last_seen < deadline]

    def _forget_rosters(self) -> None:
        self._rosters.clear()
        self.roster_version += 1

    def _take_slot(self) -> int:
        if self._free_slots:
            self._free_slots.sort(reverse=True)  # lowest slot first keeps bitmasks small
            return self._free_slots.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot
