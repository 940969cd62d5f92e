"""One conformance suite, run against every PrefixIndex implementation (tiers and speculative
holders included); then what only the native index adds (packed keys, columns, errors, its memory)."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import tracemalloc
from array import array

import pytest

from kvroute.fleet.entries import pack_keys
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
from kvroute.prefix_index.native import NativeBoundedPrefixIndex, NativePrefixIndex
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
    index.store(1, [4], CPU)  # cpu and disk: counts as cpu
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
        depth={0: 4, 1: 2, 2: 2}, cpu_blocks={1: 1}, speculative_blocks={0: 2, 1: 1, 2: 2}
    )
    assert index.match([1, 2, 3]) == {0: 2, 1: 1}  # `match` is confirmed entries only
    # A claim on a key the worker already holds adds nothing; claims are not entries.
    index.speculate(0, [1])
    assert index.match_tiers([1, 2]) == TierMatch(depth={0: 2, 1: 2, 2: 2}, cpu_blocks={1: 1}, speculative_blocks={1: 1, 2: 2})
    assert index.entry_count() == 3 and index.worker_keys(2, GPU) == set() and index.clear(2) == 0
    assert [index.held_prefix(w, [1, 2, 3]) for w in range(3)] == [2, 1, 0]
    index.unspeculate(0, [1, 3])
    index.unspeculate(2, [1, 2])
    index.unspeculate(3, [1])  # never claimed: nothing to do
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 2, 1: 2}, cpu_blocks={1: 1}, speculative_blocks={1: 1})
    # Confirmed later on a tier: the worker holds it, the claim no longer counts as speculative.
    index.store(1, [2], DISK)
    assert index.match_tiers([1, 2]) == TierMatch(depth={0: 2, 1: 2}, cpu_blocks={1: 1}, disk_blocks={1: 1})


def test_claims_and_offloads_on_other_prompts_leave_this_match_alone(index: PrefixIndex) -> None:
    index.store(0, [1, 2, 3], GPU)
    index.store(1, [1, 2], GPU)
    index.store(2, [50, 51], CPU)  # offloaded, another prompt
    index.speculate(3, [60, 61])  # in flight, another prompt's tail
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 3, 1: 2})
    assert index.match_tiers((1, 2, 3)) == TierMatch(depth={0: 3, 1: 2})  # any sequence, not only lists
    index.speculate(1, [3])  # now one key of this prompt is claimed: the tiered walk counts it
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
@pytest.mark.parametrize(
    ("impl", "workers"),
    [
        (NativePrefixIndex, 8),
        (lambda: NativeBoundedPrefixIndex(1 << 40), 8),
        (BitmaskPrefixIndex, 8),
        (lambda: BoundedPrefixIndex(1 << 40), 8),
        (NativePrefixIndex, 300),
        (lambda: NativeBoundedPrefixIndex(1 << 40), 300),
    ],
    ids=[
        "NativePrefixIndex",
        "NativeBoundedPrefixIndexUnreached",
        "BitmaskPrefixIndex",
        "BoundedPrefixIndexUnreached",
        "NativePrefixIndex-300-workers",
        "NativeBoundedPrefixIndexUnreached-300-workers",
    ],
)
def test_random_operations_agree_with_reference(impl: type, tiered: bool, seed: int, workers: int) -> None:
    """SetPrefixIndex is the oracle every other implementation must agree with. With 300 workers a key
    has many holders (the native index then keeps them out of line, sorted, and bisects them)."""
    index = impl()
    rng = random.Random(seed)
    reference = SetPrefixIndex()
    keys = list(range(40))
    check = getattr(index, "_check", lambda: None)  # the native index's own invariants (O(index): now and then)
    for step in range(2000 if workers < 100 else 600):  # the reference walks every worker: slow with 300
        op = rng.random()
        worker = rng.randrange(workers)
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
            by_tier = {
                t: rng.sample(keys, rng.randint(0, 4))
                for t in rng.sample(TIERS if tiered else [GPU], rng.randint(0, 1 + 2 * tiered))
            }
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
        if step % 50 == 0:
            check()
    check()
    assert index.entry_count() == reference.entry_count()


# ------------------------------------------------------------ the native index only

NATIVE = [NativePrefixIndex, lambda: NativeBoundedPrefixIndex(1 << 40)]
NATIVE_IDS = ["NativePrefixIndex", "NativeBoundedPrefixIndexUnreached"]


def repeated_fixed64(keys: list[int]):
    """Keys as the control plane receives them: a protobuf repeated fixed64 field."""
    event = pb.BlocksStored()
    event.block_keys.extend(keys)
    return event.block_keys


@pytest.mark.parametrize("make", NATIVE, ids=NATIVE_IDS)
def test_native_takes_keys_packed_or_as_any_iterable(make) -> None:
    """Packed little-endian u64 bytes (pack_keys), array('Q'), protobuf repeated fields, tuples, sets and
    generators all mean the same keys as a list."""
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(100)] + [0, 2**64 - 1]
    forms = [
        list,
        tuple,
        pack_keys,
        lambda k: bytearray(pack_keys(k)),
        lambda k: memoryview(pack_keys(k)),
        lambda k: array("Q", k),
        repeated_fixed64,
        iter,
        lambda k: (key for key in k),
    ]
    for worker, form in enumerate(forms):
        index = make()
        assert index.store(worker, form(keys), CPU) == len(keys)
        assert index.worker_keys(worker, CPU) == set(keys)
        assert index.match_tiers(form(keys)) == TierMatch(depth={worker: len(keys)}, cpu_blocks={worker: len(keys)})
        assert index.held_prefix(worker, form(keys)) == len(keys)
        assert index.remove(worker, form(keys), CPU) == len(keys)
        assert index.entry_count() == 0
        index._check()
    assert make().store(0, set(keys)) == len(keys)


@pytest.mark.parametrize("make", NATIVE, ids=NATIVE_IDS)
def test_native_refuses_bad_input_and_changes_nothing(make) -> None:
    index = make()
    index.store(0, [1, 2, 3])
    for bad, error, words in (
        ([1, -5], OverflowError, "unsigned 64-bit"),
        ([1, 2**64], OverflowError, "unsigned 64-bit"),
        ([1, "2"], TypeError, "ints"),
        ([1, 2.0], TypeError, "ints"),
        (b"\x01" * 12, ValueError, "64-bit words"),
        (array("i", [1, 2]), ValueError, "64-bit words"),
        (None, TypeError, "not iterable"),
    ):
        for call in (index.store, index.remove, index.speculate, index.replace):
            with pytest.raises(error, match=words):
                call(0, bad)
        with pytest.raises(error, match=words):
            index.match(bad)
    for slot in (-1, 2**27, 2**40):
        with pytest.raises((ValueError, OverflowError)):
            index.store(slot, [1])
    with pytest.raises(ValueError, match="tier"):
        index.store(0, [1], 3)
    with pytest.raises(TypeError):
        index.store(0, [1], tier="gpu")
    with pytest.raises(TypeError, match="unexpected keyword"):
        index.store(0, [1], level=0)
    assert index.store(worker=0, keys=[4], tier=GPU) == 1  # keywords as the protocol names them
    assert index.worker_keys(0, GPU) == {1, 2, 3, 4} and index.entry_count() == 4
    assert index.match([1, 2, 3, 4]) == {0: 4} and index.speculative_keys(0) == set()
    index._check()


@pytest.mark.parametrize("make", NATIVE, ids=NATIVE_IDS)
def test_native_columns_are_match_tiers_in_slot_order(make) -> None:
    rng = random.Random(5)
    index = make()
    prompt = [rng.getrandbits(64) for _ in range(64)]
    for worker in range(20):
        held = prompt[: rng.randrange(65)]
        cut = rng.randrange(len(held) + 1)
        index.store(worker, held[:cut], GPU)
        index.store(worker, held[cut:], rng.choice([CPU, DISK]))
        if worker % 3 == 0:
            index.speculate(worker, prompt[len(held) : len(held) + 5])
    match = index.match_tiers(prompt)
    slots = [7, 3, 19, 0, 25, 1000, 12]  # any order; slots the index never saw answer 0
    columns = index.match_columns(prompt, slots)
    for column, counts in zip(columns, (match.depth, match.cpu_blocks, match.disk_blocks, match.speculative_blocks)):
        assert column == [counts.get(slot, 0) for slot in slots]
    assert index.match_columns([], slots) == ([0] * 7,) * 4 and index.match_columns(prompt, []) == ([], [], [], [])
    index._check()


def test_native_keys_with_thousands_of_holders() -> None:
    """A system prompt every worker of a large fleet holds: holders stay sorted, found by bisection, and
    removing them one by one in any order leaves nothing behind."""
    index, reference = NativePrefixIndex(), SetPrefixIndex()
    system = list(range(1, 9))
    workers = list(range(3000))
    random.Random(2).shuffle(workers)
    for worker in workers:
        for impl in (index, reference):
            impl.store(worker, system + [10_000 + worker])
    assert index.match(system) == reference.match(system) and len(index.match(system)) == 3000
    assert index.held_prefix(2999, system + [12_999]) == 9
    index._check()
    for worker in workers[:2990]:
        assert index.remove(worker, system) == reference.remove(worker, system) == 8
        assert index.clear(worker) == reference.clear(worker) == 1
    assert index.match(system) == reference.match(system) and len(index.match(system)) == 10
    assert index.entry_count() == reference.entry_count() == 90
    index._check()


def test_native_holders_shrinking_back_are_counted_right() -> None:
    """A key many workers held, then few: its holder array shrinks (and moves), and the count of what the
    index holds stays exact (_check recounts every structure against it)."""
    index = NativePrefixIndex()
    for worker in range(64):
        index.store(worker, [1, 2, 3])
    full = index.estimated_bytes()
    for worker in range(60):
        index.remove(worker, [1, 2, 3])
        index._check()
    assert index.estimated_bytes() < full and index.match([1, 2, 3]) == {60: 3, 61: 3, 62: 3, 63: 3}


@pytest.mark.parametrize("make", NATIVE, ids=NATIVE_IDS)
def test_native_small_index_stays_small(make) -> None:
    """A fleet's first blocks: the records' first chunk grows with them (kvroute_cp_index_bytes_per_entry
    of a young control plane says what an entry costs, not what an empty chunk does)."""
    index = make()
    for prompt in range(14):
        index.store(0, range(100 * (prompt + 1), 100 * (prompt + 1) + 5))
    index._check()
    assert index.entry_count() == 70 and index.estimated_bytes() / 70 < 100, index.estimated_bytes()


def test_native_memory_per_entry_and_no_leak_across_cycles() -> None:
    """Below 64 bytes per (key, worker, tier) entry (estimated_bytes is exact, and tracemalloc sees the
    same), and store/remove/clear/claim cycles leave the process's traced memory where it was: no
    native block and no Python object (a result, a key) is lost on the way."""
    rng = random.Random(0)
    keys = rng.sample(range(1, 2**63), 120_000)
    per_worker = [pack_keys(keys[w::8] + keys[:2000]) for w in range(8)]  # some keys on every worker
    probe = keys[:2000]

    def cycle(index) -> None:
        for worker, packed in enumerate(per_worker):
            index.remove(worker, packed[: len(packed) // 2])
            if worker % 2:
                index.clear(worker)
            index.speculate(worker, packed[:800])
            index.match_tiers(probe)
            index.worker_keys(worker, GPU)
        for worker, packed in enumerate(per_worker):
            index.unspeculate(worker, packed[:800])
            index.store(worker, packed)
            index.match_columns(probe, list(range(8)))

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        index = NativePrefixIndex()
        for worker, packed in enumerate(per_worker):
            index.store(worker, packed)
        after = tracemalloc.take_snapshot()
        measured = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        entries = index.entry_count()
        assert entries == 120_000 + 7 * 2000
        assert 0.95 < index.estimated_bytes() / measured < 1.05, (index.estimated_bytes(), measured)
        assert index.estimated_bytes() / entries <= 64, index.estimated_bytes() / entries
        full = index.estimated_bytes()
        cycle(index)  # tables at their working size
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
        for _ in range(5):
            cycle(index)
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - traced < 4096  # a leaked int per walk would be 10x that
    finally:
        tracemalloc.stop()
    assert index.entry_count() == entries and index.estimated_bytes() <= full * 1.02
    index._check()
    for worker in range(8):
        index.clear(worker)
    assert index.entry_count() == 0 and index.estimated_bytes() < 4096  # tables shrink, the last key frees the records


# ------------------------------------------------------------ choosing the backend


@pytest.mark.parametrize(
    ("backend", "bound", "kind"),
    [
        ("auto", 0, NativePrefixIndex),
        ("native", 10, NativeBoundedPrefixIndex),
        ("bitmask", 0, BitmaskPrefixIndex),
        ("bitmask", 10, BoundedPrefixIndex),
    ],
)
def test_the_control_plane_holds_the_backend_it_is_configured_with(backend: str, bound: int, kind: type) -> None:
    """--index-backend and --max-index-entries pick the index; its bound and evictions are exported whichever it is."""
    from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer

    server = ControlPlaneServer(ControlPlaneConfig(index_backend=backend, max_index_entries=bound))
    index = server.registry.index
    assert type(index) is kind and server.inflight.index is index
    index.store(0, list(range(1, 31)))
    metrics = server.metrics_registry
    assert metrics.get_sample_value("kvroute_cp_index_max_entries") == bound
    assert metrics.get_sample_value("kvroute_cp_index_evicted_entries_total", {"recently_matched": "false"}) == (
        20 if bound else 0
    )
    assert metrics.get_sample_value("kvroute_cp_index_bytes_per_entry") > 0


def test_native_asked_for_without_the_build_is_one_line_and_exit_2() -> None:
    """An install that did not build the extension: `native` says so in one line (exit 2); `auto` falls back."""
    blocked = "import sys; sys.modules['kvroute.prefix_index._native'] = None; "  # import fails as without the .so
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked + "from kvroute.cli import main; sys.exit(main(["
            "'control-plane', '--index-backend', 'native', '--listen', '127.0.0.1:0']))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert asked.returncode == 2 and asked.stdout == "", asked
    assert asked.stderr.count("\n") == 1 and "--index-backend native" in asked.stderr and "not built" in asked.stderr
    fallback = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked + "from kvroute.prefix_index import make_index; "
            "print(type(make_index('auto')).__name__, type(make_index('auto', 5)).__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert fallback.stdout.split() == ["BitmaskPrefixIndex", "BoundedPrefixIndex"], fallback


def test_the_simulator_is_bit_for_bit_the_same_on_either_backend() -> None:
    """The whole simulation (policies reading the index, caches small enough to evict) agrees to the last float."""
    from kvroute.tools.simulator import fleet
    from kvroute.tools.simulator.workloads import GeneratedWorkload, generate

    workload = generate(GeneratedWorkload("shared-prefix", requests=300, rate_rps=8, groups=32, seed=3))
    runs = {}
    for backend in ("native", "bitmask"):
        config = fleet.FleetConfig(workers=8, num_blocks=256, block_size=16, seed=3, index_backend=backend)
        runs[backend] = fleet.simulate_policy("kv_aware", workload, config)
    assert runs["native"] == runs["bitmask"] and runs["native"].hit_rate > 0
