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
  (one event per run of new blocks, with `parent_block_hash` and the run's token ids); the
  scheduler commits per scheduled chunk, so one prompt's blocks come in several events.
  A block another request already cached under the same hash is shared, not stored twice
  (vLLM keeps a second copy and announces it again).
- `release()` unpins; a cached block nobody pins goes to the most-recently-used end of an
  LRU free queue, the request's tail blocks first (vLLM frees in reverse so a prefix's last
  blocks are evicted before its first ones).
- Cached unpinned blocks are evicted oldest first only when an allocation needs room; each
  eviction records one BlockRemoved (vLLM sends one per evicted block).
- `reset()` is vLLM's reset_prefix_cache: refused while any block is in use, else drops every
  cached block and records AllBlocksCleared.

Namespaces: a request's `CacheNamespace` (LoRA adapter, cache salt) is mixed into the root of its
chain, so the same tokens under another adapter or salt never share a block (vLLM puts them in
the blocks' extra keys: the effect on sharing is the same).

Optional (all off by default, so the fleet simulator's numbers do not move):
- `digest_bits=128` keeps the whole 128-bit digest as the block's identity (vLLM with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the digest bytes; the int form is its last 8 bytes).
- `labeler`: per committed block, the engine's published hash and kvroute's block key are computed
  once (the same chain as the identity) and kept in a `BlockRecord`; events then carry the
  published hashes and `block_keys()` answers audits without rehashing anything.
- `cpu_offload_blocks=N`: an evicted GPU block moves to a CPU LRU of N blocks instead of being
  dropped (BlockRemoved GPU + BlockStored CPU of the same hash, as vLLM's offloading connector
  reports); the tiers are exclusive. A prompt whose cached prefix continues on CPU blocks loads
  them back (they count as hits and move to the GPU; `Allocation.loaded_tokens` tells the
  scheduler what the cost model must charge for the copy); a block pushed out of the full CPU LRU
  is BlockRemoved CPU.

Accounting (vLLM's prefix-cache stats): every admitted request adds its prompt length to
`queries_tokens` and its cached tokens used (both tiers) to `hits_tokens`, the CPU part of them
also to `cpu_hits_tokens`. Events accumulate until `take_events()`.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from kvroute.block_keys import pack_token_ids

_xxh3_128 = xxhash.xxh3_128_intdigest
_U64 = (1 << 64) - 1

GPU, CPU = "GPU", "CPU"  # the cache's tiers, named as vLLM's `medium`

BlockHash = int | bytes | str  # what an event carries: the identity, or the engine's published form


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """What keeps equal tokens of different requests apart: the LoRA adapter and the cache salt."""

    lora_name: str | None = None
    lora_id: int | None = None  # the adapter's int id (vLLM numbers adapters from 1)
    cache_salt: str | None = None


BASE_NAMESPACE = CacheNamespace()


@dataclass(slots=True)
class StoredEvent:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]  # a list, or array('I') when the request's tokens are packed
    medium: str = GPU
    namespace: CacheNamespace = BASE_NAMESPACE
    moved_from: str | None = None  # set when these blocks only changed tier (they were just removed there)


@dataclass(slots=True)
class RemovedEvent:
    block_hashes: list[BlockHash]
    medium: str = GPU
    moved_to: str | None = None  # set when the blocks live on in another tier (a StoredEvent follows)


@dataclass(slots=True)
class ClearedEvent:
    block_hashes: list[BlockHash] = field(default_factory=list)  # everything dropped, both tiers


CacheEvent = StoredEvent | RemovedEvent | ClearedEvent


@dataclass(slots=True)
class BlockRecord:
    """What the cache keeps about one cached block besides its identity (when a labeler or the CPU tier is on)."""

    published: BlockHash  # the hash its events carry
    parent: BlockHash | None  # the published hash of the block before it (None: a request's first block)
    tokens: Sequence[int]
    namespace: CacheNamespace
    key: int | None = None  # kvroute block key (audits)
    state: object = None  # the engine hash function's chaining state (e.g. a full digest)


class BlockLabeler(Protocol):
    def label(
        self, identities: Sequence[int], tokens: Sequence[int], parent: BlockRecord | None, namespace: CacheNamespace
    ) -> list[BlockRecord]:
        """Records for a run of new full blocks (`tokens` covers them all), chained from `parent`."""
        ...


@dataclass(slots=True)
class Allocation:
    """What one request holds: its pinned cached blocks (chain order) plus uncached working blocks."""

    pinned_hashes: list[int] = field(default_factory=list)
    working_blocks: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0  # of hit_tokens: copied back from the CPU tier
    namespace: CacheNamespace = BASE_NAMESPACE


class CacheFullError(ValueError):
    """The request can never fit: it needs more blocks than the whole cache has."""


class PrefixCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_seed: str | None = None,
        *,
        digest_bits: int = 64,
        cpu_offload_blocks: int = 0,
        labeler: BlockLabeler | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if digest_bits not in (64, 128):
            raise ValueError("digest_bits must be 64 or 128")
        if cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must not be negative")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.digest_bytes = digest_bits // 8
        self._mask = (1 << digest_bits) - 1
        seed = hash_seed.encode() if hash_seed is not None else os.urandom(32)
        self.none_hash = int.from_bytes(hashlib.sha256(b"sim-none-hash" + seed).digest()[-self.digest_bytes :], "big")
        self._roots: dict[CacheNamespace, int] = {BASE_NAMESPACE: self.none_hash}
        self._refcount: dict[int, int] = {}  # cached hash -> pinning requests
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached and unpinned, least recently used first
        self._working = 0  # uncached blocks reserved by requests
        self.cpu_offload_blocks = cpu_offload_blocks
        self._cpu: OrderedDict[int, None] = OrderedDict()  # CPU tier, least recently used first
        self.labeler = labeler
        self._records: dict[int, BlockRecord] | None = {} if labeler is not None or cpu_offload_blocks else None
        self.events: list[CacheEvent] = []
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.cpu_hits_tokens = 0
        self.evicted_blocks = 0
        self.cpu_evicted_blocks = 0

    # ---------------------------------------------------------------- hashing

    def root_hash(self, namespace: CacheNamespace = BASE_NAMESPACE) -> int:
        """The chain's starting point for a namespace (NONE_HASH for the base model without salt)."""
        root = self._roots.get(namespace)
        if root is None:
            material = "\0".join((namespace.lora_name or "", namespace.cache_salt or "")).encode()
            root = _xxh3_128(self.none_hash.to_bytes(self.digest_bytes, "big") + b"\0ns\0" + material) & self._mask
            self._roots[namespace] = root
        return root

    def chain_hashes(
        self, token_ids: Sequence[int], parent: int | None = None, namespace: CacheNamespace = BASE_NAMESPACE
    ) -> list[int]:
        """Hashes of the full blocks of `token_ids`, chained from `parent` (None = the namespace's first block)."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return []
        data = memoryview(pack_token_ids(token_ids[: n * bs]).tobytes())
        stride = 4 * bs
        width, mask = self.digest_bytes, self._mask
        h = self.root_hash(namespace) if parent is None else parent
        out = [0] * n
        for i in range(n):
            h = _xxh3_128(h.to_bytes(width, "big") + data[i * stride : (i + 1) * stride]) & mask
            out[i] = h
        return out

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---------------------------------------------------------------- capacity

    @property
    def cached_blocks(self) -> int:
        return len(self._refcount)

    @property
    def cpu_cached_blocks(self) -> int:
        return len(self._cpu)

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
        """Every block hash currently cached on the GPU (pinned or evictable): the ground truth for audits."""
        return list(self._refcount)

    def block_keys(self) -> dict[str, list[int]]:
        """kvroute block keys of every cached block by tier (needs a labeler that computes keys)."""
        if self._records is None or self.labeler is None:
            raise RuntimeError("block keys are only kept when the cache has a labeler")
        records = self._records
        return {GPU: [records[h].key for h in self._refcount], CPU: [records[h].key for h in self._cpu]}

    def _evict_until_free(self, blocks: int) -> None:
        while self.free_blocks() < blocks:
            victim, _ = self._lru.popitem(last=False)
            del self._refcount[victim]
            self.evicted_blocks += 1
            if self._records is None:
                self.events.append(RemovedEvent([victim]))
            else:
                self._evict_gpu_block(victim)

    def _evict_gpu_block(self, victim: int) -> None:
        record = self._records[victim]
        if not self.cpu_offload_blocks:
            del self._records[victim]
            self.events.append(RemovedEvent([record.published]))
            return
        self.events.append(RemovedEvent([record.published], GPU, moved_to=CPU))
        self.events.append(StoredEvent([record.published], record.parent, record.tokens, CPU, record.namespace, moved_from=GPU))
        self._cpu[victim] = None
        if len(self._cpu) > self.cpu_offload_blocks:
            oldest, _ = self._cpu.popitem(last=False)
            self.cpu_evicted_blocks += 1
            self.events.append(RemovedEvent([self._records.pop(oldest).published], CPU))

    def place_on_cpu(self, hashes: Sequence[int], tokens: Sequence[int], namespace: CacheNamespace = BASE_NAMESPACE) -> None:
        """Hold the blocks `hashes` (of `tokens`) on the CPU tier alone, no event, as if offloaded long
        ago: a state tests start from that eviction reaches only by a long detour. No labeler only."""
        if self._records is None or self.labeler is not None:
            raise ValueError("place_on_cpu needs a CPU tier and no labeler")
        for record in self._plain_records(hashes, tokens, None, namespace):
            self._records[record.published] = record
            self._cpu[record.published] = None

    def _load_from_cpu(self, h: int) -> None:
        """A hit on the CPU tier: the block moves back to the GPU, pinned by the loading request."""
        del self._cpu[h]
        record = self._records[h]
        self.events.append(RemovedEvent([record.published], CPU, moved_to=GPU))
        self.events.append(StoredEvent([record.published], record.parent, record.tokens, GPU, record.namespace, moved_from=CPU))
        self._refcount[h] = 1

    # ---------------------------------------------------------------- request lifecycle

    def longest_cached_prefix(self, hashes: Sequence[int], also: Container[int] = ()) -> int:
        """Number of leading blocks of `hashes` that are cached (on either tier) or in `also`
        (blocks a caller knows will be cached by the time it asks)."""
        n = 0
        for h in hashes:
            if h not in self._refcount and h not in self._cpu and h not in also:
                break
            n += 1
        return n

    def check_fits(self, total_tokens: int) -> None:
        needed = self.blocks_for(total_tokens)
        if needed > self.num_blocks:
            raise CacheFullError(
                f"request needs {needed} KV blocks ({total_tokens} tokens of {self.block_size}) "
                f"but the KV cache only has {self.num_blocks} blocks"
            )

    def allocate(
        self, prompt_hashes: Sequence[int], prompt_len: int, total_tokens: int, namespace: CacheNamespace = BASE_NAMESPACE
    ) -> Allocation | None:
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
        if self._cpu:
            loaded = [h for h in pinned if h in self._cpu]
            hit_evictable = sum(1 for h in pinned if self._refcount.get(h) == 0)
        else:
            loaded = []
            hit_evictable = sum(1 for h in pinned if self._refcount[h] == 0)
        if self.free_blocks() + len(self._lru) - hit_evictable < working + len(loaded):
            return None
        for h in pinned:  # pin first so the eviction below cannot take them
            count = self._refcount.get(h) if loaded else self._refcount[h]
            if count is None:
                self._load_from_cpu(h)
                continue
            if count == 0:
                del self._lru[h]
            self._refcount[h] = count + 1
        self._evict_until_free(working)
        self._working += working
        self.queries_tokens += prompt_len
        self.hits_tokens += hit_blocks * bs
        self.cpu_hits_tokens += len(loaded) * bs
        return Allocation(
            pinned_hashes=pinned,
            working_blocks=working,
            hit_tokens=hit_blocks * bs,
            loaded_tokens=len(loaded) * bs,
            namespace=namespace,
        )

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
                if self._cpu and h in self._cpu:  # recomputed although a CPU copy exists: the tiers stay exclusive
                    self._drop_cpu_block(h)
                self._refcount[h] = 1
                new_hashes.add(h)
            alloc.pinned_hashes.append(h)
        if new_hashes:
            self._emit_stored(hashes, new_hashes, token_ids, parent, alloc.namespace)

    def _drop_cpu_block(self, h: int) -> None:
        del self._cpu[h]
        self.events.append(RemovedEvent([self._records.pop(h).published], CPU))

    def _emit_stored(
        self, hashes: Sequence[int], new_hashes: set[int], token_ids: Sequence[int], parent: int | None, namespace: CacheNamespace
    ) -> None:
        """One BlockStored per run of consecutive new blocks; a shared block in between splits it."""
        start = None  # first block of the current run of new blocks
        for i, h in enumerate(hashes):
            if h in new_hashes:
                if start is None:
                    start = i
            elif start is not None:
                self._store_run(hashes, token_ids, start, i, parent, namespace)
                start = None
        if start is not None:
            self._store_run(hashes, token_ids, start, len(hashes), parent, namespace)

    def _store_run(
        self, hashes: Sequence[int], token_ids: Sequence[int], start: int, end: int, parent: int | None, namespace: CacheNamespace
    ) -> None:
        bs = self.block_size
        run_parent = hashes[start - 1] if start else parent
        tokens = token_ids[start * bs : end * bs]
        if self._records is None:
            self.events.append(StoredEvent(list(hashes[start:end]), run_parent, tokens, GPU, namespace))
            return
        parent_record = self._records[run_parent] if run_parent is not None else None
        run = hashes[start:end]
        if self.labeler is not None:
            records = self.labeler.label(run, tokens, parent_record, namespace)
        else:
            records = self._plain_records(run, tokens, parent_record, namespace)
        for h, record in zip(run, records):
            self._records[h] = record
        self.events.append(
            StoredEvent(
                [r.published for r in records], parent_record.published if parent_record else None, tokens, GPU, namespace
            )
        )

    def _plain_records(
        self, run: Sequence[int], tokens: Sequence[int], parent: BlockRecord | None, namespace: CacheNamespace
    ) -> list[BlockRecord]:
        """Records without a labeler (the CPU tier alone): the identity is the published hash."""
        bs, previous = self.block_size, (parent.published if parent else None)
        records = []
        for i, h in enumerate(run):
            records.append(BlockRecord(h, previous, tokens[i * bs : (i + 1) * bs], namespace))
            previous = h
        return records

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
        dropped = self._published(self._refcount) + self._published(self._cpu)
        self.forget_all()
        self.events.append(ClearedEvent(dropped))
        return True

    def forget_all(self) -> None:
        """Drop every cached block without any event (what an engine restart does to its cache)."""
        if self.used_blocks:
            raise RuntimeError("blocks are in use by requests")
        self._refcount.clear()
        self._lru.clear()
        self._cpu.clear()
        if self._records is not None:
            self._records.clear()

    def _published(self, identities: Iterable[int]) -> list[BlockHash]:
        if self._records is None:
            return list(identities)
        return [self._records[h].published for h in identities]

    def take_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events
