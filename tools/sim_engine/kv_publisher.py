"""Publishes cache events over ZMQ as vLLM's ZmqEventPublisher does (SGLang and TRT-LLM copy it).

The payload comes from a `MsgpackEventEncoder` (one dialect's schema, `wire_encoding.py`); this
module is the transport, as in docs/wire-formats.md#zmq-transport:
- PUB socket, bound or connected per the dialect (`publisher_binds`): vLLM binds wildcard
  (`*`, `::`) and ipc:// / inproc:// endpoints and connects to anything else; SGLang >= 0.5.13
  also binds 0.0.0.0, >= 0.5.22 honours an explicit `"bind"`; TRT-LLM always binds. SNDHWM = `hwm`.
- Three frames [topic, seq as 8-byte big-endian unsigned, msgpack batch]; seq starts at 0 and
  grows by 1 per non-empty batch (one batch per scheduler step that produced events); it is
  assigned by the sender, so a batch that fails to encode still uses up its number.
- `publish()` never blocks the scheduler: it stamps `ts` and queues the events
  (`max_queue_size`; beyond it the batch is dropped with a warning and a seq gap); a sender
  task encodes and sends.
- Optional ROUTER replay socket (always binds) keeping the last `buffer_steps` batches: a
  request `[identity, b"", start_seq8]` gets every buffered batch with seq >= start_seq, then
  an end marker, in the `new` framing (vLLM >= 0.26, SGLang >= 0.5.22, TRT-LLM:
  `[b"", topic, seq8, payload]`, end `[b"", b"", ff*8, b""]`) or the `old` one
  (`[b"", seq8, payload]`, end `[b"", ff*8, b""]`). Its SNDHWM is 2*(buffer_steps+1) on vLLM
  0.33 and ZMQ's default elsewhere (docs/wire-formats.md#publisher-configuration).
- Data parallelism (docs/wire-formats.md#data-parallel-endpoints): rank R publishes on the endpoint's
  port + R (inproc: `_dp<R>` suffix; ipc only on TRT-LLM) and writes R into every batch.

Fault hooks (`inject_faults`, for end-to-end tests): drop the next N batches on the PUB socket
(their seqs are used and they stay replayable: a real gap), or restart (seq back to 0, replay
buffer and queue emptied, as a restarted engine does; the sockets stay up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvroute.listeners import open_zmq
from kvroute.tools.sim_engine.dialects import DEFAULT_DIALECT, Dialect, get_dialect
from kvroute.tools.sim_engine.prefix_cache import CacheEvent
from kvroute.tools.sim_engine.wire_encoding import MsgpackEventEncoder

log = logging.getLogger("kvroute.sim_engine.kv_publisher")
END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True)

# KVEventsConfig keys and defaults (docs/wire-formats.md#publisher-configuration; SGLang: the same keys, publisher "null"
# by default).
CONFIG_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10000,
    "hwm": 100000,
    "max_queue_size": 100000,
    "topic": "",
}


def pub_binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def publisher_binds(endpoint: str, dialect: Dialect, config: dict[str, Any]) -> bool:
    if dialect.always_binds:
        return True
    if dialect.explicit_bind_key and config.get("bind") is not None:
        return bool(config["bind"])
    return pub_binds(endpoint) or (dialect.binds_any_address and "0.0.0.0" in endpoint)


def offset_endpoint_port(endpoint: str | None, rank: int, dialect: Dialect) -> str | None:
    """The endpoint data-parallel rank `rank` uses (docs/wire-formats.md#data-parallel-endpoints)."""
    if endpoint is None or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("ipc://"):
        if dialect.engine != "trtllm":
            raise ValueError("ipc:// endpoints cannot be used with a data-parallel rank above 0")
        return f"{endpoint}_dp{rank}"
    match = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if match is None:
        raise ValueError(f"cannot offset the port of {endpoint!r} for data-parallel rank {rank}")
    host, port = match.group(1), int(match.group(2))
    return endpoint if port == 0 else f"{host}:{port + rank}"  # an OS-chosen port is not offset


def parse_kv_events_config(config_json: str | dict | None, dialect: Dialect | None = None) -> dict[str, Any]:
    """The engine's --kv-events-config JSON, with the dialect's defaults filled in. Raises ValueError."""
    dialect = dialect or get_dialect(DEFAULT_DIALECT)
    if not config_json:
        raw: dict = {}
    elif isinstance(config_json, dict):
        raw = dict(config_json)
    else:
        try:
            raw = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
    known = set(CONFIG_DEFAULTS) | ({"bind", "format"} if dialect.explicit_bind_key else set())
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown --kv-events-config keys for {dialect.name}: {', '.join(unknown)}")
    config = {**CONFIG_DEFAULTS, "publisher": dialect.publisher_default, **raw}
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if not isinstance(config[key], int) or config[key] <= 0:
            raise ValueError(f"kv events config: {key} must be a positive integer")
    if config["publisher"] not in ("zmq", "null"):
        raise ValueError(f"kv events config: publisher must be 'zmq' or 'null', not {config['publisher']!r}")
    if config.get("bind") is not None and not isinstance(config["bind"], bool):
        raise ValueError("kv events config: bind must be true or false")
    if config.get("format", "default") != "default":
        raise ValueError("kv events config: only the default event format is simulated")
    return config


def events_enabled(config: dict[str, Any], dialect: Dialect) -> bool:
    """vLLM/TRT-LLM need enable_kv_cache_events and the zmq publisher; SGLang only the publisher."""
    return config["publisher"] == "zmq" and (config["enable_kv_cache_events"] or not dialect.needs_enable_flag)


@dataclass
class FaultState:
    drop_next_batches: int = 0  # batches still to withhold from the PUB socket
    dropped_by_fault: int = 0
    restarts: int = 0


class KvEventPublisher:
    def __init__(
        self, config: dict | str | None, block_size: int, dialect: Dialect | None = None, data_parallel_rank: int = 0
    ) -> None:
        dialect = dialect or get_dialect(DEFAULT_DIALECT)
        if dialect.transport != "zmq":
            raise ValueError(f"dialect {dialect.name} does not publish over ZMQ")
        if data_parallel_rank and not dialect.data_parallel:
            raise ValueError(f"{dialect.name} has no data parallelism: its data-parallel rank is always 0")
        config = parse_kv_events_config(config, dialect)
        self.dialect = dialect
        self.encoder = MsgpackEventEncoder(dialect, block_size, data_parallel_rank)
        self.endpoint: str = offset_endpoint_port(config["endpoint"], data_parallel_rank, dialect)
        self.replay_endpoint: str | None = offset_endpoint_port(config["replay_endpoint"], data_parallel_rank, dialect)
        self.topic = str(config["topic"]).encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer_steps"])
        self.hwm: int = config["hwm"]
        self.max_queue_size: int = config["max_queue_size"]
        self.block_size, self.replay_framing = block_size, dialect.replay_framing
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0  # next sequence number the sender assigns
        self.dropped_batches = 0
        self.faults = FaultState()
        self._pending: deque[tuple[float, list[CacheEvent], int]] = deque()  # (ts, events, seqs dropped before)
        self._dropped_since_last = 0
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.binds = publisher_binds(self.endpoint, dialect, config)
        open_zmq(self._pub, "--kv-events-config", self.endpoint, bind=self.binds)
        self._replay = None
        self._tasks: list[asyncio.Task] = []
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            if dialect.replay_sndhwm_scaled:
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config["buffer_steps"] + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            open_zmq(self._replay, "--kv-events-config", self.replay_endpoint, bind=True)

    @classmethod
    def from_cli(
        cls, config_json: str | None, block_size: int, dialect: Dialect | None = None, data_parallel_rank: int = 0
    ) -> KvEventPublisher | None:
        """None when the config does not enable a ZMQ publisher (the engine's null publisher)."""
        dialect = dialect or get_dialect(DEFAULT_DIALECT)
        config = parse_kv_events_config(config_json, dialect)
        if not events_enabled(config, dialect):
            return None
        return cls(config, block_size, dialect, data_parallel_rank)

    # ------------------------------------------------------------------ endpoints

    @property
    def last_endpoint(self) -> str:
        """The PUB socket's actual endpoint (resolves `tcp://*:0`-style wildcards when bound)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint

    @property
    def replay_last_endpoint(self) -> str | None:
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None

    # ------------------------------------------------------------------ publishing

    def start(self) -> None:
        """Start the sender (and replay server) on the running event loop."""
        if self._tasks:
            return
        self._wakeup, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        if self._pending:
            self._wakeup.set()
            self._idle.clear()
        self._tasks.append(asyncio.create_task(self._sender(), name="kv-event-sender"))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="kv-event-replay"))

    def encode(self, events: list[CacheEvent], ts: float | None = None) -> bytes:
        return self.encoder.encode(events, ts)

    def inject_faults(self, drop_next_batches: int = 0, restart: bool = False) -> dict[str, int]:
        """Fault hooks for end-to-end tests; returns the publisher's state afterwards."""
        if restart:  # like a restarted engine: numbering from 0, nothing to replay, nothing queued
            self.seq = 0
            self.buffer.clear()
            self._pending.clear()
            self._dropped_since_last = 0
            self.faults.restarts += 1
            if self._idle is not None:
                self._idle.set()
        self.faults.drop_next_batches += drop_next_batches
        return {
            "next_seq": self.seq,
            "drop_next_batches": self.faults.drop_next_batches,
            "dropped_by_fault": self.faults.dropped_by_fault,
            "restarts": self.faults.restarts,
        }

    def publish(self, events: list[CacheEvent]) -> None:
        """Queue one batch (the events of one scheduler step). Never blocks; empty batches are skipped."""
        if not events:
            return  # vLLM only publishes non-empty batches
        if len(self._pending) >= self.max_queue_size:
            self.dropped_batches += 1
            self._dropped_since_last += 1  # the next batch that goes out skips these numbers: a visible gap
            log.warning("KV event queue full (%d batches): batch dropped", self.max_queue_size)
            return
        self._pending.append((time.time(), list(events), self._dropped_since_last))
        self._dropped_since_last = 0
        if self._wakeup is not None:
            self._idle.clear()
            self._wakeup.set()

    async def flush(self) -> None:
        """Wait until every queued batch has been handed to ZMQ."""
        if self._idle is not None:
            await self._idle.wait()

    async def _sender(self) -> None:
        assert self._wakeup is not None and self._idle is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                ts, events, skipped = self._pending.popleft()
                seq = self.seq + skipped
                self.seq = seq + 1
                try:
                    payload = self.encode(events, ts)
                except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
                    log.error("KV event batch %d could not be encoded (%s): dropped", seq, exc)
                    continue
                self.buffer.append((seq, payload))
                if self.faults.drop_next_batches:  # withheld from subscribers, still replayable
                    self.faults.drop_next_batches -= 1
                    self.faults.dropped_by_fault += 1
                    continue
                try:
                    await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("KV event batch %d dropped: PUB pipe over its high-water mark", seq)
                except zmq.ZMQError as exc:
                    log.error("KV event batch %d not sent: %s", seq, exc)
            if not self._pending:
                self._idle.set()

    # ------------------------------------------------------------------ replay

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("Invalid replay request: %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self.buffer):
                    if seq >= start_seq:
                        await self._replay.send_multipart(self._reply(identity, seq.to_bytes(8, "big"), payload))
                await self._replay.send_multipart(self._reply(identity, END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("replay to a client failed: %s", exc)

    def _reply(self, identity: bytes, seq8: bytes, payload: bytes) -> list[bytes]:
        if self.replay_framing == "new":
            return [identity, b"", self.topic if seq8 != END_SEQ else b"", seq8, payload]
        return [identity, b"", seq8, payload]

    # ------------------------------------------------------------------ shutdown

    async def aclose(self, flush_timeout_s: float = 1.0) -> None:
        """Send what is queued (bounded wait), then close the sockets."""
        if self._tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), flush_timeout_s)
        self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self._ctx.destroy(linger=0)
