"""Publishes cache events in vLLM's real KV-event wire format over ZMQ.

Our own msgspec replicas of vLLM's published schemas (field names and order from the spec,
§2): `map` era = vLLM 0.24-0.33 (tagged maps, omit_defaults), `array` era = vLLM 0.22-0.23
(tagged arrays, 12-element BlockStored). Frames: [topic, seq as 8-byte big-endian, msgpack
EventBatch]; a ROUTER replay socket answers [b"", start_seq] with the buffered batches in the
new (>=0.26) or old framing, then the end marker.
"""

from __future__ import annotations

import asyncio
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
END_SEQ = b"\xff" * 8


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
    options = ({"tag_field": "type", "omit_defaults": True} if era == "map" else {"array_like": True})
    return (msgspec.defstruct("BlockStored", _STORED_FIELDS, tag="BlockStored", **options),
            msgspec.defstruct("BlockRemoved", _REMOVED_FIELDS, tag="BlockRemoved", **options),
            msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared", **options))


_STRUCTS = {"map": _era_structs("map"), "array": _era_structs("array")}


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def to_wire(event: CacheEvent, block_size: int, era: str) -> msgspec.Struct:
    stored, removed, cleared = _STRUCTS[era]
    if isinstance(event, StoredEvent):
        return stored(event.block_hashes, event.parent_block_hash, event.token_ids, block_size, None, "GPU", None,
                      None, 0, "full_attention", None)
    if isinstance(event, RemovedEvent):
        return removed(event.block_hashes, "GPU", 0)
    if isinstance(event, ClearedEvent):
        return cleared()
    raise TypeError(f"unknown cache event {event!r}")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(self, config: dict, block_size: int, era: str = "map", replay_framing: str = "new") -> None:
        if era not in ("map", "array") or replay_framing not in ("new", "old"):
            raise ValueError("era must be map|array and replay_framing new|old")
        self.endpoint = config.get("endpoint", "tcp://*:5557")
        self.replay_endpoint = config.get("replay_endpoint")
        self.topic = config.get("topic", "").encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=int(config.get("buffer_steps", 10000)))
        self.hwm = int(config.get("hwm", 100000))
        self.block_size, self.era, self.replay_framing = block_size, era, replay_framing
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.hwm)
        (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
        self._replay = None
        self._replay_task: asyncio.Task | None = None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)

    @classmethod
    def from_cli(cls, config_json: str, block_size: int, era: str, replay_framing: str) -> KvEventPublisher | None:
        config = json.loads(config_json) if config_json else {}
        if not config.get("enable_kv_cache_events"):
            return None
        if config.get("publisher", "zmq") != "zmq":
            return None
        return cls(config, block_size, era, replay_framing)

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay())

    def encode(self, events: list[CacheEvent]) -> bytes:
        batch = EventBatch(time.time(), [to_wire(e, self.block_size, self.era) for e in events], 0)
        return self._encoder.encode(batch)

    async def publish(self, events: list[CacheEvent]) -> None:
        if not events:
            return  # vLLM only publishes non-empty batches
        payload = self.encode(events)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch %d dropped: subscriber pipe full", seq)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(self._reply(identity, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart(self._reply(identity, END_SEQ, b""))

    def _reply(self, identity: bytes, seq8: bytes, payload: bytes) -> list[bytes]:
        if self.replay_framing == "new":
            return [identity, b"", self.topic if payload else b"", seq8, payload]
        return [identity, b"", seq8, payload]

    def close(self) -> None:
        if self._replay_task:
            self._replay_task.cancel()
        self._ctx.destroy(linger=0)
