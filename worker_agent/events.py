"""Engine-neutral KV events: what every engine dialect (vLLM, SGLang, TensorRT-LLM) decodes into.

The resolver (`block_resolver`) only sees these. Dialect decoders normalise what the wire says
(hash forms, medium names, token shapes, where a LoRA name or cache salt sits) and leave policy
(what gets indexed, and under which key) to the resolver.
"""

from __future__ import annotations

import msgspec

U64 = (1 << 64) - 1


class EventError(ValueError):
    """One event that cannot be decoded (reported per event, never raised out of a batch decode)."""


class UnknownEventError(EventError):
    """A well-formed event with a tag we do not know (tolerated: skipped and counted)."""

    def __init__(self, tag: str) -> None:
        super().__init__(f"unknown event type {tag!r}")
        self.tag = tag


class BlockStored(msgspec.Struct, gc=False):
    """Full blocks inserted into the engine's prefix cache, in chain order."""

    block_hashes: list[int]  # u64, one per full block
    parent_block_hash: int | None  # u64 hash of the block before block_hashes[0]; None = first block of the prompt
    token_ids: list[int]  # tokens of the stored range (len >= len(block_hashes) * block_size); TRT-LLM
    # may put a 64-hex digest string where a multimodal token sits
    block_size: int
    lora_name: str | None = None
    medium: str = "gpu"  # lower-cased engine name ("gpu", "cpu", "cpu_pinned", ...; tiers.py maps it)
    group_idx: int | None = None  # KV-cache group (vLLM 0.20+, TRT-LLM layer group)
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", ... (vLLM 0.22+)
    cache_salt: str | None = None  # the request's salt, when the event carries it (first block of a prompt)
    lora_id: int | None = None  # adapter int id when the event names no adapter (vLLM <= 0.13, TRT-LLM)
    remote: bool = False  # vLLM 0.26+ locality REMOTE: a block another instance holds
    unkeyable_from: int | None = None  # first block whose content is not plain token ids (multimodal,
    # prompt embeds): it and every later block cannot be keyed


class BlockRemoved(msgspec.Struct, gc=False):
    block_hashes: list[int]
    medium: str = "gpu"
    group_idx: int | None = None
    remote: bool = False


class AllBlocksCleared(msgspec.Struct, gc=False):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class DecodedBatch(msgspec.Struct, gc=False):
    seq: int
    ts: float
    dp_rank: int | None
    events: list[EngineEvent] = msgspec.field(default_factory=list)
    bad_events: list[str] = msgspec.field(default_factory=list)  # "event <i>: <why>" per rejected event
    unknown_events: list[str] = msgspec.field(default_factory=list)  # tags we do not know (tolerated)
    unknown_fields: list[str] = msgspec.field(default_factory=list)  # "event <i>: <paths>" per event with fields
    # we do not know (dropped, event kept)


def normalize_hash(value: int | bytes | str) -> int:
    """An engine block hash as u64: signed/unsigned ints -> `h & (2**64 - 1)`; bytes -> last 8 bytes
    big-endian unsigned (the number vLLM's default int form carries, docs/wire-formats.md#vllm-block-hashes); a hex string
    (TRT-LLM v2_sha256 JSON) -> its last 16 hex digits. Hashes are only per-worker ids, so 64 bits suffice."""
    if type(value) is int:
        return value & U64
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise EventError("empty bytes block hash")
        return int.from_bytes(bytes(value[-8:]), "big")
    if isinstance(value, str):
        try:
            return int(value[-16:], 16)
        except ValueError:
            raise EventError(f"block hash string is not hex: {value[:20]!r}") from None
    raise EventError(f"block hash must be int, bytes or a hex string, got {type(value).__name__}")


def normalize_parent(value: int | bytes | str | None) -> int | None:
    """A parent hash (None: the block starts a prompt)."""
    return None if value is None else normalize_hash(value)


def check_block_size(block_size: int) -> int:
    if block_size <= 0:
        raise EventError(f"block_size must be positive, got {block_size}")
    return block_size


def normalize_hashes(values: list) -> list[int]:
    for h in values:  # common case (vLLM >= 0.10.2 default): already u64 ints, keep the list as decoded
        if type(h) is not int or h < 0:
            return [normalize_hash(h) for h in values]
    return values


def is_remote(locality: str | None) -> bool:
    """vLLM 0.26+ `locality`: only LOCAL (or absent) blocks are this publisher's
    (docs/wire-formats.md#vllm-medium-locality-and-kv-groups)."""
    return locality is not None and locality.upper() != "LOCAL"
