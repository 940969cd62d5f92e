"""One conformance suite, run against every PrefixIndex implementation (tiers and speculative
holders included)."""

from __future__ import annotations

import random

import pytest

from kvroute.prefix_index import (
    TIERS,
    BitmaskPrefixIndex,
    BoundedPrefixIndex,
    PrefixIndex,
    SetPrefixIndex,
    Tier,
    TierMatch,
    tier_of_wire,
)
from kvroute.v1 import kvroute_pb2 as pb

GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK


def test_empty_index_matches_nothing(index: PrefixIndex) -> None:
    assert index.match([1, 2, 3]) == {}
    assert index.match([]) == {}
    assert index.entry_count() == 0


def test_longest_prefix_per_worker(index: PrefixIndex) -> None:
    index.store(0, [10, 11, 12, 13])
    index.store(1, [10, 11])
    index.store(2, [99])
    assert index.match([10, 11, 12, 13, 14]) == {0: 4, 1: 2}
    assert index.match([99, 10]) == {2: 1}
    assert index.match([11, 12]) == {0: 2, 1: 1}


def test_hole_ends_the_match(index: PrefixIndex) -> None:
    index.store(0, [1, 2, 3, 4])
    index.remove(0, [2])
    assert index.match([1, 2, 3, 4]) == {0: 1}


def test_store_and_remove_are_idempotent(index: PrefixIndex) -> None:
    assert index.store(3, [1, 2]) == 2
    assert index.store(3, [1, 2]) == 0
    assert index.worker_block_count(3) == 2
    assert index.remove(3, [1]) == 1
    assert index.remove(3, [1]) == 0
    assert index.remove(3, [77]) == 0
    assert index.remove(9, [1]) == 0
    assert index.match([2]) == {3: 1}
    assert index.entry_count() == 1


def test_duplicate_keys_in_one_call(index: PrefixIndex) -> None:
    assert index.store(0, [5, 5, 6]) == 2
    assert index.remove(0, [5, 5]) == 1
    assert index.match([6]) == {0: 1}


def test_clear_only_touches_that_worker(index: PrefixIndex) -> None:
    index.store(0, [1, 2])
    index.store(1, [1, 2])
    assert index.clear(0) == 2
    assert index.clear(0) == 0
    assert index.match([1, 2]) == {1: 2}
    assert index.worker_block_count(0) == 0


def test_replace_makes_exact_set(index: PrefixIndex) -> None:
    index.store(0, [1, 2, 3])
    index.store(1, [1])
    index.replace(0, [1, 4])
    assert index.match([1, 2]) == {0: 1, 1: 1}
    assert index.match([4]) == {0: 1}
    assert index.worker_block_count(0) == 2


def test_many_workers_bitmask_width(index: PrefixIndex) -> None:
    for worker in range(130):
        index.store(worker, [1, 2, 3][: 1 + worker % 3])
    result = index.match([1, 2, 3])
    assert len(result) == 130
    assert all(depth == 1 + worker % 3 for worker, depth in result.items())


def test_a_key_is_held_per_tier(index: PrefixIndex) -> None:
    assert index.store(0, [1, 2], GPU) == 2
    assert index.store(0, [1, 2], CPU) == 2  # the same keys on another tier are new entries
    assert index.remove(0, [1], CPU) == 1
    assert index.match([1, 2]) == {0: 2}  # still on gpu
    assert index.remove(0, [1], GPU) == 1
    assert index.match([1, 2]) == {}
    assert index.worker_keys(0, GPU) == {2} and index.worker_keys(0, CPU) == {2}
    assert index.worker_block_count(0, GPU) == 1 and index.worker_block_count(0) == 2
    assert index.entry_count() == 2


def test_match_walks_any_tier_and_counts_blocks_below_gpu(index: PrefixIndex) -> None:
    index.store(0, [1, 2], GPU)
    index.store(0, [3, 4], CPU)
    index.store(0, [5], DISK)
    index.store(1, [1, 2, 3], CPU)
    index.store(1, [2, 3], GPU)  # gpu and cpu: counts as gpu
    index.store(1, [4], DISK)
    index.store(1, [4], CPU)     # cpu and disk: counts as cpu
    keys = [1, 2, 3, 4, 5, 6]
    assert index.match(keys) == {0: 5, 1: 4}
    assert index.match_tiers(keys) == TierMatch(depth={0: 5, 1: 4}, cpu_blocks={0: 2, 1: 2}, disk_blocks={0: 1})


def test_moving_a_block_between_tiers_keeps_the_match(index: PrefixIndex) -> None:
    """An offload: BlockRemoved on gpu then BlockStored on cpu; and back."""
    index.store(0, [1, 2, 3], GPU)
    index.remove(0, [3], GPU)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 2})
    index.store(0, [3], CPU)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 3}, cpu_blocks={0: 1})
    index.store(0, [3], GPU)
    index.remove(0, [3], CPU)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 3})


def test_clear_empties_every_tier(index: PrefixIndex) -> None:
    index.store(0, [1], GPU)
    index.store(0, [1, 2], CPU)
    index.store(0, [3], DISK)
    index.store(1, [1], DISK)
    assert index.clear(0) == 4
    assert index.match_tiers([1]) == TierMatch(depth={1: 1}, disk_blocks={1: 1})
    assert all(index.worker_block_count(0, tier) == 0 for tier in TIERS)


def test_replace_all_sets_every_tier(index: PrefixIndex) -> None:
    index.store(0, [1, 2], GPU)
    index.store(0, [7], DISK)
    index.replace_all(0, {GPU: [1], CPU: [2, 3]})  # disk not named: emptied
    assert [index.worker_keys(0, tier) for tier in TIERS] == [{1}, {2, 3}, set()]
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 3}, cpu_blocks={0: 2})
    index.replace(0, [5], CPU)  # one tier only
    assert [index.worker_keys(0, tier) for tier in TIERS] == [{1}, {5}, set()]


def test_speculative_claims_continue_the_walk(index: PrefixIndex) -> None:
    index.store(0, [1, 2], GPU)
    index.store(1, [1], CPU)
    index.speculate(0, [3, 4])
    index.speculate(1, [2])
    index.speculate(2, [1, 2])
    assert index.match_tiers([1, 2, 3, 4, 5]) == TierMatch(
        depth={0: 4, 1: 2, 2: 2}, cpu_blocks={1: 1}, speculative_blocks={0: 2, 1: 1, 2: 2})
    assert index.match([1, 2, 3]) == {0: 2, 1: 1}  # `match` is confirmed entries only
    # A claim on a key the worker already holds adds nothing; claims are not entries.
    index.speculate(0, [1])
    assert index.match_tiers([1, 2]) == TierMatch(depth={0: 2, 1: 2, 2: 2}, cpu_blocks={1: 1},
                                                  speculative_blocks={1: 1, 2: 2})
    assert index.entry_count() == 3 and index.worker_keys(2, GPU) == set() and index.clear(2) == 0
    assert [index.held_prefix(w, [1, 2, 3]) for w in range(3)] == [2, 1, 0]
    index.unspeculate(0, [1, 3])
    index.unspeculate(2, [1, 2])
    index.unspeculate(3, [1])  # never claimed: nothing to do
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 2, 1: 2}, cpu_blocks={1: 1},
                                                        speculative_blocks={1: 1})
    # Confirmed later on a tier: the worker holds it, the claim no longer counts as speculative.
    index.store(1, [2], DISK)
    assert index.match_tiers([1, 2]) == TierMatch(depth={0: 2, 1: 2}, cpu_blocks={1: 1}, disk_blocks={1: 1})


def test_claims_and_offloads_on_other_prompts_leave_this_match_alone(index: PrefixIndex) -> None:
    index.store(0, [1, 2, 3], GPU)
    index.store(1, [1, 2], GPU)
    index.store(2, [50, 51], CPU)   # offloaded, another prompt
    index.speculate(3, [60, 61])    # in flight, another prompt's tail
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 3, 1: 2})
    assert index.match_tiers((1, 2, 3)) == TierMatch(depth={0: 3, 1: 2})  # any sequence, not only lists
    index.speculate(1, [3])         # now one key of this prompt is claimed: the tiered walk counts it
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 3, 1: 3}, speculative_blocks={1: 1})


def test_tier_counts_with_many_workers(index: PrefixIndex) -> None:
    for worker in range(130):
        index.store(worker, [1, 2], GPU)
        index.store(worker, [3, 4][: worker % 3], TIERS[worker % 3])
    result = index.match_tiers([1, 2, 3, 4])
    assert result.depth == {w: 2 + (w % 3 and w % 3) for w in range(130)}
    assert result.cpu_blocks == {w: 1 for w in range(130) if w % 3 == 1}
    assert result.disk_blocks == {w: 2 for w in range(130) if w % 3 == 2}


def test_tiers_are_the_wire_enum() -> None:
    # The index's tiers are kvroute.v1.Tier's values (the control plane applies them without a table).
    assert {t.name: int(t) for t in TIERS} == {pb.Tier.Name(v).removeprefix("TIER_"): v for v in pb.Tier.values()}
    assert [tier_of_wire(v) for v in (pb.TIER_GPU, pb.TIER_CPU, pb.TIER_DISK)] == [GPU, CPU, DISK]
    assert tier_of_wire(3) is None and tier_of_wire(-1) is None
    assert [t.label for t in TIERS] == ["gpu", "cpu", "disk"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tiered", [True, False], ids=["tiers", "gpu-only"])
@pytest.mark.parametrize("impl", [BitmaskPrefixIndex, lambda: BoundedPrefixIndex(1 << 40)],
                         ids=["BitmaskPrefixIndex", "BoundedPrefixIndexUnreached"])
def test_random_operations_agree_with_reference(impl: type, tiered: bool, seed: int) -> None:
    """SetPrefixIndex is the oracle every other implementation must agree with."""
    index = impl()
    rng = random.Random(seed)
    reference = SetPrefixIndex()
    keys = list(range(40))
    for _ in range(2000):
        op = rng.random()
        worker = rng.randrange(8)
        tier = rng.choice(TIERS) if tiered and rng.random() < 0.4 else GPU
        batch = rng.sample(keys, rng.randint(1, 6))
        if op < 0.5:
            assert index.store(worker, batch, tier) == reference.store(worker, batch, tier)
        elif op < 0.85:
            assert index.remove(worker, batch, tier) == reference.remove(worker, batch, tier)
        elif op < 0.9:
            assert index.clear(worker) == reference.clear(worker)
        elif op < 0.95:
            index.replace(worker, batch, tier)
            reference.replace(worker, batch, tier)
        else:
            by_tier = {t: rng.sample(keys, rng.randint(0, 4)) for t in rng.sample(TIERS if tiered else [GPU], rng.randint(0, 1 + 2 * tiered))}
            index.replace_all(worker, by_tier)
            reference.replace_all(worker, by_tier)
        if rng.random() < 0.2:
            claims = rng.sample(keys, rng.randint(1, 6))
            claim = index.speculate if rng.random() < 0.6 else index.unspeculate
            claim(worker, claims)
            getattr(reference, claim.__name__)(worker, claims)
        probe = rng.sample(keys, rng.randint(1, 10))
        assert index.match(probe) == reference.match(probe)
        assert index.match_tiers(probe) == reference.match_tiers(probe)
        assert index.worker_keys(worker, tier) == reference.worker_keys(worker, tier)
        assert index.worker_block_count(worker) == reference.worker_block_count(worker)
        assert index.held_prefix(worker, probe) == reference.held_prefix(worker, probe)
    assert index.entry_count() == reference.entry_count()
