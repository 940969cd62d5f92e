"""Prefix indexes: which workers hold which kvroute block keys.

Workers are identified by small dense integers (slots) handed out by the registry, so the
fast index can keep one int bitmask per block key. Both implementations satisfy the same
`PrefixIndex` protocol and are checked by one conformance suite
(tests/test_control_plane_index_conformance.py).

Semantics (shared by all implementations):
- store/remove are idempotent set operations per (worker, key).
- match(keys) walks a chained key sequence from the start and returns, per worker, how many
  leading keys it holds without a hole: the engine's own prefix match stops at the first
  missing block, so a hole ends the match even if later keys are present.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class PrefixIndex(Protocol):
    def store(self, worker: int, keys: Iterable[int]) -> int:
        """Record that `worker` holds `keys`; returns how many were new."""

    def remove(self, worker: int, keys: Iterable[int]) -> int:
        """Forget `keys` on `worker`; returns how many were present."""

    def clear(self, worker: int) -> int:
        """Forget everything `worker` holds; returns how many keys it held."""

    def replace(self, worker: int, keys: Iterable[int]) -> None:
        """Make `keys` exactly the set `worker` holds (snapshot after a reconnect)."""

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        """Per worker holding keys[0]: length of the longest held prefix of `keys`."""

    def worker_block_count(self, worker: int) -> int: ...

    def entry_count(self) -> int:
        """Number of (key, worker) pairs held."""


class BitmaskPrefixIndex:
    """Fast index: key -> bitmask of worker slots, plus worker -> key set for removal.

    A match costs one dict lookup and one AND per prompt block, independent of worker count
    until workers drop out of the match.
    """

    __slots__ = ("_holders", "_worker_keys")

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._worker_keys: dict[int, set[int]] = {}

    def store(self, worker: int, keys: Iterable[int]) -> int:
        held = self._worker_keys.setdefault(worker, set())
        bit = 1 << worker
        holders = self._holders
        added = 0
        for key in keys:
            if key not in held:
                held.add(key)
                holders[key] = holders.get(key, 0) | bit
                added += 1
        return added

    def remove(self, worker: int, keys: Iterable[int]) -> int:
        held = self._worker_keys.get(worker)
        if not held:
            return 0
        present = [key for key in dict.fromkeys(keys) if key in held]
        held.difference_update(present)
        self._drop_holder(worker, present)
        return len(present)

    def clear(self, worker: int) -> int:
        held = self._worker_keys.pop(worker, None)
        if not held:
            return 0
        self._drop_holder(worker, held)
        return len(held)

    def _drop_holder(self, worker: int, keys: Iterable[int]) -> None:
        clear_bit = ~(1 << worker)
        holders = self._holders
        for key in keys:
            mask = holders[key] & clear_bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]

    def replace(self, worker: int, keys: Iterable[int]) -> None:
        wanted = set(keys)
        held = self._worker_keys.get(worker, set())
        self.remove(worker, [k for k in held if k not in wanted])
        self.store(worker, wanted)

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        if not keys:
            return {}
        holders = self._holders
        alive = holders.get(keys[0], 0)
        if not alive:
            return {}
        result: dict[int, int] = {}
        depth = 1
        for depth in range(1, len(keys)):
            still = holders.get(keys[depth], 0) & alive
            if still != alive:
                _assign(result, alive & ~still, depth)
                alive = still
                if not alive:
                    return result
        _assign(result, alive, len(keys))
        return result

    def worker_block_count(self, worker: int) -> int:
        return len(self._worker_keys.get(worker, ()))

    def entry_count(self) -> int:
        return sum(len(s) for s in self._worker_keys.values())


def _assign(result: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        result[low.bit_length() - 1] = depth
        mask ^= low


class SetPrefixIndex:
    """Reference index: worker -> set of keys. Obviously correct, O(workers) per block;
    kept as the oracle the conformance suite compares the fast index against."""

    def __init__(self) -> None:
        self._worker_keys: dict[int, set[int]] = {}

    def store(self, worker: int, keys: Iterable[int]) -> int:
        held = self._worker_keys.setdefault(worker, set())
        before = len(held)
        held.update(keys)
        return len(held) - before

    def remove(self, worker: int, keys: Iterable[int]) -> int:
        held = self._worker_keys.get(worker, set())
        before = len(held)
        held.difference_update(keys)
        return before - len(held)

    def clear(self, worker: int) -> int:
        return len(self._worker_keys.pop(worker, set()))

    def replace(self, worker: int, keys: Iterable[int]) -> None:
        self._worker_keys[worker] = set(keys)

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        result = {}
        for worker, held in self._worker_keys.items():
            depth = 0
            while depth < len(keys) and keys[depth] in held:
                depth += 1
            if depth:
                result[worker] = depth
        return result

    def worker_block_count(self, worker: int) -> int:
        return len(self._worker_keys.get(worker, ()))

    def entry_count(self) -> int:
        return sum(len(s) for s in self._worker_keys.values())
