"""One conformance suite, run against every PrefixIndex implementation."""

from __future__ import annotations

import random

import pytest

from control_plane.index import BitmaskPrefixIndex, PrefixIndex, SetPrefixIndex

IMPLEMENTATIONS = [BitmaskPrefixIndex, SetPrefixIndex]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda c: c.__name__)
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    return request.param()


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


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("impl", [c for c in IMPLEMENTATIONS if c is not SetPrefixIndex], ids=lambda c: c.__name__)
def test_random_operations_agree_with_reference(impl: type, seed: int) -> None:
    """SetPrefixIndex is the oracle every other implementation must agree with."""
    index = impl()
    rng = random.Random(seed)
    reference = SetPrefixIndex()
    keys = list(range(40))
    for _ in range(2000):
        op = rng.random()
        worker = rng.randrange(8)
        batch = rng.sample(keys, rng.randint(1, 6))
        if op < 0.5:
            assert index.store(worker, batch) == reference.store(worker, batch)
        elif op < 0.85:
            assert index.remove(worker, batch) == reference.remove(worker, batch)
        elif op < 0.9:
            assert index.clear(worker) == reference.clear(worker)
        else:
            index.replace(worker, batch)
            reference.replace(worker, batch)
        probe = rng.sample(keys, rng.randint(1, 10))
        assert index.match(probe) == reference.match(probe)
    assert index.entry_count() == reference.entry_count()
