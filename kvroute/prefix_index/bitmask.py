"""`BitmaskPrefixIndex`: per tier, block key -> bitmask of worker slots (the fast pure-Python index)."""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import islice

from kvroute.prefix_index.base import NO_EVICTIONS, TIERS, Tier, TierMatch


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
        total += self.entry_count() * mean_int_size(self._tier_holders[Tier.GPU].keys())
        total += sum(len(d) * mean_int_size(d.values()) for d in holders)
        return total


def mean_int_size(ints: Iterable[int], sample: int = 256) -> float:
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
