"""Engine block hashes -> kvroute block keys, per worker.

Engine hashes are opaque ids: used only to find a stored block's parent and to resolve
removals. Set semantics, idempotent: real vLLM stores and removes the same hash repeatedly
(recomputed partial blocks), and under-claiming a block is safer than routing on one the engine
evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.block_keys import chain_block_keys, namespace_seed
from kvroute.v1 import kvroute_pb2 as pb
from worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent

# Only the main attention groups describe a reusable prefix; other groups (sliding window, mamba) do not.
_PREFIX_KINDS = {None, "full_attention", "mla_attention"}


@dataclass(slots=True)
class ResolverCounters:
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    unknown_removes: int = 0
    orphan_blocks: int = 0
    short_token_ids: int = 0
    skipped_tier_blocks: int = 0
    skipped_group_blocks: int = 0


class BlockResolver:
    def __init__(self, model: str) -> None:
        self.model = model
        self._keys: dict[int, int] = {}  # engine hash -> kvroute key
        self.counters = ResolverCounters()

    def __len__(self) -> int:
        return len(self._keys)

    def snapshot(self) -> list[int]:
        return list(self._keys.values())

    def clear(self) -> None:
        self._keys.clear()

    def apply(self, events: list[EngineEvent]) -> list[pb.BlockEvent]:
        out: list[pb.BlockEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                keys = self._store(event)
                if keys:
                    out.append(pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, medium=event.medium)))
            elif isinstance(event, BlockRemoved):
                keys = self._remove(event)
                if keys:
                    out.append(pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=keys, medium=event.medium)))
            elif isinstance(event, AllBlocksCleared):
                self._keys.clear()
                out.append(pb.BlockEvent(cleared=pb.AllBlocksCleared()))
        return out

    def _store(self, event: BlockStored) -> list[int]:
        c = self.counters
        n = len(event.block_hashes)
        if event.medium != "gpu":
            c.skipped_tier_blocks += n  # CPU/disk tiers get their own credit later
            return []
        if event.kv_cache_spec_kind not in _PREFIX_KINDS or (event.kv_cache_spec_kind is None and event.group_idx not in (None, 0)):
            c.skipped_group_blocks += n
            return []
        bs = event.block_size
        if len(event.token_ids) < n * bs:
            c.short_token_ids += n
            return []
        if event.parent_block_hash is None:
            parent_key = namespace_seed(self.model, bs, event.lora_name or "")
        else:
            parent_key = self._keys.get(event.parent_block_hash)
            if parent_key is None:
                c.orphan_blocks += n  # parent missed (joined late / lost events): prefix unknown
                return []
        keys = chain_block_keys(event.token_ids[: n * bs], bs, parent_key)
        new = []
        for engine_hash, key in zip(event.block_hashes, keys):
            if engine_hash in self._keys:
                c.duplicate_stores += 1
                continue
            self._keys[engine_hash] = key
            new.append(key)
        c.stored_blocks += len(new)
        return new

    def _remove(self, event: BlockRemoved) -> list[int]:
        if event.medium != "gpu":
            return []
        gone = []
        for engine_hash in event.block_hashes:
            key = self._keys.pop(engine_hash, None)
            if key is None:
                self.counters.unknown_removes += 1
            else:
                gone.append(key)
        self.counters.removed_blocks += len(gone)
        return gone
