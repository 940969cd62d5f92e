"""The sim engine's prefix cache and scheduler behave like vLLM's where routing depends on it."""

from __future__ import annotations

from sim_engine.cost_model import CostModel
from sim_engine.prefix_cache import ClearedEvent, PrefixCache, RemovedEvent, StoredEvent
from sim_engine.scheduler import Scheduler, SimRequest


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
