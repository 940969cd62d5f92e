"""BlockResolver: engine hashes -> kvroute keys, parent linkage, idempotence, filtering."""

from __future__ import annotations

from kvroute.block_keys import namespace_seed, prompt_block_keys
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_deltas import BlockDelta, KeysRemoved, KeysStored, to_block_events
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.tiers import TIERS, Tier
from kvroute.worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "tiny"
TOKENS = list(range(1, 65))  # 4 blocks of 16
KEYS = prompt_block_keys(TOKENS, 16, MODEL)


def changes(deltas: list[BlockDelta]) -> list[tuple[str, list[int]]]:
    return [(d.kind, list(d.keys) if d.kind != "cleared" else []) for d in deltas]


def test_prompt_stored_in_two_events_chains_to_prompt_block_keys() -> None:
    r = BlockResolver(MODEL)
    first = r.apply([BlockStored([101, 102], None, TOKENS[:32], 16)])
    second = r.apply([BlockStored([103, 104], 102, TOKENS[32:64], 16)])
    assert changes(first) + changes(second) == [("stored", KEYS[:2]), ("stored", KEYS[2:])]
    assert first[0].tier == "gpu"
    assert sorted(r.held_keys()) == sorted(KEYS) and len(r) == 4
    assert r.counters.stored_blocks == 4 and r.observed_block_size == 16


def test_extra_token_ids_beyond_the_blocks_are_ignored() -> None:
    r = BlockResolver(MODEL)
    (event,) = r.apply([BlockStored([1, 2], None, TOKENS[:40], 16)])  # 2.5 blocks worth: the tail is not a block
    assert list(event.keys) == KEYS[:2]


def test_duplicate_store_and_duplicate_remove_are_no_ops() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([101, 102], None, TOKENS[:32], 16)])
    # Real vLLM re-stores a recomputed block and re-announces prefix hits (parent None from block 0).
    assert r.apply([BlockStored([102], 101, TOKENS[16:32], 16)]) == []
    assert r.apply([BlockStored([101, 102, 103], None, TOKENS[:48], 16)]) == [KeysStored("gpu", [KEYS[2]])]
    assert r.counters.duplicate_stores == 3
    assert changes(r.apply([BlockRemoved([103]), BlockRemoved([103])])) == [("removed", [KEYS[2]])]
    assert r.counters.unknown_removes == 1
    assert r.apply([BlockRemoved([999])]) == []
    assert sorted(r.held_keys()) == sorted(KEYS[:2])


def test_two_engine_hashes_with_one_key_are_reference_counted() -> None:
    # e.g. the same tokens under two cache salts: different engine hashes, one kvroute key.
    r = BlockResolver(MODEL)
    assert changes(r.apply([BlockStored([1], None, TOKENS[:16], 16)])) == [("stored", KEYS[:1])]
    assert r.apply([BlockStored([2], None, TOKENS[:16], 16)]) == []  # key already announced
    assert r.apply([BlockRemoved([1])]) == []  # still held through hash 2
    assert r.held_keys() == KEYS[:1]
    assert changes(r.apply([BlockRemoved([2])])) == [("removed", KEYS[:1])]
    assert r.held_keys() == [] and r.engine_blocks == 0


def test_unknown_parent_is_an_orphan_and_so_are_its_children() -> None:
    r = BlockResolver(MODEL)
    assert r.apply([BlockStored([201, 202], 999, TOKENS[:32], 16)]) == []
    assert r.apply([BlockStored([203], 202, TOKENS[32:48], 16)]) == []
    assert r.counters.orphan_blocks == 3 and len(r) == 0


def test_removing_a_parent_keeps_its_children() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([1, 2], None, TOKENS[:32], 16)])
    assert changes(r.apply([BlockRemoved([1])])) == [("removed", [KEYS[0]])]
    assert r.held_keys() == [KEYS[1]]
    assert changes(r.apply([BlockStored([3], 2, TOKENS[32:48], 16)])) == [("stored", [KEYS[2]])]  # child of a held block


def test_all_blocks_cleared_wipes_everything() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([1, 2], None, TOKENS[:32], 16)])
    assert changes(r.apply([AllBlocksCleared()])) == [("cleared", [])]
    assert len(r) == 0 and r.held_keys() == []
    assert r.apply([BlockStored([3], 2, TOKENS[32:48], 16)]) == []  # its parent is gone too
    assert r.apply([AllBlocksCleared()]) == []  # nothing held: nothing changed
    assert r.counters.clears == 2


def test_event_order_is_kept_and_consecutive_changes_are_merged() -> None:
    r = BlockResolver(MODEL)
    out = r.apply(
        [
            BlockStored([1], None, TOKENS[:16], 16),
            BlockStored([2], 1, TOKENS[16:32], 16),
            BlockRemoved([2]),
            BlockRemoved([1]),
            BlockStored([1], None, TOKENS[:16], 16),
            AllBlocksCleared(),
            BlockStored([1], None, TOKENS[:16], 16),
        ]
    )
    assert changes(out) == [
        ("stored", KEYS[:2]),
        ("removed", [KEYS[1], KEYS[0]]),
        ("stored", KEYS[:1]),
        ("cleared", []),
        ("stored", KEYS[:1]),
    ]


def stored_on(tier_deltas: list[BlockDelta]) -> dict[str, list[int]]:
    return {d.tier: list(d.keys) for d in tier_deltas}


def test_gpu_to_cpu_offload_is_a_removal_on_one_tier_and_a_store_on_another() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([1, 2, 3], None, TOKENS[:48], 16)])
    # vLLM's offloading connector / LMCache: the GPU copy of block 2 is evicted, its CPU copy announced.
    out = r.apply([BlockRemoved([2, 3]), BlockStored([2, 3], 1, TOKENS[16:48], 16, medium="cpu")])
    assert [(d.kind, d.tier, list(d.keys)) for d in out] == [("removed", "gpu", KEYS[1:3]), ("stored", "cpu", KEYS[1:3])]
    assert stored_on(r.snapshot_events()) == {"gpu": KEYS[:1], "cpu": KEYS[1:3]}
    assert r.tier_sizes() == {"gpu": 1, "cpu": 2, "disk": 0} and len(r) == 1
    # A GPU child of a block that now lives on CPU still chains (parents are looked up on every tier).
    assert changes(r.apply([BlockStored([4], 3, TOKENS[48:64], 16)])) == [("stored", [KEYS[3]])]
    # The CPU copy goes too: only that tier changes.
    (gone,) = r.apply([BlockRemoved([2], medium="cpu")])
    assert gone.kind == "removed" and gone.tier == "cpu" and list(gone.keys) == [KEYS[1]]
    assert stored_on(r.snapshot_events()) == {"gpu": [KEYS[0], KEYS[3]], "cpu": [KEYS[2]]}


def test_one_hash_on_two_tiers_is_held_once_per_tier() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([1], None, TOKENS[:16], 16), BlockStored([1], None, TOKENS[:16], 16, medium="storage")])
    assert stored_on(r.snapshot_events()) == {"gpu": KEYS[:1], "disk": KEYS[:1]}
    assert changes(r.apply([BlockRemoved([1], medium="storage")])) == [("removed", KEYS[:1])]
    assert stored_on(r.snapshot_events()) == {"gpu": KEYS[:1]}  # the GPU copy is still there
    assert r.counters.duplicate_stores == 0 and r.counters.unknown_removes == 0


def test_medium_names_normalise_to_three_tiers() -> None:
    r = BlockResolver(MODEL)
    media = {
        "gpu": "gpu",
        "cpu": "cpu",
        "cpu_pinned": "cpu",
        "storage": "disk",
        "disk": "disk",
        "fs": "disk",
        "obj": "disk",
        "external": "disk",
        "nvme_pool": "disk",
    }
    for i, (medium, tier) in enumerate(media.items()):
        (event,) = r.apply([BlockStored([100 + i], None, [i] * 16, 16, medium=medium)])
        assert event.tier == tier, medium
    assert r.counters.unknown_medium_blocks == 1  # nvme_pool
    assert changes(r.apply([AllBlocksCleared()])) == [("cleared", [])]
    assert r.tier_sizes() == {"gpu": 0, "cpu": 0, "disk": 0}
    assert stored_on(r.snapshot_events()) == {"gpu": []}  # the GPU tier is always in a snapshot


def test_tiers_go_on_the_wire_as_the_tier_enum() -> None:
    assert [t.wire for t in TIERS] == [pb.TIER_GPU, pb.TIER_CPU, pb.TIER_DISK]
    stored, removed = to_block_events([KeysStored(Tier.CPU, [1]), KeysRemoved(Tier.DISK, [2])])
    assert (stored.stored.tier, list(stored.stored.block_keys)) == (pb.TIER_CPU, [1])
    assert (removed.removed.tier, list(removed.removed.block_keys)) == (pb.TIER_DISK, [2])


def test_only_the_main_full_attention_group_is_indexed() -> None:
    r = BlockResolver(MODEL)
    # Hybrid model (vLLM 0.22+): one store per KV group, same engine hashes.
    out = r.apply(
        [
            BlockStored([1, 2], None, TOKENS[:32], 16, group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored([1, 2], None, TOKENS[:64], 16, group_idx=1, kv_cache_spec_kind="sliding_window"),
        ]
    )
    assert changes(out) == [("stored", KEYS[:2])]
    assert r.apply([BlockRemoved([1], group_idx=1)]) == []  # the sliding-window group evicted its copy
    assert r.held_keys() == KEYS[:2]
    assert changes(r.apply([BlockRemoved([1], group_idx=0)])) == [("removed", KEYS[:1])]
    # vLLM 0.20-0.21: group_idx without a kind: only group 0 is indexed.
    assert r.apply([BlockStored([9], None, TOKENS[:16], 16, group_idx=3)]) == []
    assert r.counters.skipped_group_blocks == 4


def test_main_group_is_learned_when_group_0_is_not_full_attention() -> None:
    r = BlockResolver(MODEL)
    assert r.apply([BlockStored([1], None, TOKENS[:16], 16, group_idx=0, kv_cache_spec_kind="mamba")]) == []
    assert changes(r.apply([BlockStored([1], None, TOKENS[:16], 16, group_idx=1, kv_cache_spec_kind="mla_attention")])) == [
        ("stored", KEYS[:1])
    ]
    assert r.apply([BlockRemoved([1], group_idx=0)]) == []
    assert changes(r.apply([BlockRemoved([1], group_idx=1)])) == [("removed", KEYS[:1])]


def test_short_and_invalid_token_ids_are_counted() -> None:
    r = BlockResolver(MODEL)
    assert r.apply([BlockStored([1, 2], None, TOKENS[:20], 16)]) == []
    assert r.counters.short_token_ids == 2
    assert r.apply([BlockStored([3], None, [2**32] + TOKENS[:15], 16)]) == []
    assert r.counters.invalid_token_ids == 1 and len(r) == 0


def test_lora_name_and_block_size_namespace_keys() -> None:
    r = BlockResolver(MODEL)
    (plain,) = r.apply([BlockStored([1], None, TOKENS[:16], 16)])
    (lora,) = r.apply([BlockStored([2], None, TOKENS[:16], 16, lora_name="sql-adapter")])
    (small,) = r.apply([BlockStored([3, 4], None, TOKENS[:16], 8)])
    assert list(plain.keys) == KEYS[:1]
    assert list(lora.keys) == prompt_block_keys(TOKENS[:16], 16, MODEL, lora_name="sql-adapter")
    assert list(small.keys) == prompt_block_keys(TOKENS[:16], 8, MODEL)
    assert r.observed_block_size == 8
    assert namespace_seed(MODEL, 16) != namespace_seed(MODEL, 8)


def test_clear_forgets_state_without_an_event() -> None:
    r = BlockResolver(MODEL)
    r.apply([BlockStored([1], None, TOKENS[:16], 16)])
    r.clear()
    assert len(r) == 0 and r.apply([BlockRemoved([1])]) == []


def test_remote_blocks_are_not_ours() -> None:
    r = BlockResolver(MODEL)
    assert r.apply([BlockStored([1], None, TOKENS[:16], 16, remote=True)]) == []
    r.apply([BlockStored([1], None, TOKENS[:16], 16)])
    assert r.apply([BlockRemoved([1], remote=True)]) == []
    assert r.counters.remote_blocks == 2 and r.held_keys() == KEYS[:1]


def test_multimodal_content_stops_the_chain_and_its_removal_is_silent() -> None:
    r = BlockResolver(MODEL)
    out = r.apply([BlockStored([1, 2, 3], None, TOKENS[:48], 16, unkeyable_from=1)])
    assert changes(out) == [("stored", KEYS[:1])]
    assert r.apply([BlockStored([4], 3, TOKENS[48:64], 16)]) == []  # a child of an image block: unkeyable too
    assert r.counters.unkeyable_blocks == 3 and r.counters.orphan_blocks == 0
    assert r.apply([BlockRemoved([3, 4, 2])]) == [] and r.counters.unknown_removes == 0
    assert r.apply([BlockRemoved([2])]) == [] and r.counters.unknown_removes == 1  # gone already


def test_non_integer_tokens_stop_the_chain_at_their_block() -> None:
    # TRT-LLM (KV-cache manager V2) puts a 64-hex digest where a multimodal token sits.
    r = BlockResolver(MODEL)
    tokens: list = list(TOKENS[:48])
    tokens[20] = "ab" * 32
    assert changes(r.apply([BlockStored([1, 2, 3], None, tokens, 16)])) == [("stored", KEYS[:1])]
    assert r.counters.unkeyable_blocks == 2 and r.counters.invalid_token_ids == 0


def test_partial_blocks_are_held_without_a_key() -> None:
    r = BlockResolver(MODEL, block_size=16)
    assert r.apply([BlockStored([9], None, TOKENS[:5], 5)]) == []  # a 5-token block of a 16-token worker
    assert r.counters.partial_blocks == 1 and r.observed_block_size is None
    assert r.apply([BlockRemoved([9])]) == [] and r.counters.unknown_removes == 0  # removal suppressed
    # Several smaller blocks are not partial: the engine's block size is not the flag's.
    assert changes(r.apply([BlockStored([1, 2], None, TOKENS[:16], 8)])) == [("stored", prompt_block_keys(TOKENS[:16], 8, MODEL))]
    assert r.observed_block_size == 8
    assert r.apply([BlockStored([3], 2, TOKENS[16:24], 8)]) != []  # a single block of the new size is a full one


def test_cache_salt_and_unnamed_adapters_namespace_keys() -> None:
    r = BlockResolver(MODEL)
    (salted,) = r.apply([BlockStored([1], None, TOKENS[:16], 16, cache_salt="tenant-a")])
    assert list(salted.keys) == prompt_block_keys(TOKENS[:16], 16, MODEL, cache_salt="tenant-a")
    (child,) = r.apply([BlockStored([2], 1, TOKENS[16:32], 16)])  # the salt lives on through the chain
    assert list(child.keys) == prompt_block_keys(TOKENS[:32], 16, MODEL, cache_salt="tenant-a")[1:]
    (by_id,) = r.apply([BlockStored([3], None, TOKENS[:16], 16, lora_id=7)])
    assert list(by_id.keys) == prompt_block_keys(TOKENS[:16], 16, MODEL, lora_name="#lora-id=7")
    assert list(by_id.keys) != KEYS[:1] and r.counters.unnamed_lora_blocks == 1
    (named,) = r.apply([BlockStored([4], None, TOKENS[:16], 16, lora_name="sql", lora_id=7)])  # the name wins
    assert list(named.keys) == prompt_block_keys(TOKENS[:16], 16, MODEL, lora_name="sql")
