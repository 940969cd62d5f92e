"""What the log holds: one entry per accepted agent message, in the form every replica applies.

An agent's batch becomes a list of `BlockOp`s (op, tier, keys); both logs hand these to
`LogApplier`, so the embedded control plane and the replicas apply the same thing. In Redis a
batch is one stream entry whose body is msgpack, each op's keys one bytes field of 8-byte
little-endian words (a 16-block event is 128 bytes of keys, not 16 msgpack integers).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from enum import IntEnum

import msgspec

from control_plane.index import Tier


class Op(IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2


class BlockOp(msgspec.Struct, array_like=True, frozen=True):
    op: int                   # Op
    tier: int                 # Tier
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


class HeartbeatBody(msgspec.Struct, array_like=True):
    running_requests: int
    waiting_requests: int
    kv_usage: float
    observed_unix_ms: int
    lora_adapters: list[str]


class WorkerSnapshot(msgspec.Struct, array_like=True):
    """A worker as a replica holds it at some position of its shard (snapshots, restarts)."""

    worker_id: str
    epoch: int
    last_seq: int
    register: RegisterBody
    load: HeartbeatBody
    tiers: list[PackedOp]   # one STORED op per non-empty tier


_LITTLE = sys.byteorder == "little"


def pack_keys(keys: Iterable[int]) -> bytes:
    words = array("Q", keys)
    if not _LITTLE:
        words.byteswap()
    return words.tobytes()


def unpack_keys(data: bytes) -> list[int]:
    words = array("Q")
    words.frombytes(data)
    if not _LITTLE:
        words.byteswap()
    return words.tolist()


def pack_ops(ops: Iterable[BlockOp]) -> list[PackedOp]:
    return [PackedOp(o.op, o.tier, pack_keys(o.keys)) for o in ops]


def unpack_ops(ops: Iterable[PackedOp]) -> list[BlockOp]:
    return [BlockOp(o.op, o.tier, unpack_keys(o.keys)) for o in ops]


def tier_ops(keys_by_tier: dict[Tier, Iterable[int]]) -> list[BlockOp]:
    return [BlockOp(Op.STORED, tier, list(keys)) for tier, keys in keys_by_tier.items()]


ENCODER = msgspec.msgpack.Encoder()
BATCH_DECODER = msgspec.msgpack.Decoder(BatchBody)
REGISTER_DECODER = msgspec.msgpack.Decoder(RegisterBody)
HEARTBEAT_DECODER = msgspec.msgpack.Decoder(HeartbeatBody)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(WorkerSnapshot)
