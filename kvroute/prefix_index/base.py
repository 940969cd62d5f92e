"""The prefix index contract: tiers, the `PrefixIndex` protocol and what a match returns.

Workers are identified by small dense integers (slots) handed out by the registry, so the
fast index can keep one int bitmask per block key. Both implementations satisfy the same
`PrefixIndex` protocol and are checked by one conformance suite
(tests/control_plane/test_index_conformance.py).

Semantics (shared by all implementations):
- A key is held per (worker, tier): store/remove are idempotent set operations per
  (worker, key, tier), so dropping a key from one tier leaves it on the others. Callers that
  know only GPU blocks (the simulator) leave `tier` at its default.
- match(keys) walks a chained key sequence from the start and returns, per worker, how many
  leading keys it holds on any tier without a hole: the engine's own prefix match stops at the
  first missing block, so a hole ends the match even if later keys are present.
- speculate/unspeculate mark a worker as an unconfirmed holder of keys (a request was just sent
  there, its engine has not reported the blocks yet). Idempotent per (worker, key): who vouches
  for a claim, and for how long, is the caller's business (kvroute.fleet.inflight). Speculative
  claims are not entries: worker_keys, counts, clear and match ignore them.
- match_tiers(keys) is the same walk as match, but speculative claims also continue it; it says
  per worker how many matched blocks sit only on cpu, only on disk (a block on gpu and cpu counts
  as gpu; on cpu and disk as cpu) or only speculatively (held on no tier).
- evicted_entries(worker): entries the index itself dropped for its memory bound since the
  worker's last snapshot (replace_all) or clear, per tier; always empty for an unbounded index.
  `BoundedPrefixIndex` is the only index that drops entries on its own (see there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol


class Tier(IntEnum):
    """A cache tier, valued as `kvroute.v1.Tier` on the wire (tests/control_plane/test_index_conformance.py
    checks), which is also the replicated log's encoding."""

    GPU = 0
    CPU = 1
    DISK = 2

    @property
    def label(self) -> str:
        """ "gpu", "cpu" or "disk": the tier's name in audits and eviction metadata."""
        return self.name.lower()


TIERS = tuple(Tier)


def tier_of_wire(value: int) -> Tier | None:
    """The tier a `kvroute.v1.Tier` value names; None for a value outside the contract (a newer agent)."""
    return TIERS[value] if 0 <= value < len(TIERS) else None


@dataclass(slots=True)
class TierMatch:
    """Per worker slot: matched depth, and how many of those blocks are cpu-only, disk-only or
    only speculative. Workers absent from a count dict have 0 there."""

    depth: dict[int, int] = field(default_factory=dict)
    cpu_blocks: dict[int, int] = field(default_factory=dict)
    disk_blocks: dict[int, int] = field(default_factory=dict)
    speculative_blocks: dict[int, int] = field(default_factory=dict)


class PrefixIndex(Protocol):
    def store(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        """Record that `worker` holds `keys` on `tier`; returns how many were new there."""

    def remove(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        """Forget `keys` on `worker`'s `tier`; returns how many were present there."""

    def clear(self, worker: int) -> int:
        """Forget everything `worker` holds on every tier; returns how many entries it had."""

    def replace(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> None:
        """Make `keys` exactly the set `worker` holds on `tier`; other tiers are untouched."""

    def replace_all(self, worker: int, keys_by_tier: Mapping[Tier, Iterable[int]]) -> None:
        """Snapshot: make every tier of `worker` exactly its entry (a tier not named: empty)."""

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        """Per worker holding keys[0] on any tier: length of the longest held prefix of `keys`."""

    def speculate(self, worker: int, keys: Iterable[int]) -> None:
        """Mark `worker` as an unconfirmed holder of `keys`."""

    def unspeculate(self, worker: int, keys: Iterable[int]) -> None:
        """Drop `worker`'s unconfirmed claims on `keys`."""

    def held_prefix(self, worker: int, keys: Iterable[int]) -> int:
        """How many leading `keys` `worker` holds on any tier (speculation aside)."""

    def match_tiers(self, keys: Sequence[int]) -> TierMatch:
        """`match` continued by speculative claims, with per-tier and speculative counts."""

    def worker_keys(self, worker: int, tier: Tier) -> set[int]:
        """A copy of the keys `worker` holds on `tier`."""

    def worker_block_count(self, worker: int, tier: Tier | None = None) -> int:
        """Entries `worker` holds on `tier` (None: summed over tiers)."""

    def entry_count(self) -> int:
        """Number of (key, worker, tier) entries held."""

    def evicted_entries(self, worker: int) -> Mapping[Tier, int]:
        """Per tier, entries of `worker` the index dropped for its bound since the worker's last
        replace_all or clear (keys it may still hold); empty when none."""


NO_EVICTIONS: Mapping[Tier, int] = {}
