"""The sim engine's continuous-batching scheduler: TTFT from the cost model, chunked prefill, blocks."""

from __future__ import annotations

import itertools

import pytest

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.prefix_cache import CacheFullError, PrefixCache, StoredEvent
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest

COST = CostModel()


def make(num_blocks: int = 4096, block_size: int = 16, **kw) -> Scheduler:
    return Scheduler(PrefixCache(num_blocks, block_size, "t"), COST, vocab_size=1000, **kw)


def run(sched: Scheduler, *requests: SimRequest) -> dict[str, float]:
    """Add requests together at t=0, run to completion; returns request id -> TTFT."""
    for r in requests:
        sched.add(r)
    t, ttft = 0.0, {}
    while sched.has_work():
        result = sched.step()
        t += result.seconds
        for r in result.first_tokens:
            ttft[r.request_id] = t
    return ttft


def test_ttft_grows_with_uncached_tokens() -> None:
    ttfts = [run(make(), SimRequest("a", list(range(n)), 2))["a"] for n in (256, 2048, 8000, 20000)]
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 4
    assert ttfts[1] == pytest.approx(COST.step_seconds(2048, 0))  # one step, prefill only
    # 20000 tokens at 8192 per step: three chunked-prefill steps.
    assert ttfts[3] == pytest.approx(2 * COST.step_seconds(8192, 0) + COST.step_seconds(20000 - 2 * 8192, 0))


def test_ttft_grows_with_queueing_behind_other_prefills() -> None:
    sched = make(max_num_batched_tokens=4096)
    ttft = run(sched, *(SimRequest(str(i), list(range(i * 10_000, i * 10_000 + 4096)), 2) for i in range(4)))
    assert ttft["0"] < ttft["1"] < ttft["2"] < ttft["3"]
    assert ttft["3"] > 3 * COST.step_seconds(4096, 0)


def test_cached_prefix_shrinks_ttft_and_sets_hit_tokens() -> None:
    sched = make()
    system = list(range(5000, 5000 + 4096))
    cold = run(sched, SimRequest("cold", system + [1, 2, 3], 4))["cold"]
    warm_req = SimRequest("warm", system + [7, 8, 9, 10], 4)
    warm = run(sched, warm_req)["warm"]
    assert warm_req.hit_tokens == 4096 and warm < cold / 10
    assert warm == pytest.approx(COST.step_seconds(4, 0))


def test_decodes_share_the_budget_with_chunked_prefill() -> None:
    sched = make(max_num_batched_tokens=1000)
    short = SimRequest("short", list(range(10)), 10)
    sched.add(short)
    sched.step()  # short's prefill + first token
    long = SimRequest("long", list(range(100, 2600)), 2)
    sched.add(long)
    prefill_per_step = []
    while not long.prefill_done:
        result = sched.step()
        prefill_per_step.append(result.prefill_tokens)
        assert (short, short.output[-1]) in result.new_tokens  # short keeps decoding meanwhile
        assert result.seconds == pytest.approx(COST.step_seconds(result.prefill_tokens, 1, result.context_tokens))
    assert prefill_per_step == [999, 999, 502]


def test_max_num_seqs_limits_the_running_batch() -> None:
    sched = make(max_num_seqs=2)
    for i in range(5):
        sched.add(SimRequest(str(i), list(range(i * 100, i * 100 + 20)), 8))
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    while sched.has_work():
        assert len(sched.step().first_tokens) <= 2 and len(sched.running) <= 2


def test_output_length_is_max_tokens_and_tokens_avoid_special_ids() -> None:
    sched = make(min_token_id=7)
    req = SimRequest("a", list(range(40)), 9)
    run(sched, req)
    assert len(req.output) == 9 and all(7 <= t < 1000 for t in req.output)


def test_decode_blocks_are_stored_chained_to_the_prompt() -> None:
    sched = make(block_size=4)
    req = SimRequest("a", list(range(10)), 12)  # 22 tokens: 2 prompt blocks + 3 more with output
    run(sched, req)
    stored = [e for e in sched.cache.take_events() if isinstance(e, StoredEvent)]
    assert len(stored[0].block_hashes) == 2 and stored[0].parent_block_hash is None
    assert list(stored[0].token_ids) == list(range(8))
    chain = [h for e in stored for h in e.block_hashes]
    assert chain == sched.cache.chain_hashes(req.prompt + req.output[:-1])  # the newest token has no KV yet
    for prev, ev in itertools.pairwise(stored):
        assert ev.parent_block_hash == prev.block_hashes[-1]
    assert [t for e in stored for t in e.token_ids] == list(req.prompt + req.output)[: len(chain) * 4]
    assert sched.cache.usage() == 0  # finished: everything unpinned


def test_abort_releases_blocks_and_rejects_impossible_requests() -> None:
    sched = make(num_blocks=8, block_size=4)
    req = SimRequest("a", list(range(20)), 4)
    sched.add(req)
    sched.step()
    assert sched.cache.usage() > 0
    assert sched.abort("a") and not sched.has_work() and sched.cache.usage() == 0
    assert not sched.abort("a")
    with pytest.raises(CacheFullError):
        sched.add(SimRequest("big", list(range(40)), 1))
    with pytest.raises(ValueError):
        sched.add(SimRequest("empty", [], 1))


@pytest.mark.parametrize("cost", [COST, CostModel(decode_per_context_token_s=1e-6)])
def test_fast_forward_matches_step_by_step_time_and_blocks(cost: CostModel) -> None:
    a, b = (Scheduler(PrefixCache(4096, 4, "t"), cost, vocab_size=1000) for _ in range(2))
    for s in (a, b):
        for i in range(3):
            s.add(SimRequest(str(i), list(range(i * 50, i * 50 + 30)), 20))
        s.step()  # prefill all three
    t_steps = 0.0
    while a.has_work():
        t_steps += a.step().seconds
    t_ff, finished = 0.0, []
    while b.has_work():
        result = b.fast_forward(1000) or b.step()
        t_ff += result.seconds
        finished += result.finished
    assert t_ff == pytest.approx(t_steps) and len(finished) == 3
    assert a.cache.cached_blocks == b.cache.cached_blocks and b.cache.usage() == 0
