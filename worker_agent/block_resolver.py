"""Engine block hashes -> kvroute block keys, for one worker, per cache tier.

Engine hashes are opaque per-worker ids, used only to find a stored block's parent and to
resolve removals; the key of a block is kvroute's own chained hash of its tokens
(`kvroute.block_keys`):

- BlockStored: parent key = key of `parent_block_hash` (held on any tier), or for the first block
  of a prompt the namespace seed of (model, block_size, LoRA adapter, cache salt); keys =
  chain_block_keys of the first n*block_size token ids. An unknown parent means the prefix is
  unknown (we joined late or lost events): the store cannot be keyed (`orphan_blocks`).
- Tiers: the event's medium names a tier through `tiers.tier_of_medium` (gpu, cpu or disk; a
  medium we do not know is indexed as disk, counted). Each tier has its own engine hash -> key map, so a GPU -> CPU offload
  (BlockRemoved gpu + BlockStored cpu of one hash) is a removal on one tier and a store on another.
- Set semantics per tier, idempotent: storing a hash already held or removing one not held is a
  no-op (real vLLM stores and removes the same hash repeatedly). Several engine hashes may map to
  the same key; a key is reference-counted per tier and reported removed when the last engine
  block holding it there goes.
- Blocks that are held but get no key: multimodal / prompt-embeds content from `unkeyable_from` on
  (a text router cannot match it; the chain stops there, and children of such blocks are
  unkeyable too), and partial blocks (a one-block store smaller than the worker's block size:
  vLLM 0.33 prefix_match_unit, TRT-LLM). Their removal is silent.
- An adapter known only by int id (vLLM <= 0.13, TRT-LLM) is keyed in a namespace no request
  names ("#lora-id=<n>"), so its blocks are tracked but never matched by base-model requests.
- Skipped and counted: `remote` blocks (another instance's), KV groups other than the main
  full-attention one.

`apply()` returns plain key deltas (`block_deltas.py`) for only the changes that really happened
(consecutive changes of one kind on one tier are merged into one delta); `snapshot_events()` lists
every key held, one KeysStored per tier. Only the agent's gRPC link turns them into protobuf.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from kvroute.block_keys import chain_block_keys, namespace_seed
from kvroute.worker_agent.block_deltas import AllKeysCleared, BlockDelta, KeysRemoved, KeysStored
from kvroute.worker_agent.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent
from kvroute.worker_agent.tiers import TIERS, Tier, tier_of_medium

log = logging.getLogger("kvroute.agent.resolver")

# KV-cache spec kinds whose blocks describe a reusable prompt prefix.
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})
GPU, DISK = Tier.GPU, Tier.DISK
_UNKEYED = -1  # _parent_key: the parent is held but has no key (kvroute keys are u64, never negative)


@dataclass(slots=True)
class ResolverCounters:
    stored_blocks: int = 0  # engine blocks newly keyed
    removed_blocks: int = 0  # keyed engine blocks removed
    duplicate_stores: int = 0  # store of a hash already held on that tier (no-op)
    unknown_removes: int = 0  # removal of a hash not held on that tier (no-op)
    orphan_blocks: int = 0  # stored blocks whose parent is unknown: cannot be keyed
    short_token_ids: int = 0  # stored blocks whose event carries fewer than n*block_size tokens
    invalid_token_ids: int = 0  # stored blocks with token ids outside u32
    unkeyable_blocks: int = 0  # held blocks with multimodal / embedded content (or such a parent): no key
    partial_blocks: int = 0  # held partial blocks (fewer tokens than the block size): no key
    remote_blocks: int = 0  # blocks of events with locality other than LOCAL (not ours)
    unknown_medium_blocks: int = 0  # blocks on a medium name we do not know (indexed as disk)
    unnamed_lora_blocks: int = 0  # blocks of an adapter known only by int id (keyed where no request looks)
    skipped_group_blocks: int = 0  # blocks of a KV group that is not the main full-attention one
    clears: int = 0  # AllBlocksCleared events

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Tier:
    keys: dict[int, int] = field(default_factory=dict)  # engine hash -> kvroute key
    refs: dict[int, int] = field(default_factory=dict)  # kvroute key -> number of engine hashes holding it
    unkeyed: set[int] = field(default_factory=set)  # engine hashes held without a key (multimodal, partial)

    def clear(self) -> None:
        self.keys.clear()
        self.refs.clear()
        self.unkeyed.clear()


class BlockResolver:
    def __init__(self, model: str, block_size: int | None = None) -> None:
        self.model = model
        self.expected_block_size = block_size  # the worker's block size before any event says otherwise
        self.counters = ResolverCounters()
        self._tiers = {tier: _Tier() for tier in TIERS}
        self._gpu = self._tiers[GPU]
        self._seeds: dict[tuple[int, str, str], int] = {}
        self._main_group: int | None = None
        self._unknown_media: set[str] = set()
        self.observed_block_size: int | None = None  # block size of the last keyed BlockStored

    def __len__(self) -> int:
        """Distinct kvroute keys held on the GPU tier."""
        return len(self._gpu.refs)

    @property
    def engine_blocks(self) -> int:
        """Engine blocks keyed on the GPU tier."""
        return len(self._gpu.keys)

    def tier_sizes(self) -> dict[str, int]:
        """Distinct keys held per tier."""
        return {tier: len(state.refs) for tier, state in self._tiers.items()}

    def held_keys(self, tier: str = GPU) -> list[int]:
        return list(self._tiers[tier].refs)

    def snapshot_events(self) -> list[BlockDelta]:
        """Everything held, as a resync sends it: one KeysStored per tier (gpu always, others when non-empty)."""
        return [KeysStored(tier, list(state.refs)) for tier, state in self._tiers.items() if tier == GPU or state.refs]

    def clear(self) -> None:
        """Forget everything (engine restarted / state unknown). Not reported as an event."""
        for state in self._tiers.values():
            state.clear()
        self._main_group = None

    # ------------------------------------------------------------------ events

    def apply(self, events: list[EngineEvent]) -> list[BlockDelta]:
        runs: list[tuple[str, Tier | None, list[int]]] = []  # (kind, tier, keys), consecutive (kind, tier) merged
        for event in events:
            t = type(event)
            if t is BlockStored:
                tier, keys = self._store(event)  # type: ignore[arg-type]
                kind = "stored"
            elif t is BlockRemoved:
                tier, keys = self._remove(event)  # type: ignore[arg-type]
                kind = "removed"
            elif t is AllBlocksCleared:
                # The engine dropped its cache; tiers we cannot see being cleared may survive, but a missed
                # hit is cheaper than a wrong one: everything goes.
                self.counters.clears += 1
                if not any(state.keys or state.unkeyed for state in self._tiers.values()):
                    continue
                self.clear()
                runs.append(("cleared", None, []))
                continue
            else:
                raise TypeError(f"not an engine event: {event!r}")
            if keys:
                if runs and runs[-1][0] == kind and runs[-1][1] == tier:
                    runs[-1][2].extend(keys)
                else:
                    runs.append((kind, tier, keys))
        return [
            KeysStored(tier, keys) if kind == "stored" else KeysRemoved(tier, keys) if kind == "removed" else AllKeysCleared()
            for kind, tier, keys in runs
        ]

    def _tier(self, medium: str, blocks: int) -> Tier:
        tier = tier_of_medium(medium)
        if tier is None:
            self.counters.unknown_medium_blocks += blocks
            if medium not in self._unknown_media:
                self._unknown_media.add(medium)
                log.warning("unknown KV cache medium %r: indexed as tier %r", medium, str(DISK))
            tier = DISK
        return tier

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

    def _seed(self, ev: BlockStored) -> int:
        lora = ev.lora_name or ""
        if not lora and ev.lora_id is not None:
            lora = f"#lora-id={ev.lora_id}"
            self.counters.unnamed_lora_blocks += len(ev.block_hashes)
        salt = ev.cache_salt or ""
        seed = self._seeds.get((ev.block_size, lora, salt))
        if seed is None:
            seed = self._seeds[(ev.block_size, lora, salt)] = namespace_seed(self.model, ev.block_size, lora, salt)
        return seed

    def _parent_key(self, parent: int) -> int | None:
        """Key of a parent hash held on any tier (offloaded blocks chain to blocks of other tiers);
        _UNKEYED if the parent is held without a key."""
        for state in self._tiers.values():
            key = state.keys.get(parent)
            if key is not None:
                return key
        for state in self._tiers.values():
            if parent in state.unkeyed:
                return _UNKEYED
        return None

    def _store(self, ev: BlockStored) -> tuple[Tier, list[int]]:
        c = self.counters
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return GPU, []
        if ev.remote:
            c.remote_blocks += n
            return GPU, []
        if not self._indexed_group(ev.group_idx, ev.kv_cache_spec_kind):
            c.skipped_group_blocks += n
            return GPU, []
        tier = GPU if ev.medium == GPU else self._tier(ev.medium, n)
        state = self._tiers[tier]
        bs = ev.block_size
        usual = self.observed_block_size or self.expected_block_size
        if n == 1 and usual is not None and bs < usual:
            if hashes[0] not in state.unkeyed:
                state.unkeyed.add(hashes[0])
                c.partial_blocks += 1
            return tier, []
        tokens = ev.token_ids
        if bs <= 0 or len(tokens) < n * bs:
            c.short_token_ids += n
            return tier, []
        keyable = n if ev.unkeyable_from is None else max(0, min(n, ev.unkeyable_from))
        parent = ev.parent_block_hash
        if parent is None:
            parent_key = self._seed(ev)
        else:
            parent_key = self._parent_key(parent)
            if parent_key is None:
                c.orphan_blocks += n
                return tier, []
            if parent_key == _UNKEYED:
                keyable = 0
        keys: list[int] = []
        if keyable:
            need = keyable * bs
            try:
                keys = chain_block_keys(tokens if len(tokens) == need else tokens[:need], bs, parent_key)
            except TypeError:
                # A token that is not an int (TRT-LLM puts a multimodal digest string there): the chain stops at its block.
                keyable = next((i for i, t in enumerate(tokens) if type(t) is not int), 0) // bs
                try:
                    keys = chain_block_keys(tokens[: keyable * bs], bs, parent_key) if keyable else []
                except (TypeError, ValueError):
                    c.invalid_token_ids += n
                    return tier, []
            except ValueError:
                c.invalid_token_ids += n
                return tier, []
        self.observed_block_size = bs
        known, refs = state.keys, state.refs
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
        c.stored_blocks += len(keys) - duplicates
        if keyable < n:
            unkeyed = state.unkeyed
            for engine_hash in hashes[keyable:]:
                if engine_hash in known or engine_hash in unkeyed:
                    duplicates += 1
                else:
                    unkeyed.add(engine_hash)
                    c.unkeyable_blocks += 1
        c.duplicate_stores += duplicates
        return tier, new

    def _remove(self, ev: BlockRemoved) -> tuple[Tier, list[int]]:
        c = self.counters
        hashes = ev.block_hashes
        if ev.remote:
            c.remote_blocks += len(hashes)
            return GPU, []
        if (ev.group_idx or 0) != (self._main_group or 0):
            c.skipped_group_blocks += len(hashes)
            return GPU, []
        tier = GPU if ev.medium == GPU else self._tier(ev.medium, len(hashes))
        state = self._tiers[tier]
        known, refs, unkeyed = state.keys, state.refs, state.unkeyed
        gone: list[int] = []
        for engine_hash in hashes:
            key = known.pop(engine_hash, None)
            if key is None:
                if engine_hash in unkeyed:
                    unkeyed.discard(engine_hash)
                else:
                    c.unknown_removes += 1
                continue
            c.removed_blocks += 1
            r = refs[key] - 1
            if r:
                refs[key] = r
            else:
                del refs[key]
                gone.append(key)
        return tier, gone
