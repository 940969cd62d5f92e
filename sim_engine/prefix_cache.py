"""A vLLM-like paged prefix cache, pure and clock-free (the fleet simulator reuses it).

N blocks of B tokens. Full blocks are identified by an engine-style chained hash (SHA-256
over the parent digest and the block's tokens, seeded per process like vLLM's NONE_HASH),
deliberately unlike kvroute's keys so nothing downstream can depend on engine hashes.
Blocks pinned by running requests are never evicted; cached blocks no request uses sit in an
LRU queue and are evicted oldest-first only when an allocation needs room, emitting
BlockRemoved. Newly filled full blocks are cached and emit BlockStored.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class StoredEvent:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]


@dataclass(slots=True)
class RemovedEvent:
    block_hashes: list[int]


@dataclass(slots=True)
class ClearedEvent:
    pass


CacheEvent = StoredEvent | RemovedEvent | ClearedEvent


@dataclass(slots=True)
class Allocation:
    """What one request holds: its pinned cached blocks plus uncached working blocks."""
    pinned_hashes: list[int] = field(default_factory=list)
    working_blocks: int = 0
    hit_tokens: int = 0


class CacheFullError(RuntimeError):
    pass


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: str | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        seed = hash_seed.encode() if hash_seed is not None else os.urandom(32)
        self._none_hash = int.from_bytes(hashlib.sha256(b"sim-none-hash" + seed).digest()[-8:], "big")
        self._refcount: dict[int, int] = {}            # cached hash -> pinning requests
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unpinned, oldest first
        self._working = 0                               # uncached blocks held by requests
        self.events: list[CacheEvent] = []
        self.queries_tokens = 0
        self.hits_tokens = 0

    # ---------------------------------------------------------------- hashing

    def chain_hashes(self, token_ids: Sequence[int], parent: int | None = None) -> list[int]:
        h = self._none_hash if parent is None else parent
        out = []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            packed = array("I", token_ids[i * bs:(i + 1) * bs]).tobytes()
            digest = hashlib.sha256(h.to_bytes(8, "big") + packed).digest()
            h = int.from_bytes(digest[-8:], "big")  # vLLM's int form: last 8 bytes, big-endian
            out.append(h)
        return out

    # ---------------------------------------------------------------- capacity

    @property
    def cached_blocks(self) -> int:
        return len(self._refcount)

    @property
    def used_blocks(self) -> int:
        return len(self._refcount) - len(self._lru) + self._working

    def free_blocks(self) -> int:
        return self.num_blocks - len(self._refcount) - self._working

    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def true_block_hashes(self) -> list[int]:
        return list(self._refcount)

    def _make_room(self, blocks: int) -> bool:
        if self.free_blocks() + len(self._lru) < blocks:
            return False
        while self.free_blocks() < blocks:
            victim, _ = self._lru.popitem(last=False)
            del self._refcount[victim]
            self.events.append(RemovedEvent([victim]))  # vLLM: one BlockRemoved per evicted block
        return True

    # ---------------------------------------------------------------- request lifecycle

    def longest_cached_prefix(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._refcount:
                break
            n += 1
        return n

    def allocate(self, prompt_hashes: Sequence[int], prompt_len: int, total_tokens: int) -> Allocation | None:
        """Pin the cached prefix and reserve the rest; None if it does not fit right now."""
        bs = self.block_size
        hit_blocks = self.longest_cached_prefix(prompt_hashes)
        # Like vLLM, the last prompt token is always computed, so a full hit recomputes one block.
        hit_blocks = min(hit_blocks, (prompt_len - 1) // bs)
        needed_total = -(-total_tokens // bs)
        if needed_total > self.num_blocks:
            raise CacheFullError(f"request needs {needed_total} KV blocks, cache has {self.num_blocks}")
        pinned = list(prompt_hashes[:hit_blocks])
        for h in pinned:  # pin first so eviction below cannot take them
            if self._refcount[h] == 0:
                del self._lru[h]
            self._refcount[h] += 1
        working = needed_total - hit_blocks
        if not self._make_room(working):
            self._unpin(pinned)
            return None
        self._working += working
        self.queries_tokens += prompt_len
        self.hits_tokens += hit_blocks * bs
        return Allocation(pinned_hashes=pinned, working_blocks=working, hit_tokens=hit_blocks * bs)

    def commit(self, alloc: Allocation, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Cache newly full blocks `hashes` (continuing the request's chain) covering `token_ids`."""
        parent = alloc.pinned_hashes[-1] if alloc.pinned_hashes else None
        new_hashes = []
        for h in hashes:
            alloc.working_blocks -= 1
            self._working -= 1
            if h in self._refcount:  # computed concurrently by another request: share it
                if self._refcount[h] == 0:
                    del self._lru[h]
                self._refcount[h] += 1
            else:
                self._refcount[h] = 1
                new_hashes.append(h)
            alloc.pinned_hashes.append(h)
        if new_hashes:
            self._emit_stored(hashes, new_hashes, token_ids, parent)

    def _emit_stored(self, hashes: Sequence[int], new_hashes: list[int], token_ids: Sequence[int],
                     parent: int | None) -> None:
        """One BlockStored per run of consecutive new blocks; a shared block in between splits it."""
        bs = self.block_size
        new_set = set(new_hashes)
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_parent = prev = parent
        for i, h in enumerate(hashes):
            if h in new_set:
                if not run_hashes:
                    run_parent = prev
                run_hashes.append(h)
                run_tokens.extend(token_ids[i * bs:(i + 1) * bs])
            elif run_hashes:
                self.events.append(StoredEvent(run_hashes, run_parent, run_tokens))
                run_hashes, run_tokens = [], []
            prev = h
        if run_hashes:
            self.events.append(StoredEvent(run_hashes, run_parent, run_tokens))

    def release(self, alloc: Allocation) -> None:
        self._unpin(alloc.pinned_hashes)
        self._working -= alloc.working_blocks
        alloc.pinned_hashes, alloc.working_blocks = [], 0

    def _unpin(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            count = self._refcount[h] - 1
            self._refcount[h] = count
            if count == 0:
                self._lru[h] = None  # most recently used end

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: only when nothing is pinned."""
        if self.used_blocks:
            return False
        self._refcount.clear()
        self._lru.clear()
        self.events.append(ClearedEvent())
        return True

    def take_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events
