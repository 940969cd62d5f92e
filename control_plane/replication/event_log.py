"""EventLog: where an agent's accepted messages go. `ControlPlaneService.Connect` is one handler for
both modes; it hands every message to its log:

- `LocalEventLog` (no --redis): the message is applied at once (`LogApplier`), with the checks the
  control plane always made: one live stream per worker id, sequence +1, a superseded stream ends.
- `RedisEventLog` (replication/redis_log.py): the message is appended to the worker's shard stream
  by a script that fences stale epochs and checks the sequence; every replica applies it from there.

A log refuses by raising `LogRefusal` (a gRPC status, a metric reason and a message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import grpc

from kvroute.fleet.apply import LogApplier
from kvroute.fleet.entries import BlockOp, HeartbeatBody, RegisterBody
from kvroute.fleet.registry import WorkerRecord
from kvroute.roles import parse_role
from kvroute.v1 import kvroute_pb2 as pb


class LogRefusal(Exception):
    """The log will not take this message; the agent stream ends with `code`."""

    def __init__(self, code: grpc.StatusCode, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.code, self.reason, self.detail = code, reason, detail


@dataclass(slots=True)
class AgentSession:
    """One registered agent stream."""

    worker_id: str
    epoch: int
    instance: str
    resume: bool
    last_seq: int  # the log's last seq from this agent at registration (0 without resume)
    peer: str
    record: WorkerRecord | None = None  # LocalEventLog: the record it registered
    owner: str = ""  # RedisEventLog: the owner key's value this stream holds


def register_body(req: pb.RegisterWorker, peer: str) -> RegisterBody:
    return RegisterBody(
        req.model,
        req.engine,
        req.block_size,
        req.endpoint,
        req.engine_version,
        list(req.lora_adapters),
        req.data_parallel_rank if req.HasField("data_parallel_rank") else None,
        req.agent_instance,
        peer,
        parse_role(req.role),
    )


def check_register(req: pb.RegisterWorker) -> None:
    """What the registry would refuse, checked before anything is written anywhere."""
    if not req.worker_id:
        raise LogRefusal(grpc.StatusCode.INVALID_ARGUMENT, "bad_register", "worker_id must not be empty")
    if req.block_size <= 0:
        raise LogRefusal(grpc.StatusCode.INVALID_ARGUMENT, "bad_register", f"block_size must be positive, got {req.block_size}")
    if not req.model:
        raise LogRefusal(grpc.StatusCode.INVALID_ARGUMENT, "bad_register", "model must not be empty")
    try:
        parse_role(req.role)
    except ValueError as exc:
        raise LogRefusal(grpc.StatusCode.INVALID_ARGUMENT, "bad_register", str(exc)) from None
    if (why := endpoint_problem(req.endpoint)) is not None:
        raise LogRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            "bad_register",
            f"endpoint must be the engine's http(s) base URL, got {req.endpoint!r}: {why}",
        )


def endpoint_problem(endpoint: str) -> str | None:
    """Why routers could not send requests to `endpoint`, or None (they proxy to it as its base URL)."""
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError when it is not a number in 0..65535
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "no host"
    if any(c.isspace() or not c.isprintable() for c in endpoint):
        return "it holds white space or control characters"
    return None


def in_use_detail(worker_id: str, holder_peer: str, peer: str) -> str:
    return (
        f"worker id {worker_id!r} is already connected from {holder_peer} (this connection: {peer}); "
        "each agent needs its own --worker-id"
    )


class EventLog(Protocol):
    heartbeat_timeout_s: float

    async def register(self, req: pb.RegisterWorker, peer: str) -> AgentSession: ...

    async def append_batch(
        self, session: AgentSession, seq: int, snapshot: bool, ops: list[BlockOp], source: pb.EventBatch | None = None
    ) -> None:
        """`ops` is the batch; `source` the agent's message it came from, when there is one."""

    async def heartbeat(self, session: AgentSession, body: HeartbeatBody) -> None: ...

    async def release(self, session: AgentSession) -> None:
        """The agent's stream ended (closed, failed or cancelled)."""

    async def expire_silent(self) -> list[str]:
        """Deal with workers not heard from within the heartbeat timeout; returns those dropped now."""


class LocalEventLog:
    """The embedded control plane: every message applies at once."""

    def __init__(self, applier: LogApplier) -> None:
        self.applier = applier
        self.registry = applier.registry

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.registry.heartbeat_timeout_s

    async def register(self, req: pb.RegisterWorker, peer: str) -> AgentSession:
        check_register(req)
        holder = self.registry.holder(req.worker_id)
        same_agent = holder is not None and req.agent_instance and holder.agent_instance == req.agent_instance
        if holder is not None and not same_agent:  # refused before anything changes
            raise LogRefusal(grpc.StatusCode.ALREADY_EXISTS, "worker_id_in_use", in_use_detail(req.worker_id, holder.peer, peer))
        old = self.registry.get(req.worker_id)
        resume = (
            old is not None
            and bool(req.agent_instance)
            and old.agent_instance == req.agent_instance
            and old.model == req.model
            and old.block_size == req.block_size
        )
        record = self.applier.register(req.worker_id, register_body(req, peer), resume)
        return AgentSession(record.worker_id, record.generation, req.agent_instance, resume, record.last_seq, peer, record)

    def _current(self, session: AgentSession) -> WorkerRecord:
        record = session.record
        assert record is not None
        if record.generation != session.epoch or self.registry.get(record.worker_id) is not record:
            raise LogRefusal(
                grpc.StatusCode.ABORTED, "superseded", f"worker {record.worker_id!r} was re-registered or expired; reconnect"
            )
        self.registry.touch(record)
        return record

    async def append_batch(
        self, session: AgentSession, seq: int, snapshot: bool, ops: list[BlockOp], source: pb.EventBatch | None = None
    ) -> None:
        record = self._current(session)
        if seq != record.last_seq + 1:
            raise LogRefusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "sequence",
                f"worker {record.worker_id!r}: expected batch seq {record.last_seq + 1}, got {seq}; "
                "reconnect and send a snapshot",
            )
        self.applier.apply_batch(record, seq, snapshot, ops)

    async def heartbeat(self, session: AgentSession, body: HeartbeatBody) -> None:
        self.applier.heartbeat(self._current(session), body)

    async def release(self, session: AgentSession) -> None:
        if session.record is not None:
            self.registry.release(session.record, session.epoch)

    async def expire_silent(self) -> list[str]:
        dropped = self.registry.silent()
        for worker_id in dropped:
            self.applier.drop(worker_id, expired=True)
        return dropped
