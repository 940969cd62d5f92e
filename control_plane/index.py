"""Prefix indexes: which workers hold which kvroute block keys, on which tier.

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
  for a claim, and for how long, is the caller's business (kvroute.control_plane.inflight). Speculative
  claims are not entries: worker_keys, counts, clear and match ignore them.
- match_tiers(keys) is the same walk as match, but speculative claims also continue it; it says
  per worker how many matched blocks sit only on cpu, only on disk (a block on gpu and cpu counts
  as gpu; on cpu and disk as cpu) or only speculatively (held on no tier).
- evicted_entries(worker): entries the index itself dropped for its memory bound since the
  worker's last snapshot (replace_all) or clear, per tier; always empty for an unbounded index.
  `BoundedPrefixIndex` is the only index that drops entries on its own (see there).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import islice
from typing import Protocol


class Tier(IntEnum):
    """A cache tier, valued as `kvroute.v1.Tier` on the wire (tests/control_plane/test_index_conformance.py
    checks), which is also the replicated log's encoding."""

    GPU = 0
    CPU = 1
    DISK = 2

    @property
    def label(self) -> str:
        """"gpu", "cpu" or "disk": the tier's name in audits and eviction metadata."""
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


class BitmaskPrefixIndex:
    """Fast index: per tier, key -> bitmask of worker slots. Two derived masks keep a gpu-only
    fleet at one lookup per block: `_below_gpu` (workers holding the key on cpu or disk but not
    on gpu, so gpu | below-gpu is the any-tier mask) and `_aux` (below-gpu | speculative: every
    worker for whom the key counts without being on gpu). Both are empty in a gpu-only fleet
    with nothing in flight. Plus worker -> key set per tier, for removal and snapshots.

    A match costs one dict lookup and one AND per prompt block (two with tiers or speculation),
    independent of worker count until workers drop out of the match. Each walk leaves the deepest
    depth it reached in `_deepest` (what BoundedPrefixIndex marks, without a pass over the result).
    """

    __slots__ = ("_aux", "_below_gpu", "_deepest", "_speculative", "_tier_holders", "_worker_keys")

    def __init__(self) -> None:
        self._deepest = 0
        self._tier_holders: tuple[dict[int, int], ...] = tuple({} for _ in TIERS)
        self._below_gpu: dict[int, int] = {}
        self._speculative: dict[int, int] = {}
        self._aux: dict[int, int] = {}
        self._worker_keys: tuple[dict[int, set[int]], ...] = tuple({} for _ in TIERS)

    def store(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        held = self._worker_keys[tier].setdefault(worker, set())
        bit = 1 << worker
        holders, below, gpu = self._tier_holders[tier], self._below_gpu, self._tier_holders[Tier.GPU]
        on_gpu = tier == Tier.GPU
        added = 0
        for key in keys:
            if key in held:
                continue
            held.add(key)
            holders[key] = holders.get(key, 0) | bit
            if on_gpu:
                if below and below.get(key, 0) & bit:
                    self._set_below(key, bit, False)
            elif not gpu.get(key, 0) & bit:
                self._set_below(key, bit, True)
            added += 1
        return added

    def remove(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        held = self._worker_keys[tier].get(worker)
        if not held:
            return 0
        present = [key for key in dict.fromkeys(keys) if key in held]
        held.difference_update(present)
        self._forget(worker, present, tier)
        return len(present)

    def clear(self, worker: int) -> int:
        dropped = 0
        for tier in TIERS:
            held = self._worker_keys[tier].pop(worker, None)
            if held:
                self._forget(worker, held, tier)
                dropped += len(held)
        return dropped

    def _forget(self, worker: int, keys: Collection[int], tier: Tier) -> None:
        """Clear `worker`'s bit for `keys` on `tier` (already gone from its key set) and keep the
        below-gpu mask true to what the worker still holds on the other tiers."""
        bit = 1 << worker
        holders, below = self._tier_holders[tier], self._below_gpu
        if tier == Tier.GPU:
            cpu, disk = self._tier_holders[Tier.CPU], self._tier_holders[Tier.DISK]
            for key in keys:
                _clear_bit(holders, key, bit)
                if (cpu and cpu.get(key, 0) & bit) or (disk and disk.get(key, 0) & bit):
                    self._set_below(key, bit, True)  # still on cpu or disk: now only below gpu
            return
        other = self._tier_holders[Tier.DISK if tier == Tier.CPU else Tier.CPU]
        for key in keys:
            _clear_bit(holders, key, bit)
            if not other.get(key, 0) & bit and below.get(key, 0) & bit:
                self._set_below(key, bit, False)

    def _set_below(self, key: int, bit: int, on: bool) -> None:
        if on:
            self._below_gpu[key] = self._below_gpu.get(key, 0) | bit
            self._aux[key] = self._aux.get(key, 0) | bit
        else:
            _clear_bit(self._below_gpu, key, bit)
            if not self._speculative.get(key, 0) & bit:
                _clear_bit(self._aux, key, bit)

    def replace(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> None:
        wanted = set(keys)
        held = self._worker_keys[tier].get(worker, set())
        self.remove(worker, [k for k in held if k not in wanted], tier)
        self.store(worker, wanted, tier)

    def replace_all(self, worker: int, keys_by_tier: Mapping[Tier, Iterable[int]]) -> None:
        for tier in TIERS:
            self.replace(worker, keys_by_tier.get(tier, ()), tier)

    def speculate(self, worker: int, keys: Iterable[int]) -> None:
        bit = 1 << worker
        speculative, aux = self._speculative, self._aux
        for key in keys:
            speculative[key] = speculative.get(key, 0) | bit
            aux[key] = aux.get(key, 0) | bit

    def unspeculate(self, worker: int, keys: Iterable[int]) -> None:
        bit = 1 << worker
        speculative, below, aux = self._speculative, self._below_gpu, self._aux
        for key in keys:
            _clear_bit(speculative, key, bit)
            if not below.get(key, 0) & bit:
                _clear_bit(aux, key, bit)

    def held_prefix(self, worker: int, keys: Iterable[int]) -> int:
        held = [by_worker[worker] for by_worker in self._worker_keys if by_worker.get(worker)]
        depth = 0
        if len(held) == 1:  # the usual case: one tier (gpu) to look in
            only = held[0]
            for key in keys:
                if key not in only:
                    break
                depth += 1
            return depth
        for key in keys:
            if not any(key in tier_keys for tier_keys in held):
                break
            depth += 1
        return depth

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        self._deepest = 0
        if not keys:
            return {}
        holders = self._tier_holders[Tier.GPU]
        below = self._below_gpu
        alive = holders.get(keys[0], 0) | below.get(keys[0], 0)
        if not alive:
            return {}
        result: dict[int, int] = {}
        depth = 1
        # Iterate a list, not the caller's sequence: a protobuf repeated field is several times
        # slower to index, and this loop runs once per prompt block on every query.
        rest = list(keys) if not isinstance(keys, list) else keys
        get, below_get = holders.get, below.get
        depth = 1
        if below:  # some worker has tiers: any tier is gpu | below-gpu
            for key in islice(rest, 1, None):
                still = (get(key, 0) | below_get(key, 0)) & alive
                if still != alive:
                    _assign(result, alive & ~still, depth)
                    alive = still
                    if not alive:
                        self._deepest = depth
                        return result
                depth += 1
        else:
            for key in islice(rest, 1, None):
                still = get(key, 0) & alive
                if still != alive:
                    _assign(result, alive & ~still, depth)
                    alive = still
                    if not alive:
                        self._deepest = depth
                        return result
                depth += 1
        _assign(result, alive, len(rest))
        self._deepest = len(rest)
        return result

    def match_tiers(self, keys: Sequence[int]) -> TierMatch:
        aux = self._aux
        # No key of this prompt below gpu or claimed (the usual case: claims cover other prompts'
        # new tails): the plain walk is exact. The disjointness test is one C loop over aux, which
        # unless the fleet offloads holds only in-flight claims: small and cache-resident.
        if not aux:
            return TierMatch(BitmaskPrefixIndex.match(self, keys))
        if not isinstance(keys, list):
            keys = list(keys)  # once, not per pass (a protobuf repeated field is slow to iterate)
        if aux.keys().isdisjoint(keys):
            return TierMatch(BitmaskPrefixIndex.match(self, keys))
        gpu_get, aux_get = self._tier_holders[Tier.GPU].get, aux.get
        below_get, cpu_get = self._below_gpu.get, self._tier_holders[Tier.CPU].get
        tiered = bool(self._below_gpu)
        out = TierMatch()
        cpu_counts, disk_counts, spec_counts = out.cpu_blocks, out.disk_blocks, out.speculative_blocks
        # The cpu-only / disk-only / speculative-only masks mostly stay the same from block to block
        # (all zero on a plain gpu stretch), so counts follow their changes: a worker entering a
        # mask at position p is charged -p, leaving at q credited +q. Work is per change of a bit,
        # not per block and worker.
        cur_cpu = cur_disk = cur_spec = cur_any = 0
        alive = -1  # every bit: the first key decides who is in the walk
        end = len(keys)
        for pos, key in enumerate(keys):
            on_gpu = gpu_get(key, 0)
            off_gpu = aux_get(key, 0)
            still = (on_gpu | off_gpu) & alive
            if still != alive:
                if pos:
                    _assign(out.depth, alive & ~still, pos)
                alive = still
                if not alive:
                    end = pos
                    break
            if off_gpu or cur_any:
                off_gpu &= alive & ~on_gpu
                if off_gpu == cur_any and not tiered:
                    continue  # no tiers below gpu: off-gpu is speculative, and it did not change
                if off_gpu and tiered:
                    low = below_get(key, 0) & off_gpu
                    cpu_only = cpu_get(key, 0) & low if low else 0
                    disk_only, vouched = low ^ cpu_only, off_gpu ^ low
                else:
                    cpu_only, disk_only, vouched = 0, 0, off_gpu
                if cpu_only != cur_cpu:
                    _shift(cpu_counts, cur_cpu, cpu_only, pos)
                    cur_cpu = cpu_only
                if disk_only != cur_disk:
                    _shift(disk_counts, cur_disk, disk_only, pos)
                    cur_disk = disk_only
                if vouched != cur_spec:
                    _shift(spec_counts, cur_spec, vouched, pos)
                    cur_spec = vouched
                cur_any = off_gpu
        else:
            if end:
                _assign(out.depth, alive, end)
        if cur_any:
            _shift(cpu_counts, cur_cpu, 0, end)
            _shift(disk_counts, cur_disk, 0, end)
            _shift(spec_counts, cur_spec, 0, end)
        self._deepest = end
        return out

    def worker_keys(self, worker: int, tier: Tier) -> set[int]:
        return set(self._worker_keys[tier].get(worker, ()))

    def worker_block_count(self, worker: int, tier: Tier | None = None) -> int:
        if tier is not None:
            return len(self._worker_keys[tier].get(worker, ()))
        return sum(len(by_worker.get(worker, ())) for by_worker in self._worker_keys)

    def entry_count(self) -> int:
        return sum(len(s) for by_worker in self._worker_keys for s in by_worker.values())

    def evicted_entries(self, worker: int) -> Mapping[Tier, int]:
        return NO_EVICTIONS

    def estimated_bytes(self) -> int:
        """Memory held by the index's containers and the int objects in them, estimated in O(workers)
        (`kvroute bench ingest` measures the real figure with tracemalloc; the two agree within ~10%).
        Every entry is one set slot and, about, one key object (the caller's; a key several workers
        hold is one object per worker); every key one dict slot and one mask object per tier dict
        holding it. Object sizes are sampled from the first keys and masks."""
        holders = (*self._tier_holders, self._below_gpu, self._speculative, self._aux)
        total = sum(sys.getsizeof(d) for d in holders)
        total += sum(sys.getsizeof(s) for by_worker in self._worker_keys for s in by_worker.values())
        total += sum(sys.getsizeof(by_worker) for by_worker in self._worker_keys)
        total += self.entry_count() * _mean_int_size(self._tier_holders[Tier.GPU].keys())
        total += sum(len(d) * _mean_int_size(d.values()) for d in holders)
        return total


def _mean_int_size(ints: Iterable[int], sample: int = 256) -> float:
    """Mean size of the first `sample` ints (0 for none); cached small ints (masks of the first workers) cost 0."""
    sizes = [0 if -5 <= i <= 256 else sys.getsizeof(i) for i in islice(ints, sample)]
    return sum(sizes) / len(sizes) if sizes else 36.0


def _clear_bit(holders: dict[int, int], key: int, bit: int) -> None:
    mask = holders.get(key, 0) & ~bit
    if mask:
        holders[key] = mask
    else:
        holders.pop(key, None)


def _assign(result: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        result[low.bit_length() - 1] = depth
        mask ^= low


def _shift(counts: dict[int, int], before: int, after: int, pos: int) -> None:
    """Workers leaving the mask at `pos` are credited pos, workers entering it charged pos."""
    for mask, sign in ((before & ~after, pos), (after & ~before, -pos)):
        while mask:
            low = mask & -mask
            worker = low.bit_length() - 1
            counts[worker] = counts.get(worker, 0) + sign
            mask ^= low


@dataclass(slots=True)
class EvictionCounters:
    keys: int = 0                      # keys dropped for the bound (each with every worker's entries, on every tier)
    entries: int = 0                   # (key, worker, tier) entries dropped
    recently_matched_entries: int = 0  # of those, on keys still marked recently matched: the bound is below the
                                       # working set (the second chances of one eviction ran out)


class BoundedPrefixIndex(BitmaskPrefixIndex):
    """A BitmaskPrefixIndex of at most `max_entries` (key, worker, tier) entries. Past the bound it
    drops whole keys (every worker's entries of the key, on every tier) that no query matched
    recently, by the CLOCK algorithm (a second chance for recently used keys):

    - The clock is a deque of every key the index holds, each once. New keys join at its back, a
      store's keys deepest first, so that the hand reaches a chain's later blocks before their
      ancestors: dropping an ancestor would make every descendant unreachable for that prompt.
    - A walk (`match`, `match_tiers`) marks its matched prefix as recently matched, in a set per lap
      (`_marked_now`, and the previous lap's `_marked_before`). A chained key stands for its whole
      prefix, and a key is only ever marked with all its ancestors, so the marked part of a chain is
      a prefix of it: bisection finds where it ends and only the rest is added. A prefix already
      marked this lap costs one lookup; the walk's own loop is unchanged.
    - To make room, the hand takes the front key: marked this lap or the last, it goes to the back
      (its second chance); otherwise it is dropped. A lap ends when the hand has passed every key
      once, or when one lap's marks exceed a quarter of the keys (which bounds their memory). A key
      that keeps being matched stays; one neither matched nor stored for a lap or two goes first.
      Second chances are capped per eviction (64, plus 8 per entry over the bound), so a working set
      larger than the bound cannot make one store scan the whole index: the hand then drops marked
      keys too, and counts them (`EvictionCounters.recently_matched_entries`).
    - Keys that leave on their own (removed, cleared) wait in `_departed` until the hand passes them,
      and a key stored again meanwhile takes its old place, so each key is in the clock once. While
      departed keys exceed an eighth of the clock, each departure moves the hand ~8 keys.

    Dropping keys only shortens matches: the match of any chain is, per worker, the unbounded match
    cut at the first dropped key, so routers under-claim, never over-claim. Speculative claims are
    not entries: never counted against the bound and never dropped here (their reservations own
    them, kvroute.control_plane.inflight). A worker that lost entries to the bound keeps the count
    (`evicted_entries`) until its next snapshot or clear: keys it may still hold that the index no
    longer knows (the audit and the replicas' snapshot writer read it).
    """

    __slots__ = ("_departed", "_entries", "_evicted", "_lap_left", "_marked_before", "_marked_now", "_ring",
                 "counters", "max_entries")

    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        super().__init__()
        self.max_entries = max_entries
        self.counters = EvictionCounters()
        self._entries = 0
        self._ring: deque[int] = deque()
        self._departed: set[int] = set()
        self._marked_now: set[int] = set()
        self._marked_before: set[int] = set()
        self._lap_left = 0
        self._evicted: dict[int, list[int]] = {}  # slot -> entries dropped per tier since its last snapshot/clear

    # ------------------------------------------------------------ entries in and out

    def store(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        keys = list(dict.fromkeys(keys))
        gpu, below = self._tier_holders[Tier.GPU], self._below_gpu
        fresh = [key for key in keys if key not in gpu and key not in below]  # new to the index
        added = super().store(worker, keys, tier)
        self._entries += added
        if fresh:
            departed = self._departed
            back = departed.intersection(fresh) if departed else None
            if back:  # still in the clock: they keep their place
                departed -= back
                fresh = [key for key in fresh if key not in back]
            self._ring.extend(reversed(fresh))
        if self._entries > self.max_entries:
            self._evict()
        return added

    def _forget(self, worker: int, keys: Collection[int], tier: Tier) -> None:
        super()._forget(worker, keys, tier)  # remove and clear come here with what the worker held
        self._entries -= len(keys)
        self._depart(keys)

    def clear(self, worker: int) -> int:
        self._evicted.pop(worker, None)
        return super().clear(worker)

    def replace_all(self, worker: int, keys_by_tier: Mapping[Tier, Iterable[int]]) -> None:
        self._evicted.pop(worker, None)  # a snapshot is the worker's whole truth: nothing is unknown any more
        super().replace_all(worker, keys_by_tier)

    def entry_count(self) -> int:
        return self._entries

    def evicted_entries(self, worker: int) -> Mapping[Tier, int]:
        counts = self._evicted.get(worker)
        return {tier: counts[tier] for tier in TIERS if counts[tier]} if counts else NO_EVICTIONS

    def workers_with_evictions(self) -> int:
        return len(self._evicted)

    def estimated_bytes(self) -> int:
        marks = (self._marked_now, self._marked_before, self._departed)
        # Marked keys are the queries' own int objects; departed ones only the clock keeps alive.
        return (super().estimated_bytes() + sys.getsizeof(self._ring) + sum(sys.getsizeof(s) for s in marks)
                + sum(len(s) for s in marks) * _mean_int_size(self._ring))

    # ------------------------------------------------------------ walks mark what they matched

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        if not isinstance(keys, list):
            keys = list(keys)
        result = BitmaskPrefixIndex.match(self, keys)
        deepest = self._deepest
        if deepest and keys[deepest - 1] not in self._marked_now:
            self._mark(keys, deepest)
        return result

    def match_tiers(self, keys: Sequence[int]) -> TierMatch:
        if not isinstance(keys, list):
            keys = list(keys)
        out = BitmaskPrefixIndex.match_tiers(self, keys)
        deepest = self._deepest
        if deepest and keys[deepest - 1] not in self._marked_now:  # else: all of it marked this lap already
            self._mark(keys, deepest)
        return out

    def _mark(self, keys: list[int], depth: int) -> None:
        """Mark keys[:depth] recently matched (keys[depth - 1] is not yet): what is unmarked is a suffix."""
        marked = self._marked_now
        lo, hi = 0, depth - 1  # keys[hi] is not marked; find the first key that is not
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] in marked:
                lo = mid + 1
            else:
                hi = mid
        marked.update(islice(keys, lo, depth))
        if len(marked) > max(len(self._ring) >> 2, 4096):
            self._new_lap()

    # ------------------------------------------------------------ the clock

    def _hand(self) -> int:
        key = self._ring.popleft()
        self._lap_left -= 1
        if self._lap_left <= 0:
            self._new_lap()
        return key

    def _new_lap(self) -> None:
        self._marked_before, self._marked_now = self._marked_now, set()
        self._lap_left = len(self._ring) + 1

    def _evict(self) -> None:
        ring, departed = self._ring, self._departed
        chances = 64 + 8 * (self._entries - self.max_entries)
        while self._entries > self.max_entries and ring:
            key = self._hand()
            if key in departed:
                departed.remove(key)
                continue
            recent = key in self._marked_now or key in self._marked_before
            if recent and chances > 0:
                chances -= 1
                ring.append(key)
                continue
            self._drop(key, recent)

    def _drop(self, key: int, recent: bool) -> None:
        """Forget every worker's entries of `key` on every tier (claims on it stay)."""
        dropped = 0
        evicted = self._evicted
        for tier in TIERS:
            mask = self._tier_holders[tier].pop(key, 0)
            by_worker = self._worker_keys[tier]
            while mask:
                low = mask & -mask
                worker = low.bit_length() - 1
                mask ^= low
                by_worker[worker].discard(key)
                counts = evicted.get(worker)
                if counts is None:
                    counts = evicted[worker] = [0] * len(TIERS)
                counts[tier] += 1
                dropped += 1
        if self._below_gpu.pop(key, 0):  # aux is below-gpu | claims: what remains is the claims
            claims = self._speculative.get(key, 0)
            if claims:
                self._aux[key] = claims
            else:
                self._aux.pop(key, None)
        self._entries -= dropped
        self.counters.keys += 1
        self.counters.entries += dropped
        if recent:
            self.counters.recently_matched_entries += dropped

    def _depart(self, keys: Iterable[int]) -> None:
        """`keys` lost entries: those no worker holds on any tier now wait for the hand."""
        gpu, below = self._tier_holders[Tier.GPU], self._below_gpu
        gone = [key for key in keys if key not in gpu and key not in below]
        if not gone:
            return
        ring, departed = self._ring, self._departed
        departed.update(gone)
        steps = 64 + 8 * len(gone)
        while steps and len(departed) * 8 > len(ring):
            key = self._hand()
            if key in departed:
                departed.remove(key)
            else:
                ring.append(key)
            steps -= 1


class SetPrefixIndex:
    """Reference index: (worker, tier) -> set of keys, and worker -> speculative keys. Obviously
    correct, O(workers) per block; kept as the oracle the conformance suite compares the fast
    index against."""

    def __init__(self) -> None:
        self._worker_keys: dict[int, list[set[int]]] = {}
        self._speculative: dict[int, set[int]] = {}

    def _tiers(self, worker: int) -> list[set[int]]:
        return self._worker_keys.setdefault(worker, [set() for _ in TIERS])

    def store(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        held = self._tiers(worker)[tier]
        before = len(held)
        held.update(keys)
        return len(held) - before

    def remove(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> int:
        held = self._tiers(worker)[tier]
        before = len(held)
        held.difference_update(keys)
        return before - len(held)

    def clear(self, worker: int) -> int:
        return sum(len(held) for held in self._worker_keys.pop(worker, []))

    def replace(self, worker: int, keys: Iterable[int], tier: Tier = Tier.GPU) -> None:
        self._tiers(worker)[tier] = set(keys)

    def replace_all(self, worker: int, keys_by_tier: Mapping[Tier, Iterable[int]]) -> None:
        self._worker_keys[worker] = [set(keys_by_tier.get(tier, ())) for tier in TIERS]

    def speculate(self, worker: int, keys: Iterable[int]) -> None:
        self._speculative.setdefault(worker, set()).update(keys)

    def unspeculate(self, worker: int, keys: Iterable[int]) -> None:
        self._speculative.get(worker, set()).difference_update(keys)

    def held_prefix(self, worker: int, keys: Iterable[int]) -> int:
        return self._walk(list(keys), with_speculation=False).depth.get(worker, 0)

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        return self._walk(keys, with_speculation=False).depth

    def match_tiers(self, keys: Sequence[int]) -> TierMatch:
        return self._walk(keys, with_speculation=True)

    def _walk(self, keys: Sequence[int], with_speculation: bool) -> TierMatch:
        out = TierMatch()
        for worker in set(self._worker_keys) | (set(self._speculative) if with_speculation else set()):
            gpu, cpu, disk = self._worker_keys.get(worker, [set(), set(), set()])
            speculative = self._speculative.get(worker, set()) if with_speculation else set()
            depth = 0
            counts = {"cpu": 0, "disk": 0, "spec": 0}
            for key in keys:
                if key in gpu:
                    pass
                elif key in cpu:
                    counts["cpu"] += 1
                elif key in disk:
                    counts["disk"] += 1
                elif key in speculative:
                    counts["spec"] += 1
                else:
                    break
                depth += 1
            if depth:
                out.depth[worker] = depth
                for name, target in (("cpu", out.cpu_blocks), ("disk", out.disk_blocks),
                                     ("spec", out.speculative_blocks)):
                    if counts[name]:
                        target[worker] = counts[name]
        return out

    def worker_keys(self, worker: int, tier: Tier) -> set[int]:
        return set(self._worker_keys.get(worker, [set()] * len(TIERS))[tier])

    def worker_block_count(self, worker: int, tier: Tier | None = None) -> int:
        held = self._worker_keys.get(worker, [set()] * len(TIERS))
        return len(held[tier]) if tier is not None else sum(len(s) for s in held)

    def entry_count(self) -> int:
        return sum(len(s) for tiers in self._worker_keys.values() for s in tiers)

    def evicted_entries(self, worker: int) -> Mapping[Tier, int]:
        return NO_EVICTIONS
