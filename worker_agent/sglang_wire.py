"""Decoder of SGLang's KV-event payload, 0.4.7 -> 0.5.23 (docs/wire-formats.md#sglang). Pure.

Same transport, replay and batch shape as vLLM (`[ts, events, attn_dp_rank]`), but SGLang's own
field positions, NOT vLLM's:

| SGLang        | events       | BlockStored after the tag                                         | BlockRemoved |
|---------------|--------------|-------------------------------------------------------------------|--------------|
| 0.4.7-0.5.8   | tagged array | block_hashes, parent_block_hash, token_ids, block_size, lora_id    | block_hashes |
| 0.5.9-0.5.19  | tagged array | + medium (no lora_name at position 7, unlike vLLM)                 | + medium     |
| 0.5.20-0.5.21 | tagged map   | + cache_salt, session_id                                          | + medium     |
| 0.5.22-0.5.23 | tagged map   | + lora_name                                                       | + medium     |

- Hashes are signed int64 on the wire (normalised to u64). They are per-worker ids only, with two
  weaknesses of old releases that no decoder can repair: 0.4.7 hashes a whole radix node (any
  number of tokens, not one page): such an event cannot be keyed per block and is held unkeyed;
  0.4.8-0.5.5 hash a page's tokens without its prefix, so equal pages at two positions share one
  hash (the second store is taken for a duplicate).
- `block_size` is the page size. `medium`: "GPU", "CPU_PINNED", "DISK", "EXTERNAL".
- EAGLE bigram mode: `token_ids` is a list of `[a, b]` pairs, one per position; the token of a
  position is the pair's first element.
- `cache_salt` (0.5.20+) and `lora_name` (0.5.22+) name the request's namespace; before 0.5.20
  the salt is not on the wire (salted prompts are keyed as unsalted).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvroute.worker_agent.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventError,
    check_block_size,
    normalize_hashes,
    normalize_parent,
)
from kvroute.worker_agent.msgpack_wire import BatchDecoder, ClearedArray, ClearedMap
from kvroute.worker_agent.tiers import normalize_medium

_Hash = int | bytes
_Token = int | list[int]  # list: an EAGLE bigram pair


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_Token]
    block_size: int
    lora_id: Any = None  # always None in the releases read
    medium: str | None = None  # 0.5.9+


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None  # 0.5.9+


class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    token_ids: list[_Token]
    block_size: int
    parent_block_hash: _Hash | None = None  # key order does not matter in a map; nil may be omitted
    lora_id: Any = None
    medium: str | None = None
    cache_salt: str | None = None  # 0.5.20+
    session_id: Any = None  # 0.5.20+, not needed
    lora_name: str | None = None  # 0.5.22+


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None


_ArrayEvent = _StoredArray | _RemovedArray | ClearedArray
_MapEvent = _StoredMap | _RemovedMap | ClearedMap


def first_of_pairs(token_ids: list) -> list[int]:
    """EAGLE bigram token ids ([a, b] per position) -> the position's token a."""
    try:
        return [t[0] if type(t) is list else t for t in token_ids]
    except IndexError:
        raise EventError("empty bigram token pair") from None


def _convert(w: Any) -> EngineEvent:
    t = type(w)
    if t is _StoredMap or t is _StoredArray:
        block_size = check_block_size(w.block_size)
        tokens = w.token_ids
        if tokens and type(tokens[0]) is list:
            tokens = first_of_pairs(tokens)
        hashes = normalize_hashes(w.block_hashes)
        # One hash per page means exactly n pages of tokens; more is a radix-node hash (0.4.7).
        unkeyable = 0 if len(tokens) > len(hashes) * block_size else None
        is_map = t is _StoredMap
        return BlockStored(
            hashes,
            normalize_parent(w.parent_block_hash),
            tokens,
            block_size,
            w.lora_name if is_map else None,
            normalize_medium(w.medium),
            cache_salt=w.cache_salt if is_map else None,
            lora_id=w.lora_id if type(w.lora_id) is int else None,
            unkeyable_from=unkeyable,
        )
    if t is _RemovedMap or t is _RemovedArray:
        return BlockRemoved(normalize_hashes(w.block_hashes), normalize_medium(w.medium))
    return AllBlocksCleared()


DECODER = BatchDecoder(
    "SGLang",
    array_events=_ArrayEvent,
    map_events=_MapEvent,
    convert=_convert,
)

decode_payload = DECODER.decode_payload
decode_frames = DECODER.decode_frames
decode_event = DECODER.decode_event
