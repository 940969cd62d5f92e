"""`NativePrefixIndex` and `NativeBoundedPrefixIndex`: the prefix index in C (`_native.c`), the default backend.

    from kvroute.prefix_index.native import NativePrefixIndex, NativeBoundedPrefixIndex
    index = NativePrefixIndex()
    index.store(slot, pack_keys(keys), Tier.GPU)   # or a list, a protobuf repeated field, any iterable of ints
    index.match_tiers(prompt_keys)                 # TierMatch, as every PrefixIndex
    index.match_columns(prompt_keys, slots)        # (depth, cpu, disk, speculative) lists in `slots` order

Contract: the `PrefixIndex` protocol (base.py), checked against SetPrefixIndex by the conformance suite,
and for the bounded one `BoundedPrefixIndex`'s CLOCK policy (bounded.py). Besides the protocol: keys may
also come packed (bytes of little-endian u64 words, as `kvroute.fleet.entries.pack_keys` writes them, or
an `array('Q')`), keys must be unsigned 64-bit ints and slots ints in [0, 2^27); `estimated_bytes()` is
exact (every allocation is counted, and made through PyMem_* so tracemalloc sees it).

Representation (the comment at the top of _native.c has the details): a 16-byte record per key holding
up to two (slot, tiers, claim) holders of 4 bytes inline, more in a sorted array; an open-addressing
table key -> record of 8-byte slots; per worker an open-addressing set of its record ids (4-byte slots)
and its entry counts. A key's holders cost 4 bytes each, not a bit per slot in the fleet.

Measured (docs/benchmarks/2026-12-04-native-index.md, `kvroute bench ingest` and `kvroute bench answer`,
2 shared cores, CPU time): 40.5 bytes per entry at 1M entries (42 by RSS) against the bitmask index's
111-151; 9.5-12M block events applied per second from packed bytes or lists, 6M from protobuf fields,
against 1.4-3.0M; `match_tiers` of a 512-block prompt over 64 workers 41-44 us p50, 100-138 us p99,
against 79-81 and 176-233.

The import fails when the extension was not built (an install without a C compiler); `backends.py`
turns that into a clear error for `--index-backend native`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Self

from kvroute.prefix_index._native import Index
from kvroute.prefix_index.base import NO_EVICTIONS, TIERS, Tier, TierMatch
from kvroute.prefix_index.bounded import EvictionCounters


class NativePrefixIndex(Index):
    """The unbounded native index; the methods not written here are C (_native.c)."""

    __slots__ = ()

    def match_tiers(self, keys: Sequence[int]) -> TierMatch:
        return TierMatch(*self._match_tiers(keys))

    def replace_all(self, worker: int, keys_by_tier: Mapping[Tier, Iterable[int]]) -> None:
        self._forget_evictions(worker)  # a snapshot is the worker's whole truth: nothing is unknown any more
        for tier in TIERS:
            self.replace(worker, keys_by_tier.get(tier, ()), tier)

    def evicted_entries(self, worker: int) -> Mapping[Tier, int]:
        counts = self._evictions(worker)
        return {tier: counts[tier] for tier in TIERS if counts[tier]} if counts else NO_EVICTIONS


class NativeBoundedPrefixIndex(NativePrefixIndex):
    """At most `max_entries` (key, worker, tier) entries, evicting as `BoundedPrefixIndex` does (CLOCK
    over whole keys, matched prefixes get a second chance; bounded.py says how)."""

    __slots__ = ()

    def __new__(cls, max_entries: int) -> Self:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        return super().__new__(cls, max_entries)

    @property
    def counters(self) -> EvictionCounters:
        return EvictionCounters(*self._counters())
