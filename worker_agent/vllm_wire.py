"""Decoder of vLLM's KV-event payload, every era 0.9.0 -> 0.33 (docs/wire-formats.md#vllm), and of
TensorRT-LLM's 2026 streaming ZMQ publisher, which sends the same vLLM map-era shape
(docs/wire-formats.md#tensorrt-llm-streaming-publisher). Pure.

The batch is a positional array `[ts, events]` (0.9.0) or `[ts, events, data_parallel_rank]`
(0.9.1+); a map batch `{"ts", "events", "data_parallel_rank"}` is accepted defensively
(docs/wire-formats.md#vllm-map-batch-snapshot). Events are tagged arrays `[tag, field, ...]`
(0.9.0-0.23, fixed length per version: BlockStored 6/7/8/9/10/12 elements, BlockRemoved 2/3/4) or
tagged maps `{"type": tag, ...}` (0.24+) (docs/wire-formats.md#vllm-array-and-map-eras). Map keys and
trailing array elements this decoder does not declare (a newer release's) are not ignored: they are
stripped and counted (`DecodedBatch.unknown_fields`), and the event applies. Decoding strategy and
errors: `msgpack_wire`.

What the engine-neutral event gets beyond the plain fields:
- `extra_keys` (0.17+, one entry per block, docs/wire-formats.md#vllm-extra-keys-lora-and-cache-salt):
  the LoRA name, multimodal identifiers, the cache salt (first block of a prompt only) and a
  prompt-embeds digest, untagged. The salt is the last string of block 0 that is not the LoRA name;
  any other non-LoRA entry (an `[id, offset]` pair, bytes, a string past block 0) marks multimodal or
  embedded content, which a text router cannot match: `unkeyable_from` = that block. vLLM 0.17-0.18
  wrote multimodal ids as bare strings too, so there a lone image id in block 0 is read as a salt:
  its blocks are then keyed in a namespace no request uses (missed, never wrongly matched). Before
  0.17 the salt is not on the wire at all: salted prompts are keyed as unsalted.
- `locality` (0.26+): anything but LOCAL -> `remote`.
- TRT-LLM streaming: `mm_keys` (per block) -> `unkeyable_from`; token ids may be 64-hex strings
  (multimodal digests), which the resolver treats the same way.
- `lookahead_token_ids` (0.33), `ownership` (0.29), `session_id` (0.30), `kv_cache_spec_sliding_window`:
  not needed for keys, ignored. (With EAGLE lookahead the engine's hash also covers the next
  block's first tokens, so the last block a router matches may still miss; keys stay token-only.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvroute.worker_agent.events import (  # re-exported: the simulator, bench and sim-engine tests import them from here
    U64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EngineEvent,
    EventError,
    UnknownEventError,
    check_block_size,
    is_remote,
    normalize_hash,
    normalize_hashes,
    normalize_parent,
)
from kvroute.worker_agent.msgpack_wire import (
    BatchDecoder,
    BatchShapeError,
    ClearedArray,
    ClearedMap,
    FrameCountError,
    PayloadError,
    SequenceFrameError,
    WireFormatError,
    split_frames,
)
from kvroute.worker_agent.tiers import normalize_medium

__all__ = [
    "U64",
    "AllBlocksCleared",
    "BatchShapeError",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EngineEvent",
    "EventError",
    "FrameCountError",
    "PayloadError",
    "SequenceFrameError",
    "UnknownEventError",
    "WireFormatError",
    "decode_event",
    "decode_frames",
    "decode_payload",
    "normalize_hash",
    "read_extra_keys",
    "split_frames",
]

# ----------------------------------------------------------------------------- wire structs (private)

_Hash = int | bytes


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored", forbid_unknown_fields=True, gc=False):
    # Positions of docs/wire-formats.md#vllm-event-fields. Missing trailing fields (older versions) take the defaults;
    # extra trailing elements (a newer version) fail this struct and are then stripped and counted (msgpack_wire).
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None  # adapter int id (deprecated since 0.14, when lora_name took over)
    medium: str | None = None  # 0.10.2+
    lora_name: str | None = None  # 0.14+
    extra_keys: Any = None  # 0.17+
    group_idx: int | None = None  # 0.20+
    kv_cache_spec_kind: str | None = None  # 0.22+
    kv_cache_spec_sliding_window: Any = None  # 0.22+, not needed


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None  # 0.10.2+
    group_idx: int | None = None  # 0.20+


class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True, gc=False):
    # Every key of docs/wire-formats.md#vllm-event-fields and docs/wire-formats.md#tensorrt-llm-streaming-publisher
    # (a key not here is stripped and counted as unknown); the last four are not needed.
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None  # always written by vLLM (no default): required
    token_ids: list[int | str]  # str: a TRT-LLM multimodal token digest
    block_size: int
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None  # 0.26+
    mm_keys: Any = None  # TRT-LLM streaming: per block, a list of multimodal keys
    kv_cache_spec_sliding_window: Any = None  # 0.22+
    ownership: Any = None  # 0.29+
    session_id: Any = None  # 0.30+
    lookahead_token_ids: Any = None  # 0.33+


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: Any = None  # 0.29+, not needed


_ArrayEvent = _StoredArray | _RemovedArray | ClearedArray
_MapEvent = _StoredMap | _RemovedMap | ClearedMap


# A non-release vLLM snapshot encodes the batch as a map (docs/wire-formats.md#vllm-map-batch-snapshot).
class _MapBatchRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    rank: Any = msgspec.field(default=None, name="data_parallel_rank")


# ----------------------------------------------------------------------------- conversion


def read_extra_keys(extra_keys: object, lora_name: str | None, starts_prompt: bool) -> tuple[str | None, int | None]:
    """(cache_salt, unkeyable_from) from a BlockStored's `extra_keys` (see the module docstring)."""
    if not isinstance(extra_keys, list):
        raise EventError(f"extra_keys must be a list, got {type(extra_keys).__name__}")
    salt = None
    for i, block_keys in enumerate(extra_keys):
        if block_keys is None:
            continue
        if not isinstance(block_keys, list):
            raise EventError(f"extra_keys[{i}] must be a list or nil, got {type(block_keys).__name__}")
        # The LoRA name leads the entry; only that one is the adapter's (a salt may be spelled the same).
        keys = block_keys[1:] if lora_name is not None and block_keys and block_keys[0] == lora_name else block_keys
        strings = [k for k in keys if type(k) is str]
        if i == 0 and starts_prompt and strings:
            salt = strings.pop()  # the salt follows the LoRA name and multimodal ids
        if strings or any(type(k) is not str for k in keys):
            return salt, i
    return salt, None


def _first_multimodal_block(mm_keys: object) -> int | None:
    if not isinstance(mm_keys, list):
        return None
    for i, keys in enumerate(mm_keys):
        if keys:
            return i
    return None


def _convert(w: Any) -> EngineEvent:
    t = type(w)
    if t is _StoredMap or t is _StoredArray:
        check_block_size(w.block_size)
        parent = w.parent_block_hash
        lora_id = w.lora_id if type(w.lora_id) is int else None
        salt = unkeyable = None
        if w.extra_keys is not None:
            salt, unkeyable = read_extra_keys(w.extra_keys, w.lora_name, parent is None)
        remote = False
        if t is _StoredMap:
            remote = is_remote(w.locality)
            if w.mm_keys:
                mm = _first_multimodal_block(w.mm_keys)
                if mm is not None and (unkeyable is None or mm < unkeyable):
                    unkeyable = mm
        return BlockStored(
            normalize_hashes(w.block_hashes),
            normalize_parent(parent),
            w.token_ids,
            w.block_size,
            w.lora_name,
            normalize_medium(w.medium),
            w.group_idx,
            w.kv_cache_spec_kind,
            salt,
            lora_id,
            remote,
            unkeyable,
        )
    if t is _RemovedMap:
        return BlockRemoved(normalize_hashes(w.block_hashes), normalize_medium(w.medium), w.group_idx, is_remote(w.locality))
    if t is _RemovedArray:
        return BlockRemoved(normalize_hashes(w.block_hashes), normalize_medium(w.medium), w.group_idx)
    return AllBlocksCleared()


DECODER = BatchDecoder(
    "vLLM",
    array_events=_ArrayEvent,
    map_events=_MapEvent,
    convert=_convert,
    map_batch=msgspec.msgpack.Decoder(_MapBatchRaw),
)

decode_payload = DECODER.decode_payload
decode_frames = DECODER.decode_frames
decode_event = DECODER.decode_event
