"""What the log holds: one entry per accepted agent message, in the form every replica applies.

An agent's batch becomes a list of `BlockOp`s (op, tier, keys); both logs hand these to
`LogApplier`, so the embedded control plane and the replicas apply the same thing. In Redis a
batch from an agent is one stream entry whose body is the agent's own EventBatch, serialized again
by protobuf's C code (its keys are packed fixed64: 8 bytes each); a batch written without one (tests,
benches) is msgpack, each op's keys one bytes field of 8-byte little-endian words. Snapshots use the
latter. Both decode to the same ops.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from enum import IntEnum

import msgspec

from kvroute.prefix_index import Tier, tier_of_wire


class Op(IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2


class BlockOp(msgspec.Struct, array_like=True, frozen=True):
    op: int  # Op
    tier: int  # Tier
    keys: Sequence[int] = ()  # chain order for stores


class PackedOp(msgspec.Struct, array_like=True):
    op: int
    tier: int
    keys: bytes


class BatchBody(msgspec.Struct, array_like=True):
    snapshot: bool
    ops: list[PackedOp]


class RegisterBody(msgspec.Struct, array_like=True):
    model: str
    engine: str
    block_size: int
    endpoint: str
    engine_version: str
    lora_adapters: list[str]
    data_parallel_rank: int | None
    instance: str
    peer: str
    role: str = ""  # "prefill", "decode", or "" for both (RegisterWorker.role); last, so older entries decode


class HeartbeatBody(msgspec.Struct, array_like=True):
    running_requests: int
    waiting_requests: int
    kv_usage: float
    observed_unix_ms: int
    lora_adapters: list[str]
    kv_capacity_tokens: int = 0  # last, so entries written before it decode (as unknown)


class WorkerSnapshot(msgspec.Struct, array_like=True):
    """A worker as a replica holds it at some position of its shard (snapshots, restarts)."""

    worker_id: str
    epoch: int
    last_seq: int
    register: RegisterBody
    load: HeartbeatBody
    tiers: list[PackedOp]  # one STORED op per non-empty tier


_LITTLE = sys.byteorder == "little"


def pack_keys(keys: Iterable[int]) -> bytes:
    words = array("Q", keys)
    if not _LITTLE:
        words.byteswap()
    return words.tobytes()


def unpack_keys(data: bytes) -> list[int]:
    return key_array(data).tolist()


def key_array(data: bytes) -> array:
    """Packed keys as an array('Q'): one copy in C, no int object per key until one is read (the native
    index takes the array's buffer as it is)."""
    words = array("Q")
    words.frombytes(data)
    if not _LITTLE:
        words.byteswap()
    return words


def pack_ops(ops: Iterable[BlockOp]) -> list[PackedOp]:
    return [PackedOp(o.op, o.tier, pack_keys(o.keys)) for o in ops]


def unpack_ops(ops: Iterable[PackedOp]) -> list[BlockOp]:
    return [BlockOp(o.op, o.tier, unpack_keys(o.keys)) for o in ops]


def ops_from_events(events, tier_of) -> list[BlockOp]:
    """A protobuf EventBatch's events as block ops; `tier_of(value)` names the tier of a `kvroute.v1.Tier` value. The keys stay the
    message's own repeated fields (no copy)."""
    ops = []
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            ops.append(BlockOp(Op.STORED, tier_of(event.stored.tier), event.stored.block_keys))
        elif kind == "removed":
            ops.append(BlockOp(Op.REMOVED, tier_of(event.removed.tier), event.removed.block_keys))
        elif kind == "cleared":
            ops.append(BlockOp(Op.CLEARED, Tier.GPU))
    return ops


def tier_or_disk(value: int) -> Tier:
    """The tier a wire value names; anything outside the contract is some slower store (the writer counted it)."""
    tier = tier_of_wire(value)
    return Tier.DISK if tier is None else tier


ENCODER = msgspec.msgpack.Encoder()
BATCH_DECODER = msgspec.msgpack.Decoder(BatchBody)
REGISTER_DECODER = msgspec.msgpack.Decoder(RegisterBody)
HEARTBEAT_DECODER = msgspec.msgpack.Decoder(HeartbeatBody)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(WorkerSnapshot)
