"""What the resolver reports: plain key deltas per cache tier, no wire types.

    KeysStored(tier, keys)    # blocks newly held on `tier` (tiers.Tier: gpu, cpu or disk), kvroute block keys
    KeysRemoved(tier, keys)   # blocks no longer held on `tier`
    AllKeysCleared()          # the engine dropped its cache: every tier is empty

The agent's gRPC link turns them into `BlockEvent` messages (`to_block_events`) as it sends them;
the fleet simulator and the ingest bench apply them to an index directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.tiers import Tier


@dataclass(slots=True)
class KeysStored:
    kind: ClassVar[str] = "stored"
    tier: Tier
    keys: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KeysRemoved:
    kind: ClassVar[str] = "removed"
    tier: Tier
    keys: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AllKeysCleared:
    kind: ClassVar[str] = "cleared"


BlockDelta = KeysStored | KeysRemoved | AllKeysCleared


def to_block_events(deltas: list[BlockDelta]) -> list[pb.BlockEvent]:
    """The wire form (`kvroute.v1.BlockEvent`, the tier as `kvroute.v1.Tier`)."""
    out = []
    for d in deltas:
        if type(d) is KeysStored:
            out.append(pb.BlockEvent(stored=pb.BlocksStored(block_keys=d.keys, tier=Tier(d.tier).wire)))
        elif type(d) is KeysRemoved:
            out.append(pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=d.keys, tier=Tier(d.tier).wire)))
        else:
            out.append(pb.BlockEvent(cleared=pb.AllBlocksCleared()))
    return out
