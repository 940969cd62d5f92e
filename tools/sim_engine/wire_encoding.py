"""Cache events as one dialect's msgpack batch (vLLM, SGLang, TensorRT-LLM's ZMQ publisher).

Our own msgspec replicas of the published schemas: for each dialect the BlockStored /
BlockRemoved / AllBlocksCleared structs are built from its field list (`Dialect`), as tagged
arrays or tagged maps (`"type"` = class name). Map structs with omit_defaults leave out fields
at their default (None) while fields declared without one are always written
(docs/wire-formats.md#msgspec-encoding-rules); a tagged array always has every field. The batch is
positional: `[ts, events, rank]`, or vLLM 0.9.0's `[ts, events]` (SGLang names the rank `attn_dp_rank`;
being positional, the bytes are the same).

Values per field (what this engine knows to put there):
- `lora_id`: the adapter's int id (vLLM, TRT-LLM); always nil on SGLang (docs/wire-formats.md#sglang-events-per-version).
- `lora_name`: the adapter's name where the dialect carries it by name (vLLM >= 0.14, SGLang >= 0.5.22).
- `extra_keys` (vLLM >= 0.17): per block the untagged tuple (LoRA name, cache salt on the
  request's first block), nil for a block with neither, nil overall when no block has any
  (docs/wire-formats.md#vllm-extra-keys-lora-and-cache-salt).
- `cache_salt` (SGLang maps); `group_idx` 0 and `kv_cache_spec_kind` "full_attention" (one
  full-attention KV group); `locality` "LOCAL" on CPU-tier events (the offload tier is on this
  node; GPU block-pool events leave it out); `mm_keys` one empty list per block (text only).
SGLang coalesces: consecutive stores whose parent is the previous store's last block become one
event (docs/wire-formats.md#sglang-events-per-version).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import msgspec

from kvroute.tools.sim_engine.dialects import Dialect
from kvroute.tools.sim_engine.prefix_cache import GPU, CacheEvent, ClearedEvent, RemovedEvent, StoredEvent


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class EventBatchWithoutRank(msgspec.Struct, array_like=True):  # vLLM 0.9.0
    ts: float
    events: list[Any]


def _struct(name: str, fields: tuple[str, ...], dialect: Dialect) -> type:
    if dialect.events == "array":
        options: dict[str, Any] = {"array_like": True}
    else:
        options = {"tag_field": "type", "omit_defaults": dialect.omit_defaults}
    spec = [(f, Any) if f in dialect.required_fields else (f, Any, None) for f in fields]
    return msgspec.defstruct(name, spec, tag=name, **options)


def coalesce_stores(events: list[CacheEvent]) -> list[CacheEvent]:
    """SGLang's merging of stores that continue each other's chain (same tier and namespace)."""
    out: list[CacheEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, StoredEvent)
            and isinstance(last, StoredEvent)
            and last.block_hashes
            and event.parent_block_hash == last.block_hashes[-1]
            and event.medium == last.medium
            and event.namespace == last.namespace
        ):
            out[-1] = replace(
                last, block_hashes=last.block_hashes + event.block_hashes, token_ids=list(last.token_ids) + list(event.token_ids)
            )
        else:
            out.append(event)
    return out


class MsgpackEventEncoder:
    def __init__(self, dialect: Dialect, block_size: int, data_parallel_rank: int = 0) -> None:
        if dialect.transport != "zmq":
            raise ValueError(f"dialect {dialect.name} has no msgpack events")
        self.dialect, self.block_size, self.data_parallel_rank = dialect, block_size, data_parallel_rank
        self.stored = _struct("BlockStored", dialect.stored_fields, dialect)
        self.removed = _struct("BlockRemoved", dialect.removed_fields, dialect)
        self.cleared = _struct("AllBlocksCleared", (), dialect)

    def medium(self, tier: str) -> str:
        if tier == GPU:
            return "GPU"
        if self.dialect.cpu_medium is None:
            raise ValueError(f"dialect {self.dialect.name} cannot represent a {tier} tier")
        return self.dialect.cpu_medium

    def _locality(self, tier: str) -> str | None:
        return "LOCAL" if self.dialect.has_locality and tier != GPU else None

    def _extra_keys(self, event: StoredEvent) -> list | None:
        ns = event.namespace
        if self.dialect.engine != "vllm" or not (ns.lora_name or ns.cache_salt):
            return None
        out = []
        for i in range(len(event.block_hashes)):
            parts = [ns.lora_name] if ns.lora_name else []
            if ns.cache_salt and i == 0 and event.parent_block_hash is None:
                parts.append(ns.cache_salt)
            out.append(tuple(parts) or None)
        return out if any(out) else None

    def _stored_values(self, event: StoredEvent) -> dict[str, Any]:
        ns, dialect = event.namespace, self.dialect
        return {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": self.block_size,
            "lora_id": None if dialect.engine == "sglang" else ns.lora_id,
            "medium": self.medium(event.medium),
            "lora_name": ns.lora_name if dialect.lora_on_wire == "lora_name" else None,
            "extra_keys": self._extra_keys(event),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": None,
            "locality": self._locality(event.medium),
            "ownership": None,
            "session_id": None,
            "lookahead_token_ids": None,
            "cache_salt": ns.cache_salt,
            "mm_keys": [[] for _ in event.block_hashes],
        }

    def to_wire(self, event: CacheEvent) -> msgspec.Struct:
        if isinstance(event, StoredEvent):
            values = self._stored_values(event)
            return self.stored(**{f: values[f] for f in self.dialect.stored_fields})
        if isinstance(event, RemovedEvent):
            values = {
                "block_hashes": list(event.block_hashes),
                "medium": self.medium(event.medium),
                "group_idx": 0,
                "locality": self._locality(event.medium),
                "ownership": None,
            }
            return self.removed(**{f: values[f] for f in self.dialect.removed_fields})
        if isinstance(event, ClearedEvent):
            return self.cleared()
        raise TypeError(f"unknown cache event {event!r}")

    def encode(self, events: list[CacheEvent], ts: float | None = None) -> bytes:
        """The msgpack payload (frame 2) of one batch."""
        if self.dialect.coalesce_stores:
            events = coalesce_stores(events)
        wire = [self.to_wire(e) for e in events]
        ts = time.time() if ts is None else ts
        if not self.dialect.batch_has_rank:
            return msgspec.msgpack.encode(EventBatchWithoutRank(ts, wire))
        return msgspec.msgpack.encode(EventBatch(ts, wire, self.data_parallel_rank))
