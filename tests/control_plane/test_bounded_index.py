"""BoundedPrefixIndex past its bound (`--max-index-entries`): what it drops and in which order, that a
match only ever under-claims against the unbounded reference, and what stays consistent around it
(speculative claims, per-worker eviction counts, the clock's own memory). Below the bound it is the
conformance suite's third implementation (conftest.py). Every test runs on both backends' bounded index
(BoundedPrefixIndex, NativeBoundedPrefixIndex)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest

from kvroute.fleet.inflight import InflightTracker
from kvroute.prefix_index import (
    TIERS,
    BitmaskPrefixIndex,
    BoundedPrefixIndex,
    SetPrefixIndex,
    Tier,
    TierMatch,
)
from kvroute.prefix_index.native import NativeBoundedPrefixIndex, NativePrefixIndex

GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK


@pytest.fixture(params=[BoundedPrefixIndex, NativeBoundedPrefixIndex], ids=lambda c: c.__name__)
def Bounded(request: pytest.FixtureRequest) -> type:
    """Each backend's bounded index class."""
    return request.param


class ChainForest:
    """Chained keys as engines produce them: a key stands for its whole prefix, so chains that share a
    key share everything before it. New chains branch off a random point of an existing one."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.chains: list[list[int]] = []
        self._next = 1

    def new_chain(self, max_len: int = 12) -> list[int]:
        base: list[int] = []
        if self.chains and self.rng.random() < 0.7:
            parent = self.rng.choice(self.chains)
            base = parent[: self.rng.randint(1, len(parent))]
        chain = base + list(range(self._next, self._next + self.rng.randint(1, max_len)))
        self._next += len(chain) - len(base)
        self.chains.append(chain)
        return chain

    def some_chain(self) -> list[int]:
        return self.rng.choice(self.chains)


def claims(index, workers: range) -> dict[int, set[int]]:
    """Per worker, the keys it holds a speculative claim on (both implementations)."""
    if isinstance(index, SetPrefixIndex):
        return {w: set(index._speculative.get(w, ())) for w in workers}
    if isinstance(index, NativePrefixIndex):
        return {w: index.speculative_keys(w) for w in workers}
    return {w: {key for key, mask in index._speculative.items() if mask >> w & 1} for w in workers}


def at_tier_or_better(match: TierMatch, worker: int) -> tuple[int, int, int, int]:
    """Matched blocks the worker has on gpu, on gpu or cpu, on any tier, and in all (claims too)."""
    depth = match.depth.get(worker, 0)
    cpu, disk = match.cpu_blocks.get(worker, 0), match.disk_blocks.get(worker, 0)
    speculative = match.speculative_blocks.get(worker, 0)
    gpu = depth - cpu - disk - speculative
    return gpu, gpu + cpu, gpu + cpu + disk, depth


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tiered", [True, False], ids=["tiers", "gpu-only"])
def test_bounded_match_never_claims_more_than_the_reference(Bounded: type, seed: int, tiered: bool) -> None:
    """Engines' events and routers' claims applied to the bounded index and to the unbounded
    reference alike: per worker and tier, the bounded index holds a subset, its answer for any chain
    is at most the reference's (blocks on gpu, on gpu or cpu, on any tier, and in all), its eviction
    counts cover what it lacks, claims are untouched, and until the first eviction the answers are
    equal."""
    rng = random.Random(seed)
    bound = 60
    index, reference = Bounded(bound), SetPrefixIndex()
    forest = ChainForest(rng)
    workers = range(6)
    evicted_before = 0
    for step in range(2000):
        worker = rng.choice(workers)
        tier = rng.choice(TIERS) if tiered and rng.random() < 0.3 else GPU
        op = rng.random()
        if op < 0.45:
            chain = forest.new_chain() if rng.random() < 0.4 or not forest.chains else forest.some_chain()
            keys = chain[rng.randrange(len(chain)) :] if rng.random() < 0.3 else chain
            index.store(worker, keys, tier)
            reference.store(worker, keys, tier)
        elif op < 0.7 and forest.chains:
            keys = rng.sample(forest.some_chain(), 1)
            assert index.remove(worker, keys, tier) <= reference.remove(worker, keys, tier)
        elif op < 0.73:
            index.clear(worker)
            reference.clear(worker)
        elif op < 0.76 and forest.chains:
            snapshot = {t: forest.some_chain() for t in (rng.sample(TIERS, 2) if tiered else [GPU])}
            index.replace_all(worker, snapshot)
            reference.replace_all(worker, snapshot)
        elif forest.chains:
            keys = forest.some_chain()
            call = "speculate" if rng.random() < 0.6 else "unspeculate"
            getattr(index, call)(worker, keys)
            getattr(reference, call)(worker, keys)
        assert index.entry_count() <= bound
        if isinstance(index, NativePrefixIndex) and step % 20 == 0:
            index._check()
        assert index.entry_count() == sum(len(index.worker_keys(w, t)) for w in workers for t in TIERS)
        for w in workers:
            evicted = index.evicted_entries(w)
            for t in TIERS:
                ours, truth = index.worker_keys(w, t), reference.worker_keys(w, t)
                assert ours <= truth
                assert len(truth - ours) <= evicted.get(t, 0), (step, w, t)
        assert claims(index, workers) == claims(reference, workers)
        if not forest.chains:
            continue
        for chain in rng.sample(forest.chains, min(4, len(forest.chains))):
            ours, truth = index.match_tiers(chain), reference.match_tiers(chain)
            if index.counters.entries == evicted_before == 0:
                assert ours == truth
            for w in workers:
                mine, theirs = at_tier_or_better(ours, w), at_tier_or_better(truth, w)
                assert all(a <= b for a, b in zip(mine, theirs)), (step, w, ours, truth)
            assert all(index.match(chain).get(w, 0) <= d for w, d in reference.match(chain).items())
            assert set(index.match(chain)) <= set(reference.match(chain))
        evicted_before = index.counters.entries
    assert index.counters.entries > 500  # the bound was reached, and often


def test_equal_to_the_reference_until_the_bound_is_reached(Bounded: type) -> None:
    rng = random.Random(7)
    forest = ChainForest(rng)
    index, reference = Bounded(500), SetPrefixIndex()
    while True:
        chain = forest.new_chain()
        if reference.entry_count() + len(chain) > 500:
            break
        worker = rng.randrange(4)
        index.store(worker, chain)
        reference.store(worker, chain)
    for chain in forest.chains:
        assert index.match_tiers(chain) == reference.match_tiers(chain)
    assert index.counters.entries == 0 and index.evicted_entries(0) == {}


def test_a_chain_loses_its_deepest_blocks_first(Bounded: type) -> None:
    """One store past the bound: what stays is the chain's head, so it still matches that far."""
    index = Bounded(10)
    chain = list(range(100, 130))
    index.store(0, chain)
    assert index.entry_count() == 10
    assert index.match(chain) == {0: 10}
    assert index.worker_keys(0, GPU) == set(chain[:10])
    assert index.evicted_entries(0) == {GPU: 20}
    assert index.counters.keys == index.counters.entries == 20


def test_a_matched_prefix_outlives_prefixes_nobody_asks_for(Bounded: type) -> None:
    index = Bounded(100)
    hot = list(range(1, 41))
    index.store(0, hot)
    for n in range(30):  # 40 new keys a round, the hot prompt asked for in between
        index.store(1 + n % 3, list(range(1000 * (n + 1), 1000 * (n + 1) + 40)))
        assert index.match(hot + [999]) == {0: 40}
    assert index.counters.entries >= 30 * 40 - 60 and index.counters.recently_matched_entries == 0
    # Not asked for any more: it ages out like the rest.
    for n in range(30, 40):
        index.store(1, list(range(1000 * (n + 1), 1000 * (n + 1) + 40)))
    assert index.match(hot) == {}


def test_a_shared_prefix_matched_through_its_descendants_stays(Bounded: type) -> None:
    """Prompts that share a system prompt each mark it: the head of every chain is the last to go."""
    index = Bounded(200)
    system = list(range(1, 21))
    for n in range(200):
        turn = system + list(range(10_000 * (n + 1), 10_000 * (n + 1) + 10))
        index.store(n % 4, turn)
        assert index.match(turn)  # the router asks for it right after it is stored
        assert index.match(system + [5]) and max(index.match(system).values()) == 20
    assert index.counters.entries > 1000 and index.entry_count() <= 200


def test_a_working_set_beyond_the_bound_is_cut_without_scanning_everything(Bounded: type) -> None:
    """Every key recently matched: second chances run out and marked keys go too (and are counted)."""
    index = Bounded(1000)
    chains = [list(range(100 * n, 100 * n + 50)) for n in range(1, 21)]
    for chain in chains[:20]:
        index.store(0, chain)
        for seen in chains:
            index.match(seen)
    assert index.entry_count() == 1000
    index.store(0, list(range(10**6, 10**6 + 10)))
    assert index.entry_count() == 1000
    assert index.counters.recently_matched_entries >= 1


def test_claims_survive_the_eviction_of_their_keys_and_end_cleanly(Bounded: type) -> None:
    """Claims are not entries: dropping a key's entries keeps a live reservation's claim on it, and
    the claim ends (release) with nothing left over in the index or the tracker."""
    index = Bounded(20)
    tracker = InflightTracker(index, default_ttl_s=60.0)
    prompt = list(range(1, 11))
    index.store(0, prompt[:4])
    session = tracker.open_session("router")
    tracker.reserve(session, 1, slot=0, keys=prompt, prefill_tokens=160, prompt_tokens=160, block_size=16)
    assert tracker.claim_count() == 6
    index.store(1, list(range(100, 140)))  # pushes the prompt's entries out
    assert index.worker_keys(0, GPU) == set() and index.match(prompt) == {}
    assert index.match_tiers(prompt) == TierMatch()  # claims start after the held prefix: 1..4 are gone
    assert claims(index, range(2)) == {0: set(prompt[4:]), 1: set()} and tracker.claim_count() == 6
    index.store(0, prompt[:4])  # the engine's events say so again
    assert index.match_tiers(prompt) == TierMatch(depth={0: 10}, speculative_blocks={0: 6})
    tracker.release(session, 1)
    assert tracker.claim_count() == 0 and claims(index, range(2)) == {0: set(), 1: set()}
    if isinstance(index, NativePrefixIndex):
        index._check()
    else:
        assert not index._aux and not index._speculative


def test_evictions_are_counted_per_worker_and_tier_until_its_snapshot(Bounded: type) -> None:
    index = Bounded(6)
    index.store(0, [1, 2, 3], GPU)
    index.store(0, [1, 2, 3], CPU)
    index.store(1, [7, 8])
    assert index.evicted_entries(0) == {GPU: 1, CPU: 1} and index.workers_with_evictions() == 1
    assert index.worker_keys(0, GPU) == {1, 2} and index.worker_keys(1, GPU) == {7, 8}
    index.replace_all(0, {GPU: [1, 2]})  # the worker's whole truth again
    assert index.evicted_entries(0) == {} and index.workers_with_evictions() == 0
    index.store(2, [20, 21, 22, 23])
    assert sum(index.evicted_entries(0).values()) + sum(index.evicted_entries(1).values()) == 2
    index.clear(0)
    index.clear(1)
    assert index.evicted_entries(0) == index.evicted_entries(1) == {}


def test_the_clock_holds_each_key_once_and_forgets_departed_keys(Bounded: type) -> None:
    """Engines remove and re-store blocks all the time: the clock must not grow with that churn."""
    rng = random.Random(3)
    index = Bounded(1 << 30)
    live = list(range(1, 5001))
    index.store(0, live)
    for _ in range(200):
        gone = rng.sample(live, 200)
        index.remove(0, gone)
        index.store(0, gone[:150])  # most come back
        index.store(1, rng.sample(live, 20))
    held = set().union(*(index.worker_keys(w, GPU) for w in range(2)))
    if isinstance(index, NativePrefixIndex):
        index._check()  # each key in the ring once, flagged; departed ones counted right
        ring, departed, _ = index._clock()
    else:
        assert len(index._ring) == len(set(index._ring)) and not index._departed & held
        ring, departed = len(index._ring), len(index._departed)
    assert ring == len(held) + departed
    assert departed * 8 <= ring + 8 * 64


def test_estimated_bytes_agree_with_tracemalloc() -> None:
    """Keys arrive packed (protobuf's repeated fixed64, here an array): each store makes its own int objects."""
    rng = random.Random(0)
    keys = rng.sample(range(1, 2**63), 60_000)
    per_worker = [array("Q", keys[worker::16] + keys[:1000]) for worker in range(16)]
    for make in (
        BitmaskPrefixIndex,
        lambda: BoundedPrefixIndex(1 << 30),
        NativePrefixIndex,
        lambda: NativeBoundedPrefixIndex(1 << 30),
    ):
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        index = make()
        for worker in range(16):
            index.store(worker, per_worker[worker])
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        measured = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert 0.8 < index.estimated_bytes() / measured < 1.2, (make, index.estimated_bytes(), measured)


def test_a_bound_must_be_positive(Bounded: type) -> None:
    with pytest.raises(ValueError, match="positive"):
        Bounded(0)
