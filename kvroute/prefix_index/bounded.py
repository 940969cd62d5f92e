"""`BoundedPrefixIndex`: a `BitmaskPrefixIndex` of at most N entries, evicting by CLOCK."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from kvroute.prefix_index.base import NO_EVICTIONS, TIERS, Tier, TierMatch
from kvroute.prefix_index.bitmask import BitmaskPrefixIndex, mean_int_size


@dataclass(slots=True)
class EvictionCounters:
    keys: int = 0  # keys dropped for the bound (each with every worker's entries, on every tier)
    entries: int = 0  # (key, worker, tier) entries dropped
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
    them, kvroute.fleet.inflight). A worker that lost entries to the bound keeps the count
    (`evicted_entries`) until its next snapshot or clear: keys it may still hold that the index no
    longer knows (the audit and the replicas' snapshot writer read it).
    """

    __slots__ = (
        "_departed",
        "_entries",
        "_evicted",
        "_lap_left",
        "_marked_before",
        "_marked_now",
        "_ring",
        "counters",
        "max_entries",
    )

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
        return (
            super().estimated_bytes()
            + sys.getsizeof(self._ring)
            + sum(sys.getsizeof(s) for s in marks)
            + sum(len(s) for s in marks) * mean_int_size(self._ring)
        )

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
