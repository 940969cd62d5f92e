"""The sim engine's prefix cache and scheduler behave like vLLM's where routing depends on it."""

from __future__ import annotations

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.prefix_cache import ClearedEvent, PrefixCache, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest


def run_to_first_token(sched: Scheduler, req: SimRequest) -> float:
    sched.add(req)
    elapsed = 0.0
    while True:
        result = sched.step()
        elapsed += result.seconds
        if req in result.first_tokens:
            return elapsed


def drain(sched: Scheduler) -> None:
    while sched.has_work():
        sched.step()


def test_cached_prefix_cuts_ttft_and_counts_hits() -> None:
    cache = PrefixCache(num_blocks=256, block_size=16, hash_seed="t")
    sched = Scheduler(cache, CostModel(), vocab_size=100)
    prompt = list(range(1000, 1000 + 2048))
    cold = run_to_first_token(sched, SimRequest("a", prompt, 4))
    drain(sched)
    warm = run_to_first_token(sched, SimRequest("b", prompt + [7] * 32, 4))
    drain(sched)
    assert warm < cold / 5
    assert cache.queries_tokens == 2048 + 2080 and cache.hits_tokens == 2048
    stored = [e for e in cache.take_events() if isinstance(e, StoredEvent)]
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 128
    assert len(stored[0].token_ids) == 128 * 16


def test_queueing_counts_in_ttft() -> None:
    sched = Scheduler(PrefixCache(1024, 16, "t"), CostModel(), max_num_batched_tokens=2048, vocab_size=100)
    first = SimRequest("a", list(range(4096)), 4)
    second = SimRequest("b", list(range(5000, 9096)), 4)
    sched.add(first)
    t_second = run_to_first_token(sched, second)
    assert t_second > 2 * CostModel().step_seconds(4096, 0) * 0.9


def test_lru_eviction_emits_removed_and_reset_clears() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4, hash_seed="t")
    sched = Scheduler(cache, CostModel(), vocab_size=100)
    for i in range(4):
        sched.add(SimRequest(str(i), list(range(i * 100, i * 100 + 12)), 1))
        drain(sched)
    events = cache.take_events()
    assert any(isinstance(e, RemovedEvent) for e in events)
    assert cache.cached_blocks <= 8
    oldest = cache.chain_hashes(list(range(12)))
    assert cache.longest_cached_prefix(oldest) == 0  # the least recently used prompt went first
    assert cache.reset() and isinstance(cache.take_events()[-1], ClearedEvent) and cache.cached_blocks == 0


# ---------------------------------------------------------------- the pure cache on its own


def cached_request(cache: PrefixCache, tokens: list[int], extra_tokens: int = 0):
    """Allocate, compute and cache every full prompt block of `tokens`; returns the (pinned) allocation."""
    hashes = cache.chain_hashes(tokens)
    alloc = cache.allocate(hashes, len(tokens), len(tokens) + extra_tokens)
    assert alloc is not None
    start = alloc.hit_tokens // cache.block_size
    cache.commit(alloc, hashes[start:], tokens[start * cache.block_size : len(hashes) * cache.block_size])
    return alloc


def test_chain_hashes_are_chained_seeded_and_uint64() -> None:
    a, b = PrefixCache(8, 4, "s"), PrefixCache(8, 4, "s")
    tokens = list(range(12))
    assert a.chain_hashes(tokens) == b.chain_hashes(tokens)
    assert a.chain_hashes(tokens) != PrefixCache(8, 4, "other").chain_hashes(tokens)
    assert PrefixCache(8, 4).chain_hashes(tokens) != PrefixCache(8, 4).chain_hashes(tokens)  # random NONE_HASH
    first, rest = a.chain_hashes(tokens[:4]), a.chain_hashes(tokens[4:], parent=a.chain_hashes(tokens[:4])[-1])
    assert first + rest == a.chain_hashes(tokens)
    assert a.chain_hashes(tokens + [99]) == a.chain_hashes(tokens)  # only full blocks
    assert all(0 <= h < 2**64 for h in a.chain_hashes(tokens))
    assert a.chain_hashes([5, 6, 7, 8] + tokens[4:])[1] != a.chain_hashes(tokens)[1]  # the parent is hashed in


def test_hit_accounting_counts_prompt_tokens_and_cached_tokens() -> None:
    cache = PrefixCache(64, 4, "t")
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    alloc = cached_request(cache, prompt, 3)
    assert alloc.hit_tokens == 0 and (cache.queries_tokens, cache.hits_tokens) == (10, 0)
    stored = cache.take_events()
    assert stored == [StoredEvent(cache.chain_hashes(prompt), None, prompt[:8])]
    cache.release(alloc)
    again = cache.allocate(cache.chain_hashes(prompt + [50, 51]), 12, 14)
    assert again.hit_tokens == 8 and (cache.queries_tokens, cache.hits_tokens) == (22, 8)
    # A prompt that is entirely cached still computes its last token: one block is recomputed.
    cache.release(again)
    exact = cache.allocate(cache.chain_hashes(prompt[:8]), 8, 9)
    assert exact.hit_tokens == 4


def test_pinned_blocks_are_never_evicted_and_a_full_cache_makes_requests_wait() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4, hash_seed="t")
    a = cached_request(cache, list(range(8)))  # 2 blocks, pinned
    assert cache.allocate(cache.chain_hashes(list(range(100, 112))), 12, 12) is None  # needs 3, only 2 free
    assert cache.take_events()[-1] == StoredEvent(cache.chain_hashes(list(range(8))), None, list(range(8)))
    assert not [e for e in cache.events if isinstance(e, RemovedEvent)]
    cache.release(a)
    b = cache.allocate(cache.chain_hashes(list(range(100, 112))), 12, 12)
    assert b is not None
    removed = [e for e in cache.take_events() if isinstance(e, RemovedEvent)]
    assert len(removed) == 1 and all(len(e.block_hashes) == 1 for e in removed)  # one event per evicted block
    # vLLM frees a request's blocks tail first, so the chain's last block went before its first one.
    assert removed[0].block_hashes == [cache.chain_hashes(list(range(8)))[1]]
    assert cache.longest_cached_prefix(cache.chain_hashes(list(range(8)))) == 1


def test_eviction_is_least_recently_used_first_and_a_hit_refreshes() -> None:
    cache = PrefixCache(num_blocks=7, block_size=4, hash_seed="t")
    prompts = [list(range(i * 100, i * 100 + 8)) for i in range(3)]  # 2 blocks each, 1 block left free
    for p in prompts:
        cache.release(cached_request(cache, p))
    cache.release(cache.allocate(cache.chain_hashes(prompts[0] + [1]), 9, 9))  # touch prompt 0 (hit)
    cache.take_events()
    cache.release(cached_request(cache, list(range(900, 912))))  # needs 3 blocks: evicts prompt 1
    removed = [h for e in cache.take_events() if isinstance(e, RemovedEvent) for h in e.block_hashes]
    assert sorted(removed) == sorted(cache.chain_hashes(prompts[1]))
    assert cache.longest_cached_prefix(cache.chain_hashes(prompts[0])) == 2
    assert cache.longest_cached_prefix(cache.chain_hashes(prompts[2])) == 2
    assert cache.evicted_blocks == 2 and cache.cached_blocks == 7


def test_a_request_that_cannot_fit_changes_nothing() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4, hash_seed="t")
    for p in (list(range(8)), list(range(50, 58))):
        cache.release(cached_request(cache, p))
    pinned = cache.allocate(cache.chain_hashes(list(range(8)) + [1]), 9, 9)  # pins 2, needs 1 more (evicts)
    order_before = cache.true_block_hashes()
    assert cache.allocate(cache.chain_hashes(list(range(200, 216))), 16, 16) is None
    assert cache.true_block_hashes() == order_before
    cache.release(pinned)
    import pytest

    from kvroute.tools.sim_engine.prefix_cache import CacheFullError

    with pytest.raises(CacheFullError, match="needs 5 KV blocks"):
        cache.allocate(cache.chain_hashes(list(range(20))), 20, 20)


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    cache = PrefixCache(16, 4, "t")
    alloc = cached_request(cache, list(range(8)), 4)
    cache.take_events()
    assert cache.usage() > 0 and not cache.reset() and cache.take_events() == []
    cache.release(alloc)
    assert cache.usage() == 0 and cache.cached_blocks == 2
    assert cache.reset() and cache.take_events() == [ClearedEvent(cache.chain_hashes(list(range(8))))]
    assert cache.true_block_hashes() == [] and cache.free_blocks() == 16


def test_concurrent_identical_prompts_share_blocks_and_store_once() -> None:
    cache = PrefixCache(16, 4, "t")
    tokens = list(range(8))
    hashes = cache.chain_hashes(tokens)
    a = cache.allocate(hashes, 8, 9)
    b = cache.allocate(hashes, 8, 9)  # nothing cached yet: both compute
    cache.commit(a, hashes, tokens)
    cache.commit(b, hashes, tokens)
    assert [e for e in cache.take_events() if isinstance(e, StoredEvent)] == [StoredEvent(hashes, None, tokens)]
    cache.release(a)
    assert cache.usage() > 0  # still pinned by b
    cache.release(b)
    assert cache.usage() == 0 and cache.cached_blocks == 2
