"""`SetPrefixIndex`: the reference index, obviously correct and slow; the conformance suite's oracle."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvroute.prefix_index.base import NO_EVICTIONS, TIERS, Tier, TierMatch


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
                for name, target in (("cpu", out.cpu_blocks), ("disk", out.disk_blocks), ("spec", out.speculative_blocks)):
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
