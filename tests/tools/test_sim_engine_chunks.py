"""Per-chunk caching, as vLLM v1 does it: a prompt's full blocks enter the prefix cache (and go out as
BlockStored) when the chunk that computes them is scheduled, so requests admitted later, in the same
step or after, hit them; eviction sees exactly the blocks computed so far."""

from __future__ import annotations

import asyncio

from kvroute.prom_text import sample_sums
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.engine import EngineConfig, SimEngine
from kvroute.tools.sim_engine.prefix_cache import CacheEvent, PrefixCache, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest
from kvroute.tools.sim_engine.tokenizer import load_engine_tokenizer
from tests.helpers import eventually

BS = 16


def make(budget: int, num_blocks: int = 256, **kw) -> Scheduler:
    return Scheduler(PrefixCache(num_blocks, BS, "t"), CostModel(), max_num_batched_tokens=budget, vocab_size=1000, **kw)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stored(events: list[CacheEvent]) -> list[StoredEvent]:
    return [e for e in events if isinstance(e, StoredEvent)]


def test_each_scheduled_chunk_stores_the_blocks_it_fills() -> None:
    sched = make(budget=40)
    prompt = tokens(100, 100)  # 6 full blocks, chunks of 40 tokens: blocks end at 32, 80 and 96
    sched.add(SimRequest("a", prompt, 4))
    hashes = sched.cache.chain_hashes(prompt)
    per_step = []
    while not sched.running or not sched.running[0].prefill_done:
        sched.step()
        per_step.append(stored(sched.cache.take_events()))
    assert [[e.block_hashes for e in events] for events in per_step] == [[hashes[0:2]], [hashes[2:5]], [hashes[5:6]]]
    assert [e.parent_block_hash for events in per_step for e in events] == [None, hashes[1], hashes[4]]
    assert [list(events[0].token_ids) for events in per_step] == [prompt[0:32], prompt[32:80], prompt[80:96]]


def test_a_request_admitted_in_the_step_of_the_last_chunk_hits_every_block_scheduled_so_far() -> None:
    sched = make(budget=64)
    shared = tokens(100, 160)  # 10 blocks
    a = SimRequest("a", shared + tokens(900, 40), 2)  # 200 tokens: 64, 64, 64, then 8 and room for b
    sched.add(a)
    for _ in range(2):
        sched.step()
    b = SimRequest("b", shared + tokens(5000, 30), 2)  # arrives while a is prefilling
    sched.add(b)
    assert sched.step().admitted == []  # a's third chunk takes the whole budget: b waits
    result = sched.step()
    # b is admitted in the step that schedules a's last chunk, after it, and finds every full block a
    # has scheduled, those of this very step included (vLLM caches blocks in allocate_slots).
    assert result.admitted == [b] and a in result.first_tokens
    assert b.hit_tokens == 160
    assert sched.cache.queries_tokens == 200 + 190 and sched.cache.hits_tokens == 160


def test_requests_admitted_together_share_what_the_first_one_schedules() -> None:
    sched = make(budget=1024)
    system = tokens(100, 320)
    a, b = SimRequest("a", system + tokens(900, 10), 2), SimRequest("b", system + tokens(2000, 10), 2)
    sched.add(a)
    sched.add(b)
    result = sched.step()
    assert result.admitted == [a, b] and (a.hit_tokens, b.hit_tokens) == (0, 320)
    assert result.prefill_tokens == 330 + 10
    assert [len(e.block_hashes) for e in stored(sched.cache.take_events())] == [20]  # b stores nothing new


def test_a_queued_request_looks_the_cache_up_when_admitted_not_when_it_arrived() -> None:
    sched = make(budget=32, max_num_seqs=1)
    shared = tokens(100, 96)
    a = SimRequest("a", shared + tokens(900, 4), 3)
    b = SimRequest("b", shared + tokens(2000, 20), 2)
    sched.add(a)
    sched.add(b)  # nothing is cached yet, and no sequence slot is free until a finishes
    while b.alloc is None:
        sched.step()
    assert b.hit_tokens == 96
    # Counted once, when admitted (vLLM records at admission, not per lookup).
    assert sched.cache.queries_tokens == 100 + 116 and sched.cache.hits_tokens == 96


def test_an_aborted_prefill_leaves_its_computed_chunks_cached_and_they_are_evicted_tail_first() -> None:
    sched = make(budget=64, num_blocks=12)
    prompt = tokens(100, 160)  # 10 blocks; two steps compute 8
    sched.add(SimRequest("a", prompt, 2))
    sched.step()
    sched.step()
    hashes = sched.cache.chain_hashes(prompt)
    assert sched.abort("a") and sched.cache.cached_blocks == 8 and sched.cache.usage() == 0
    later = SimRequest("later", prompt + tokens(900, 8), 2)
    sched.add(later)
    sched.step()
    assert later.hit_tokens == 128  # exactly the chunks a computed
    assert sched.abort("later") and sched.cache.cached_blocks == 10
    sched.cache.take_events()
    # A 5-block request finds 2 free blocks and evicts 3, the least recently used: the prompt's tail
    # (a finished or aborted request's blocks are unpinned tail first).
    sched.add(SimRequest("other", tokens(5000, 70), 10))
    sched.step()
    removed = [h for e in sched.cache.take_events() if isinstance(e, RemovedEvent) for h in e.block_hashes]
    assert removed == [hashes[9], hashes[8], hashes[7]]


def test_blocks_of_a_running_prefill_are_pinned_so_a_newcomer_waits_instead_of_evicting_them() -> None:
    sched = make(budget=48, num_blocks=12)
    a = SimRequest("a", tokens(100, 144), 16)  # 10 blocks with its output; 3 cached after the first step
    sched.add(a)
    sched.step()
    assert sched.cache.cached_blocks == 3 and sched.cache.evictable_blocks == 0
    b = SimRequest("b", tokens(5000, 40), 8)  # needs 3 blocks, 2 are free
    sched.add(b)
    sched.cache.take_events()
    while not a.prefill_done:
        sched.step()
        assert b.alloc is None
    assert not any(isinstance(e, RemovedEvent) for e in sched.cache.take_events())


async def test_the_engine_publishes_one_batch_per_chunk_and_counts_the_hit(tiny_model_dir) -> None:
    class Batches:
        def __init__(self) -> None:
            self.batches: list[list[CacheEvent]] = []

        def start(self) -> None: ...

        def publish(self, events: list[CacheEvent]) -> None:
            if events:
                self.batches.append(events)

        def inject_faults(self, drop_next_batches: int = 0, restart: bool = False) -> dict[str, int]:
            return {}

        async def aclose(self) -> None: ...

    publisher = Batches()
    config = EngineConfig(num_blocks=256, block_size=BS, max_model_len=1024, max_num_batched_tokens=64)
    slow = CostModel(prefill_tokens_per_s=320)  # 0.2 s per 64-token step: time to send the second request
    engine = SimEngine(config, load_engine_tokenizer(tiny_model_dir), slow, publisher)
    engine.start()
    try:
        shared = tokens(100, 320)
        first = asyncio.ensure_future(_drain(engine, shared + tokens(900, 20), 1))  # 340 tokens: 6 steps
        await eventually(lambda: publisher.batches, timeout=10)
        second = asyncio.ensure_future(_drain(engine, shared + tokens(2000, 10), 1))
        await asyncio.gather(first, second)
    finally:
        await engine.stop()
    sizes = [sum(len(e.block_hashes) for e in stored(batch)) for batch in publisher.batches]
    # The shared prefix's 20 blocks, a chunk of 4 per step, then the first prompt's last full block;
    # the second request, admitted in that last step, hits all 20 and fills no block of its own.
    assert sizes == [4, 4, 4, 4, 4, 1]
    body, _ = engine.render_metrics()
    counters = sample_sums(body.decode(), {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"})
    assert counters == {"vllm:prefix_cache_hits_total": 320.0, "vllm:prefix_cache_queries_total": 340.0 + 330.0}


async def _drain(engine: SimEngine, prompt: list[int], max_tokens: int) -> None:
    async for _ in engine.generate(prompt, max_tokens):
        pass
