"""Engine block hashes -> kvroute block keys, for one worker.

Engine hashes are opaque per-worker ids, used only to find a stored block's parent and to
resolve removals; the key of a block is kvroute's own chained hash of its tokens
(`kvroute.block_keys`):

- BlockStored: parent key = key of `parent_block_hash` (or the namespace seed of
  (model, block_size, lora_name) for the first block of a prompt); keys = chain_block_keys of
  the first n*block_size token ids. An unknown parent means the prefix is unknown (we joined
  late or lost events): the store cannot be keyed and is counted as `orphan_blocks`.
- Set semantics, idempotent: storing a hash already held or removing one not held is a no-op
  (real vLLM stores and removes the same hash repeatedly). Several engine hashes may map to the
  same key (e.g. the same tokens under different cache salts); a key is reference-counted so it
  is only reported removed when the last engine block holding it goes.
- Removing a parent does not remove its children (the engine sends those separately).
- Only GPU-tier blocks of the main full-attention KV group are indexed for now; other media and
  groups are counted and skipped.

`apply()` returns proto BlockEvents for only the changes that really happened (consecutive
changes of one kind are merged into one event); `snapshot()` lists every key held.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvroute.block_keys import chain_block_keys, namespace_seed
from kvroute.v1 import kvroute_pb2 as pb
from worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent

# KV-cache spec kinds whose blocks describe a reusable prompt prefix.
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})
GPU = "gpu"


@dataclass(slots=True)
class ResolverCounters:
    stored_blocks: int = 0         # engine blocks newly indexed
    removed_blocks: int = 0        # engine blocks un-indexed
    duplicate_stores: int = 0      # store of a hash already held (no-op)
    unknown_removes: int = 0       # removal of a hash not held (no-op)
    orphan_blocks: int = 0         # stored blocks whose parent is unknown: cannot be keyed
    short_token_ids: int = 0       # stored blocks whose event carries fewer than n*block_size tokens
    invalid_token_ids: int = 0     # stored blocks with token ids outside u32
    skipped_tier_blocks: int = 0   # blocks on a medium other than gpu (tiers come later)
    skipped_group_blocks: int = 0  # blocks of a KV group that is not the main full-attention one
    clears: int = 0                # AllBlocksCleared events

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BlockResolver:
    def __init__(self, model: str) -> None:
        self.model = model
        self.counters = ResolverCounters()
        self._keys: dict[int, int] = {}   # engine hash -> kvroute key
        self._refs: dict[int, int] = {}   # kvroute key -> number of engine hashes holding it
        self._seeds: dict[tuple[int, str], int] = {}
        self._main_group: int | None = None
        self.observed_block_size: int | None = None  # block size of the last indexed BlockStored

    def __len__(self) -> int:
        """Distinct kvroute keys held."""
        return len(self._refs)

    @property
    def engine_blocks(self) -> int:
        return len(self._keys)

    def snapshot(self) -> list[int]:
        """Every key currently held (what a resync sends)."""
        return list(self._refs)

    def clear(self) -> None:
        """Forget everything (engine restarted / state unknown). Not reported as an event."""
        self._keys.clear()
        self._refs.clear()
        self._main_group = None

    # ------------------------------------------------------------------ events

    def apply(self, events: list[EngineEvent]) -> list[pb.BlockEvent]:
        runs: list[tuple[str, list[int]]] = []  # ("stored" | "removed" | "cleared", keys), consecutive kinds merged
        for event in events:
            t = type(event)
            if t is BlockStored:
                keys = self._store(event)  # type: ignore[arg-type]
                kind = "stored"
            elif t is BlockRemoved:
                keys = self._remove(event)  # type: ignore[arg-type]
                kind = "removed"
            elif t is AllBlocksCleared:
                self.counters.clears += 1
                if not self._refs and not self._keys:
                    continue
                self._keys.clear()
                self._refs.clear()
                runs.append(("cleared", []))
                continue
            else:
                raise TypeError(f"not an engine event: {event!r}")
            if keys:
                if runs and runs[-1][0] == kind:
                    runs[-1][1].extend(keys)
                else:
                    runs.append((kind, keys))
        out: list[pb.BlockEvent] = []
        for kind, keys in runs:
            if kind == "stored":
                out.append(pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, medium=GPU)))
            elif kind == "removed":
                out.append(pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=keys, medium=GPU)))
            else:
                out.append(pb.BlockEvent(cleared=pb.AllBlocksCleared()))
        return out

    def _indexed_group(self, group_idx: int | None, kind: str | None) -> bool:
        group = group_idx or 0
        if kind is None:
            if group != 0:  # before vLLM 0.22 the kind is not on the wire: only group 0 is known to be the main one
                return False
        elif kind not in PREFIX_KINDS:
            return False  # sliding window / mamba / ...: not a reusable prefix (and token_ids may not line up)
        if self._main_group is None:
            self._main_group = group  # hybrid models: index one full-attention group only (hashes repeat per group)
        return group == self._main_group

    def _store(self, ev: BlockStored) -> list[int]:
        c = self.counters
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return []
        if ev.medium != GPU:
            c.skipped_tier_blocks += n
            return []
        if not self._indexed_group(ev.group_idx, ev.kv_cache_spec_kind):
            c.skipped_group_blocks += n
            return []
        bs = ev.block_size
        need = n * bs
        tokens = ev.token_ids
        if bs <= 0 or len(tokens) < need:
            c.short_token_ids += n
            return []
        parent = ev.parent_block_hash
        if parent is None:
            lora = ev.lora_name or ""
            parent_key = self._seeds.get((bs, lora))
            if parent_key is None:
                parent_key = self._seeds[(bs, lora)] = namespace_seed(self.model, bs, lora)
        else:
            parent_key = self._keys.get(parent)
            if parent_key is None:
                c.orphan_blocks += n
                return []
        try:
            keys = chain_block_keys(tokens if len(tokens) == need else tokens[:need], bs, parent_key)
        except (ValueError, TypeError):
            c.invalid_token_ids += n
            return []
        self.observed_block_size = bs
        known, refs = self._keys, self._refs
        new: list[int] = []
        duplicates = 0
        for engine_hash, key in zip(hashes, keys):
            if engine_hash in known:
                duplicates += 1
                continue
            known[engine_hash] = key
            r = refs.get(key, 0)
            refs[key] = r + 1
            if r == 0:
                new.append(key)
        c.duplicate_stores += duplicates
        c.stored_blocks += n - duplicates
        return new

    def _remove(self, ev: BlockRemoved) -> list[int]:
        c = self.counters
        hashes = ev.block_hashes
        if ev.medium != GPU:
            c.skipped_tier_blocks += len(hashes)
            return []
        if (ev.group_idx or 0) != (self._main_group or 0):
            c.skipped_group_blocks += len(hashes)
            return []
        known, refs = self._keys, self._refs
        gone: list[int] = []
        for engine_hash in hashes:
            key = known.pop(engine_hash, None)
            if key is None:
                c.unknown_removes += 1
                continue
            c.removed_blocks += 1
            r = refs[key] - 1
            if r:
                refs[key] = r
            else:
                del refs[key]
                gone.append(key)
        return gone
