"""A vLLM-like paged prefix cache, pure and clock-free (the fleet simulator reuses it).

N blocks of B tokens. Full blocks are identified by an engine-style chained hash: a 128-bit
xxh3 over the parent block's hash and the block's tokens, cut to 64 bits (like vLLM >= 0.13's
`--prefix-caching-hash-algo xxhash`, though our input layout is our own; a fast hash keeps the
simulator fast), the chain seeded by a
per-process random NONE_HASH (like vLLM before 0.29 without PYTHONHASHSEED) unless a
`hash_seed` is given. Hashes are unsigned 64-bit ints, as vLLM >= 0.10.2 puts them on the wire. These hashes are deliberately unlike kvroute's block keys, so
nothing downstream can get away with comparing engine hashes.

Life of a block, as in vLLM's BlockPool:
- `allocate()` looks a request's full prompt blocks up by hash (longest cached prefix, capped
  so the last prompt token is always computed), pins the hit blocks (ref count) and reserves
  working blocks for the rest of the request (prompt + max_tokens; reserving up front means
  the scheduler never has to preempt).
- `commit()` turns newly full working blocks into cached blocks and records BlockStored
  (one event per run of new blocks, with `parent_block_hash` and the run's token ids).
  A block another request already cached under the same hash is shared, not stored twice.
- `release()` unpins; a cached block nobody pins goes to the most-recently-used end of an
  LRU free queue, the request's tail blocks first (vLLM frees in reverse so a prefix's last
  blocks are evicted before its first ones).
- Cached unpinned blocks are evicted oldest first only when an allocation needs room; each
  eviction records one BlockRemoved (vLLM sends one per evicted block).
- `reset()` is vLLM's reset_prefix_cache: refused while any block is in use, else drops every
  cached block and records AllBlocksCleared.

Accounting (vLLM's prefix-cache stats): every admitted request adds its prompt length to
`queries_tokens` and its cached tokens used to `hits_tokens`. Events accumulate until
`take_events()`.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvroute.block_keys import pack_token_ids

_xxh3_128 = xxhash.xxh3_128_intdigest
_U64 = (1 << 64) - 1



@dataclass(slots=True)
class StoredEvent:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]  # a list, or array('I') when the request's tokens are packed


@dataclass(slots=True)
class RemovedEvent:
    block_hashes: list[int]


@dataclass(slots=True)
class ClearedEvent:
    pass


CacheEvent = StoredEvent | RemovedEvent | ClearedEvent


@dataclass(slots=True)
class Allocation:
    """What one request holds: its pinned cached blocks (chain order) plus uncached working blocks."""
    pinned_hashes: list[int] = field(default_factory=list)
    working_blocks: int = 0
    hit_tokens: int = 0


class CacheFullError(ValueError):
    """The request can never fit: it needs more blocks than the whole cache has."""


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: str | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        seed = hash_seed.encode() if hash_seed is not None else os.urandom(32)
        self.none_hash = int.from_bytes(hashlib.sha256(b"sim-none-hash" + seed).digest()[-8:], "big")
        self._refcount: dict[int, int] = {}                # cached hash -> pinning requests
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached and unpinned, least recently used first
        self._working = 0                                  # uncached blocks reserved by requests
        self.events: list[CacheEvent] = []
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.queries_requests = 0
        self.evicted_blocks = 0

    # ---------------------------------------------------------------- hashing

    def chain_hashes(self, token_ids: Sequence[int], parent: int | None = None) -> list[int]:
        """Hashes of the full blocks of `token_ids`, chained from `parent` (None = first block)."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return []
        data = memoryview(pack_token_ids(token_ids[: n * bs]).tobytes())
        stride = 4 * bs
        h = self.none_hash if parent is None else parent
        out = [0] * n
        for i in range(n):
            h = _xxh3_128(h.to_bytes(8, "big") + data[i * stride:(i + 1) * stride]) & _U64
            out[i] = h
        return out

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---------------------------------------------------------------- capacity

    @property
    def cached_blocks(self) -> int:
        return len(self._refcount)

    @property
    def evictable_blocks(self) -> int:
        return len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks in use by requests (pinned cached + reserved working); vLLM's KV usage numerator."""
        return len(self._refcount) - len(self._lru) + self._working

    def free_blocks(self) -> int:
        """Blocks holding nothing at all (not counting evictable cached blocks)."""
        return self.num_blocks - len(self._refcount) - self._working

    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def true_block_hashes(self) -> list[int]:
        """Every block hash currently cached (pinned or evictable): the ground truth for audits."""
        return list(self._refcount)

    def _evict_until_free(self, blocks: int) -> None:
        while self.free_blocks() < blocks:
            victim, _ = self._lru.popitem(last=False)
            del self._refcount[victim]
            self.evicted_blocks += 1
            self.events.append(RemovedEvent([victim]))

    # ---------------------------------------------------------------- request lifecycle

    def longest_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` that are cached."""
        n = 0
        for h in hashes:
            if h not in self._refcount:
                break
            n += 1
        return n

    def check_fits(self, total_tokens: int) -> None:
        needed = self.blocks_for(total_tokens)
        if needed > self.num_blocks:
            raise CacheFullError(f"request needs {needed} KV blocks ({total_tokens} tokens of {self.block_size}) "
                                 f"but the KV cache only has {self.num_blocks} blocks")

    def allocate(self, prompt_hashes: Sequence[int], prompt_len: int, total_tokens: int) -> Allocation | None:
        """Pin the cached prefix and reserve the rest; None (nothing changed) if it does not fit right now.

        Raises CacheFullError if it could never fit.
        """
        self.check_fits(total_tokens)
        bs = self.block_size
        hit_blocks = self.longest_cached_prefix(prompt_hashes)
        # Like vLLM, the last prompt token is always computed, so a full hit recomputes one block.
        hit_blocks = min(hit_blocks, max(prompt_len - 1, 0) // bs)
        pinned = list(prompt_hashes[:hit_blocks])
        working = self.blocks_for(total_tokens) - hit_blocks
        hit_evictable = sum(1 for h in pinned if self._refcount[h] == 0)
        if self.free_blocks() + len(self._lru) - hit_evictable < working:
            return None
        for h in pinned:  # pin first so the eviction below cannot take them
            if self._refcount[h] == 0:
                del self._lru[h]
            self._refcount[h] += 1
        self._evict_until_free(working)
        self._working += working
        self.queries_requests += 1
        self.queries_tokens += prompt_len
        self.hits_tokens += hit_blocks * bs
        return Allocation(pinned_hashes=pinned, working_blocks=working, hit_tokens=hit_blocks * bs)

    def commit(self, alloc: Allocation, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Cache newly full blocks `hashes` (continuing the request's chain) covering `token_ids`."""
        if len(hashes) > alloc.working_blocks:
            raise ValueError("commit of more blocks than the request reserved")
        parent = alloc.pinned_hashes[-1] if alloc.pinned_hashes else None
        new_hashes = set()
        for h in hashes:
            alloc.working_blocks -= 1
            self._working -= 1
            if h in self._refcount:  # computed concurrently by another request: share it
                if self._refcount[h] == 0:
                    del self._lru[h]
                self._refcount[h] += 1
            else:
                self._refcount[h] = 1
                new_hashes.add(h)
            alloc.pinned_hashes.append(h)
        if new_hashes:
            self._emit_stored(hashes, new_hashes, token_ids, parent)

    def _emit_stored(self, hashes: Sequence[int], new_hashes: set[int], token_ids: Sequence[int],
                     parent: int | None) -> None:
        """One BlockStored per run of consecutive new blocks; a shared block in between splits it."""
        start = None  # first block of the current run of new blocks
        for i, h in enumerate(hashes):
            if h in new_hashes:
                if start is None:
                    start = i
            elif start is not None:
                self._store_run(hashes, token_ids, start, i, parent)
                start = None
        if start is not None:
            self._store_run(hashes, token_ids, start, len(hashes), parent)

    def _store_run(self, hashes: Sequence[int], token_ids: Sequence[int], start: int, end: int,
                   parent: int | None) -> None:
        bs = self.block_size
        run_parent = hashes[start - 1] if start else parent
        self.events.append(StoredEvent(list(hashes[start:end]), run_parent, token_ids[start * bs:end * bs]))

    def release(self, alloc: Allocation) -> None:
        """The request is finished (or aborted): unpin its blocks, tail first, and drop its reservation."""
        self._unpin(reversed(alloc.pinned_hashes))
        self._working -= alloc.working_blocks
        alloc.pinned_hashes, alloc.working_blocks = [], 0

    def _unpin(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            count = self._refcount[h] - 1
            self._refcount[h] = count
            if count == 0:
                self._lru[h] = None  # most recently used end

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: refused (False) while any block is in use."""
        if self.used_blocks:
            return False
        self._refcount.clear()
        self._lru.clear()
        self.events.append(ClearedEvent())
        return True

    def take_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events
