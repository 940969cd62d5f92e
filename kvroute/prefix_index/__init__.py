"""Prefix indexes: which workers hold which kvroute block keys, on which tier.

    from kvroute.prefix_index import Tier, make_index
    index = make_index("auto")        # the native index when its C extension is built, else the bitmask one
    index.store(slot, keys, Tier.GPU)
    index.match_tiers(prompt_keys)    # per worker slot: matched depth, cpu/disk/speculative counts

The contract (`PrefixIndex`, its semantics, `Tier`, `TierMatch`) is in `base.py`; the
implementations, all checked by one conformance suite (tests/control_plane/test_index_conformance.py):
`NativePrefixIndex` and `NativeBoundedPrefixIndex` (native.py over _native.c: the default, ~40
bytes per entry), `BitmaskPrefixIndex` (bitmask.py), `BoundedPrefixIndex` (bounded.py: a memory
bound, CLOCK eviction) and `SetPrefixIndex` (reference.py: the oracle). backends.py chooses one by
configuration (`--index-backend`). The control plane and every router's view of the fleet
(`kvroute.fleet`) hold one.
"""

from kvroute.prefix_index.backends import (
    BACKENDS,
    NATIVE_IMPORT_ERROR,
    IndexBackendError,
    is_bounded,
    make_index,
    resolve_backend,
)
from kvroute.prefix_index.base import NO_EVICTIONS, TIERS, PrefixIndex, Tier, TierMatch, tier_of_wire
from kvroute.prefix_index.bitmask import BitmaskPrefixIndex
from kvroute.prefix_index.bounded import BoundedPrefixIndex, EvictionCounters
from kvroute.prefix_index.reference import SetPrefixIndex

__all__ = [
    "BACKENDS",
    "NATIVE_IMPORT_ERROR",
    "NO_EVICTIONS",
    "TIERS",
    "BitmaskPrefixIndex",
    "BoundedPrefixIndex",
    "EvictionCounters",
    "IndexBackendError",
    "PrefixIndex",
    "SetPrefixIndex",
    "Tier",
    "TierMatch",
    "is_bounded",
    "make_index",
    "resolve_backend",
    "tier_of_wire",
]
