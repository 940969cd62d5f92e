"""The prefix cache's namespaces (LoRA adapter, cache salt) and its optional CPU offload tier."""

from __future__ import annotations

import random
from array import array

import pytest

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.prefix_cache import (
    BASE_NAMESPACE,
    CPU,
    GPU,
    CacheNamespace,
    ClearedEvent,
    PrefixCache,
    RemovedEvent,
    StoredEvent,
)
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest


def drain(sched: Scheduler) -> list:
    results = []
    while sched.has_work():
        results.append(sched.step())
    return results


def run(
    sched: Scheduler, name: str, prompt: list[int], namespace: CacheNamespace = BASE_NAMESPACE, max_tokens: int = 1
) -> SimRequest:
    req = SimRequest(name, prompt, max_tokens, namespace=namespace)
    sched.add(req)
    drain(sched)
    return req


# ---------------------------------------------------------------- namespaces


def test_namespaces_never_share_blocks_and_events_say_which_namespace() -> None:
    cache = PrefixCache(64, 4, "t")
    sched = Scheduler(cache, CostModel(), vocab_size=1000)
    prompt = list(range(100, 116))
    adapter = CacheNamespace(lora_name="sql", lora_id=1)
    salted = CacheNamespace(cache_salt="tenant-a")
    hashes = {ns: cache.chain_hashes(prompt, namespace=ns) for ns in (BASE_NAMESPACE, adapter, salted)}
    assert len({h for hs in hashes.values() for h in hs}) == 12  # all twelve blocks differ
    assert cache.chain_hashes(prompt) == hashes[BASE_NAMESPACE] and cache.root_hash() == cache.none_hash
    run(sched, "base", prompt)
    assert run(sched, "lora", prompt, adapter).hit_tokens == 0
    assert run(sched, "salt", prompt, salted).hit_tokens == 0
    assert run(sched, "lora-again", prompt, adapter).hit_tokens == 12  # its own namespace hits
    stored = [e for e in cache.take_events() if isinstance(e, StoredEvent)]
    assert [e.namespace for e in stored[:3]] == [BASE_NAMESPACE, adapter, salted]
    assert stored[1].block_hashes[:3] == hashes[adapter][:3] and stored[1].parent_block_hash is None


def test_decode_blocks_continue_the_namespace_chain() -> None:
    cache = PrefixCache(64, 4, "t")
    sched = Scheduler(cache, CostModel(), vocab_size=1000)
    ns = CacheNamespace(cache_salt="s")
    req = run(sched, "a", [7, 8, 9], ns, max_tokens=6)  # no full prompt block: the first block is a decode block
    first, second = [e for e in cache.take_events() if isinstance(e, StoredEvent)]  # one block per step
    full = (list(req.prompt) + list(req.output))[:8]
    assert first.block_hashes + second.block_hashes == cache.chain_hashes(full, namespace=ns)
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[0]
    assert first.namespace == second.namespace == ns


def test_128_bit_digests_chain_on_the_whole_digest() -> None:
    wide, narrow = PrefixCache(8, 4, "s", digest_bits=128), PrefixCache(8, 4, "s")
    hashes = wide.chain_hashes(list(range(12)))
    assert all(h >= 0 and h.bit_length() <= 128 for h in hashes) and max(h.bit_length() for h in hashes) > 64
    assert [h & ((1 << 64) - 1) for h in hashes] != narrow.chain_hashes(list(range(12)))  # not just a wider mask
    with pytest.raises(ValueError):
        PrefixCache(8, 4, digest_bits=32)


# ---------------------------------------------------------------- CPU tier


def test_eviction_moves_a_block_to_cpu_and_a_hit_loads_it_back() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4, hash_seed="t", cpu_offload_blocks=4)
    sched = Scheduler(cache, CostModel(), vocab_size=1000)
    a = list(range(100, 112))  # 3 blocks; with 1 output token it needs 4 blocks
    run(sched, "a", a)
    a_hashes = cache.chain_hashes(a)
    cache.take_events()
    run(sched, "b", list(range(200, 212)))  # needs all 4 blocks: a's three cached blocks go to the CPU
    events = cache.take_events()
    moves = [e for e in events if e.medium == CPU]
    assert [type(e) for e in events[:2]] == [RemovedEvent, StoredEvent]
    assert events[0] == RemovedEvent([a_hashes[2]], GPU, moved_to=CPU)  # the tail goes first, as vLLM frees it
    assert events[1] == StoredEvent([a_hashes[2]], a_hashes[1], array("I", a[8:12]), CPU, BASE_NAMESPACE, moved_from=GPU)
    assert sorted(e.block_hashes[0] for e in moves) == sorted(a_hashes) and cache.cpu_cached_blocks == 3
    assert cache.longest_cached_prefix(a_hashes) == 3 and cache.cached_blocks == 3  # b's prompt blocks

    again = SimRequest("a2", a + [5], 1)
    sched.add(again)
    first = sched.step()
    assert again.hit_tokens == 12 and again.alloc.loaded_tokens == 12 and first.loaded_tokens == 12
    loads = cache.take_events()[:6]
    assert [(type(e), e.medium) for e in loads] == [(RemovedEvent, CPU), (StoredEvent, GPU)] * 3
    assert [e.block_hashes[0] for e in loads[1::2]] == a_hashes and loads[1].parent_block_hash is None
    assert loads[3].parent_block_hash == a_hashes[0] and loads[3].moved_from == CPU
    assert cache.cpu_hits_tokens == 12 and cache.hits_tokens == 12
    cost = CostModel()
    assert first.seconds == pytest.approx(cost.step_seconds(1, 0) + 12 / cost.cpu_load_tokens_per_s)


def test_the_full_cpu_lru_drops_its_oldest_block() -> None:
    cache = PrefixCache(num_blocks=2, block_size=4, hash_seed="t", cpu_offload_blocks=1)
    sched = Scheduler(cache, CostModel(), vocab_size=1000)
    run(sched, "a", list(range(100, 105)))  # one full block + 1 token: 2 blocks
    run(sched, "b", list(range(200, 205)))  # evicts a's block to the CPU
    cache.take_events()
    run(sched, "c", list(range(300, 305)))  # evicts b's block to the CPU: a's CPU block falls out
    events = cache.take_events()
    dropped = [e for e in events if isinstance(e, RemovedEvent) and e.medium == CPU and e.moved_to is None]
    assert dropped == [RemovedEvent(cache.chain_hashes(list(range(100, 104))), CPU)]
    assert cache.cpu_cached_blocks == 1 and cache.cpu_evicted_blocks == 1


def test_a_block_recomputed_while_on_cpu_leaves_the_cpu_tier() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4, hash_seed="t", cpu_offload_blocks=8)
    tokens = list(range(8))
    hashes = cache.chain_hashes(tokens)
    cache.place_on_cpu(hashes[1:], tokens[4:])  # block 1 only on the CPU (its parent was dropped there)
    alloc = cache.allocate(hashes, 8, 9)
    assert alloc.hit_tokens == 0  # the prefix starts with a miss
    cache.commit(alloc, hashes, tokens)
    assert cache.take_events()[0] == RemovedEvent([hashes[1]], CPU) and cache.cpu_cached_blocks == 0


@pytest.mark.parametrize("cpu_blocks", [0, 6, 40])
def test_events_replayed_per_tier_always_equal_the_cache(cpu_blocks: int) -> None:
    """A random workload on a small cache: applying the events to two sets gives exactly the cache's tiers."""
    cache = PrefixCache(num_blocks=24, block_size=4, hash_seed="t", cpu_offload_blocks=cpu_blocks)
    sched = Scheduler(cache, CostModel(), max_num_batched_tokens=64, max_num_seqs=4, vocab_size=1000)
    rng = random.Random(5)
    prefixes = [[rng.randrange(10, 999) for _ in range(rng.randrange(4, 30))] for _ in range(8)]
    held = {GPU: set(), CPU: set()}

    def apply_events() -> None:
        for e in cache.take_events():
            if isinstance(e, StoredEvent):
                assert not held[e.medium] & set(e.block_hashes)  # never stored twice on one tier
                held[e.medium] |= set(e.block_hashes)
            elif isinstance(e, RemovedEvent):
                assert set(e.block_hashes) <= held[e.medium]
                held[e.medium] -= set(e.block_hashes)
            else:
                pytest.fail(f"unexpected event {e!r}")
        assert held[GPU] == set(cache._refcount) and held[CPU] == set(cache._cpu)
        assert not held[GPU] & held[CPU] and len(held[CPU]) <= cpu_blocks

    loaded = 0
    for i in range(120):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + [rng.randrange(10, 999) for _ in range(rng.randrange(0, 9))]
            sched.add(SimRequest(f"r{i}", prompt, rng.randrange(1, 9)))
        loaded += sched.step().loaded_tokens
        apply_events()
    loaded += sum(r.loaded_tokens for r in drain(sched))
    apply_events()
    assert (loaded > 0) == (cpu_blocks > 0) and cache.cpu_hits_tokens == loaded
    assert cache.evicted_blocks > 100 and (cache.cpu_evicted_blocks > 50) == (cpu_blocks > 0)  # both LRUs were full
    assert cache.reset()
    (cleared,) = cache.take_events()
    assert isinstance(cleared, ClearedEvent) and cache.cpu_cached_blocks == cache.cached_blocks == 0
    assert set(cleared.block_hashes) == held[GPU] | held[CPU] and len(cleared.block_hashes) == len(held[GPU] | held[CPU])


def test_without_a_cpu_tier_the_cache_keeps_no_records() -> None:
    assert PrefixCache(8, 4)._records is None and PrefixCache(8, 4, cpu_offload_blocks=2)._records == {}
    with pytest.raises(ValueError):
        PrefixCache(8, 4, cpu_offload_blocks=-1)
    with pytest.raises(ValueError):
        CostModel(cpu_load_tokens_per_s=0)
