"""Worker registry: who is serving what, where, how loaded, and whether it is still alive.

Each registered worker gets a small integer slot (reused after the worker is dropped) that
the prefix index uses as its bit position. A worker that stops heartbeating for
`heartbeat_timeout_s` is dropped together with its blocks: a router must never send
traffic on the belief that a dead GPU holds a prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from control_plane.index import PrefixIndex


@dataclass(slots=True)
class WorkerLoadState:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    observed_unix_ms: int = 0


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    slot: int
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str = ""
    load: WorkerLoadState = field(default_factory=WorkerLoadState)
    last_seen: float = 0.0
    last_seq: int = 0
    # Incremented on every (re)registration so a superseded stream can tell it lost ownership.
    generation: int = 0


class WorkerRegistry:
    def __init__(self, index: PrefixIndex, heartbeat_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._generations = 0

    def register(self, worker_id: str, model: str, engine: str, block_size: int, endpoint: str,
                 engine_version: str = "") -> WorkerRecord:
        """(Re)register a worker. Its blocks are kept until the agent's snapshot replaces them,
        so a reconnecting agent does not blank the worker for routers in between."""
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not model:
            raise ValueError("model must not be empty")
        self._generations += 1
        record = self._workers.get(worker_id)
        if record is not None and (record.block_size != block_size or record.model != model):
            # Keys of another block size or model are meaningless now.
            self.index.clear(record.slot)
        if record is None:
            record = WorkerRecord(worker_id=worker_id, slot=self._take_slot(), model=model, engine=engine,
                                  block_size=block_size, endpoint=endpoint)
            self._workers[worker_id] = record
        record.model, record.engine, record.block_size = model, engine, block_size
        record.endpoint, record.engine_version = endpoint, engine_version
        record.last_seen = self._clock()
        record.last_seq = 0
        record.generation = self._generations
        return record

    def touch(self, record: WorkerRecord) -> None:
        record.last_seen = self._clock()

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def workers(self, model: str = "") -> Iterator[WorkerRecord]:
        for record in self._workers.values():
            if not model or record.model == model:
                yield record

    def __len__(self) -> int:
        return len(self._workers)

    def drop(self, worker_id: str) -> bool:
        record = self._workers.pop(worker_id, None)
        if record is None:
            return False
        self.index.clear(record.slot)
        self._free_slots.append(record.slot)
        return True

    def expire(self) -> list[str]:
        """Drop every worker not heard from within the heartbeat timeout."""
        deadline = self._clock() - self.heartbeat_timeout_s
        dead = [w.worker_id for w in self._workers.values() if w.last_seen < deadline]
        for worker_id in dead:
            self.drop(worker_id)
        return dead

    def _take_slot(self) -> int:
        if self._free_slots:
            self._free_slots.sort(reverse=True)  # lowest slot first keeps bitmasks small
            return self._free_slots.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot
