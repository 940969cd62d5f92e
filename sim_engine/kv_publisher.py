"""Publishes cache events in vLLM's real KV-event wire format over ZMQ.

Our own msgspec replicas of vLLM's published schemas (field names, order and struct options
from the wire spec §2; no vLLM code):
- `map` era = vLLM 0.24-0.33: events are tagged maps (`"type"` = class name) with
  omit_defaults, so `extra_keys` / `kv_cache_spec_sliding_window` (None) are left out while
  `lora_id` / `medium` / `lora_name` (no default) are always present;
- `array` era = vLLM 0.22-0.23: tagged arrays, 12-element BlockStored, 4-element BlockRemoved.
The batch is always vLLM's positional `[ts, events, data_parallel_rank]`.

Transport (spec §1) as vLLM's ZmqEventPublisher:
- PUB socket, bound if the endpoint contains `*` or `::` or is ipc:// / inproc://, else
  connected (the consumer binds); SNDHWM = `hwm`.
- Three frames [topic, seq as 8-byte big-endian unsigned, msgpack batch]; seq starts at 0 and
  grows by 1 per non-empty batch (one batch per scheduler step that produced events); it is
  assigned by the sender, so a batch that fails to encode still uses up its number.
- `publish()` never blocks the scheduler: it stamps `ts` and queues the events
  (`max_queue_size`; beyond it the batch is dropped with a warning and a seq gap); a sender
  task encodes and sends.
- Optional ROUTER replay socket (always binds) keeping the last `buffer_steps` batches: a
  request `[identity, b"", start_seq8]` gets every buffered batch with seq >= start_seq, then
  an end marker, in the `new` framing (vLLM >= 0.26: `[b"", topic, seq8, payload]`, end
  `[b"", b"", ff*8, b""]`) or the `old` one (`[b"", seq8, payload]`, end `[b"", ff*8, b""]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sim_engine.prefix_cache import CacheEvent, ClearedEvent, RemovedEvent, StoredEvent

log = logging.getLogger("kvroute.sim_engine.kv_publisher")
END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True)

# vLLM's KVEventsConfig keys and defaults (spec §2.10).
CONFIG_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": None,
    "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "",
}

# Field names, order and defaults of vLLM's BlockStored / BlockRemoved (wire spec §2.3, §2.4).
_STORED_FIELDS = [
    ("block_hashes", list[int]), ("parent_block_hash", int | None), ("token_ids", list[int]), ("block_size", int),
    ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
    ("extra_keys", list | None, None), ("group_idx", int | None, None), ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
]
_REMOVED_FIELDS = [("block_hashes", list[int]), ("medium", str | None), ("group_idx", int | None, None)]


def _era_structs(era: str) -> tuple[type, type, type]:
    """The three event structs of one era: tagged maps (vLLM 0.24-0.33) or tagged arrays (0.22-0.23)."""
    options = {"tag_field": "type", "omit_defaults": True} if era == "map" else {"array_like": True}
    return (msgspec.defstruct("BlockStored", _STORED_FIELDS, tag="BlockStored", **options),
            msgspec.defstruct("BlockRemoved", _REMOVED_FIELDS, tag="BlockRemoved", **options),
            msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared", **options))


_STRUCTS = {"map": _era_structs("map"), "array": _era_structs("array")}
WIRE_ERAS = tuple(_STRUCTS)
REPLAY_FRAMINGS = ("new", "old")


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def to_wire(event: CacheEvent, block_size: int, era: str) -> msgspec.Struct:
    stored, removed, cleared = _STRUCTS[era]
    if isinstance(event, StoredEvent):
        tokens = event.token_ids if isinstance(event.token_ids, list) else list(event.token_ids)  # array('I') runs
        return stored(event.block_hashes, event.parent_block_hash, tokens, block_size, None, "GPU", None,
                      None, 0, "full_attention", None)
    if isinstance(event, RemovedEvent):
        return removed(event.block_hashes, "GPU", 0)
    if isinstance(event, ClearedEvent):
        return cleared()
    raise TypeError(f"unknown cache event {event!r}")


def encode_batch(events: list[CacheEvent], block_size: int, era: str, ts: float | None = None,
                 data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload (frame 2) of one batch."""
    batch = EventBatch(time.time() if ts is None else ts, [to_wire(e, block_size, era) for e in events],
                       data_parallel_rank)
    return msgspec.msgpack.encode(batch)


def pub_binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_binds = pub_binds  # older name


def parse_kv_events_config(config_json: str | dict | None) -> dict[str, Any]:
    """vLLM's --kv-events-config JSON, with defaults filled in. Raises ValueError on bad input."""
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
    unknown = sorted(set(raw) - set(CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown --kv-events-config keys: {', '.join(unknown)}")
    config = {**CONFIG_DEFAULTS, **raw}
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if not isinstance(config[key], int) or config[key] <= 0:
            raise ValueError(f"kv events config: {key} must be a positive integer")
    if config["publisher"] not in ("zmq", "null"):
        raise ValueError(f"kv events config: publisher must be 'zmq' or 'null', not {config['publisher']!r}")
    return config


class KvEventPublisher:
    def __init__(self, config: dict, block_size: int, era: str = "map", replay_framing: str = "new",
                 data_parallel_rank: int = 0) -> None:
        if era not in WIRE_ERAS or replay_framing not in REPLAY_FRAMINGS:
            raise ValueError("era must be map|array and replay_framing new|old")
        config = parse_kv_events_config(config)
        self.endpoint: str = config["endpoint"]
        self.replay_endpoint: str | None = config["replay_endpoint"]
        self.topic = str(config["topic"]).encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer_steps"])
        self.hwm: int = config["hwm"]
        self.max_queue_size: int = config["max_queue_size"]
        self.block_size, self.era, self.replay_framing = block_size, era, replay_framing
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0                # next sequence number the sender assigns
        self.dropped_batches = 0
        self._pending: deque[tuple[float, list[CacheEvent], int]] = deque()  # (ts, events, seqs dropped before)
        self._dropped_since_last = 0
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if pub_binds(self.endpoint) else self._pub.connect)(self.endpoint)
        self._replay = None
        self._tasks: list[asyncio.Task] = []
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config["buffer_steps"] + 1))  # as vLLM 0.33
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)

    @classmethod
    def from_cli(cls, config_json: str | None, block_size: int, era: str = "map", replay_framing: str = "new",
                 data_parallel_rank: int = 0) -> KvEventPublisher | None:
        """None when the config does not enable a ZMQ publisher (vLLM's null publisher)."""
        config = parse_kv_events_config(config_json)
        if not config["enable_kv_cache_events"] or config["publisher"] != "zmq":
            return None
        return cls(config, block_size, era, replay_framing, data_parallel_rank)

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
        return encode_batch(events, self.block_size, self.era, ts, self.data_parallel_rank)

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
                except (msgspec.EncodeError, OverflowError, TypeError) as exc:
                    log.error("KV event batch %d could not be encoded (%s): dropped", seq, exc)
                    continue
                self.buffer.append((seq, payload))
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
