"""kv_aware's cost model beyond the basic formula: recompute penalty, tiers, load bound,
temperature, tie-breaks, and the router's speculative holders (RouterInflight)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import Candidate, KvAware, KvAwareParams, RoutingInput, make_policy
from kvroute.tools.bench.burst import burst_decisions

BS = 16


def cand(worker_id: str, **kw) -> Candidate:
    return Candidate(worker_id=worker_id, endpoint=f"http://{worker_id}", block_size=BS, **kw)


def request(tokens: list[int]) -> RoutingInput:
    return RoutingInput("m", len(tokens), token_ids=tokens, chains={BS: prompt_block_keys(tokens, BS, "m")})


def test_speculative_holders_live_from_start_to_finish() -> None:
    tracker = RouterInflight()
    a = tracker.start("w1", 100, [1, 2, 3])
    b = tracker.start("w2", 50, [1, 2, 4])
    c = tracker.start("w1", 10, [1])
    assert tracker.speculative_match([1, 2, 3, 9]) == {"w1": 3, "w2": 2}
    assert tracker.speculative_match([1, 2, 4]) == {"w1": 2, "w2": 3}
    assert tracker.speculative_match([7]) == {} and tracker.speculative_match([]) == {}
    tracker.first_token(a)  # prefill done: load drops, the blocks are still held
    assert tracker.inflight("w1") == (2, 10) and tracker.speculative_match([1, 2, 3])["w1"] == 3
    tracker.finish(a)
    tracker.finish(a)  # idempotent
    assert tracker.speculative_match([1, 2, 3]) == {"w1": 1, "w2": 2}
    tracker.finish(b)
    tracker.finish(c)
    assert tracker.speculative_match([1]) == {} and tracker.snapshot() == {}


def burst_workers(policy: KvAware, speculative: bool, n: int = 64) -> list[str]:
    """Where n simultaneous requests sharing a new 4096-token prefix go when each decision sees the
    ones before it only through the router's tracker (no engine event has arrived yet)."""
    prefix = list(range(1000, 1000 + 4096))
    return burst_decisions(
        policy, [prefix + [50_000 + i] * 64 for i in range(n)], workers=8, block_size=BS, speculative=speculative
    )


def test_a_burst_of_one_new_prefix_stays_on_few_workers() -> None:
    with_spec = burst_workers(KvAware(seed=0), speculative=True)
    without = burst_workers(KvAware(seed=0), speculative=False)
    assert len(set(without)) == 8  # blind to the burst, every idle worker computes the prefix
    # The load bound (a 4k prefill pending on one worker is over 1.25 x the mean + 2048) spreads it
    # over a few workers, each then serving its share from cache.
    assert len(set(with_spec)) <= 4
    assert max(Counter(with_spec).values()) - min(Counter(with_spec).values()) <= 1
    # Unbounded, followers join the first request (its blocks are speculatively held there) until
    # the decode pressure there outweighs a second prefill...
    unbounded = burst_workers(make_policy("kv_aware", load_bound=0.0, seed=0), speculative=True)
    assert unbounded[:16] == [unbounded[0]] * 16
    # ... and without the recompute penalty as well (pure TTFT greedy) the second already goes elsewhere.
    greedy = burst_workers(make_policy("kv_aware", recompute_weight=0.0, load_bound=0.0, seed=0), speculative=True, n=2)
    assert greedy[0] != greedy[1]


def test_tier_credits_rank_gpu_over_cpu_over_disk_over_nothing() -> None:
    req = RoutingInput("m", 4096)
    policy = KvAware(seed=0)
    gpu = cand("gpu", cached_tokens=4000)
    cpu = cand("cpu", cached_tokens=4000, cpu_cached_tokens=4000)
    disk = cand("disk", cached_tokens=4000, disk_cached_tokens=4000)
    none = cand("none")
    scores = policy.choose(req, [gpu, cpu, disk, none]).scores
    assert scores["gpu"] < scores["cpu"] < scores["disk"] < scores["none"]
    p = policy.params
    assert policy.credited_tokens(cpu) == pytest.approx(4000 * p.cpu_tier_credit)
    # A longer prefix on the cpu tier can beat a short one on gpu.
    assert policy.choose(req, [cand("short_gpu", cached_tokens=1000), cpu]).worker.worker_id == "cpu"


def test_load_bound_moves_a_hot_prefix_off_a_swamped_holder() -> None:
    req = RoutingInput("m", 2304)
    holder = cand("hot", cached_tokens=2048, pending_prefill_tokens=12_000)
    others = [cand(f"w{i}", pending_prefill_tokens=500) for i in range(7)]
    # Unbounded, the recompute penalty keeps it on the holder despite the queue...
    unbounded = make_policy("kv_aware", load_bound=0.0, seed=0, decode_weight=0.0, recompute_weight=10.0)
    assert unbounded.choose(req, [holder, *others]).worker.worker_id == "hot"
    # ...bounded, the holder is over 1.25 x mean + slack and a second worker takes it (and caches it).
    bounded = make_policy("kv_aware", load_bound=1.25, seed=0, decode_weight=0.0, recompute_weight=10.0)
    assert bounded.choose(req, [holder, *others]).worker.worker_id != "hot"
    # The least loaded worker is always eligible, even over the bound.
    lone = [cand("a", pending_prefill_tokens=90_000), cand("b", pending_prefill_tokens=100_000)]
    assert bounded.choose(req, lone).worker.worker_id == "a"


def test_temperature_samples_by_cost_and_zero_is_the_minimum() -> None:
    req = RoutingInput("m", 4096)
    ws = [cand("best", cached_tokens=3000), cand("close", cached_tokens=2900), cand("far")]
    hot = make_policy("kv_aware", temperature=200.0, rng=random.Random(3))
    picks = Counter(hot.choose(req, ws).worker.worker_id for _ in range(600))
    assert picks["best"] > picks["close"] > picks["far"] and picks["close"] > 60
    cold = make_policy("kv_aware", seed=3)
    assert {cold.choose(req, ws).worker.worker_id for _ in range(50)} == {"best"}


def test_ties_go_to_the_emptiest_cache_then_agree_across_routers() -> None:
    req = request(list(range(5000, 5000 + 512)))
    ws = [cand("a", worker_cached_blocks=900), cand("b", worker_cached_blocks=100), cand("c", worker_cached_blocks=100)]
    # Two routers with different seeds pick the same worker for the same new prefix...
    picks = {KvAware(seed=s).choose(req, ws).worker.worker_id for s in range(10)}
    assert len(picks) == 1 and picks <= {"b", "c"}
    # ...and different new prefixes spread over the equally empty workers, never "always the first".
    spread = Counter(
        KvAware(seed=0).choose(request(list(range(i * 1000, i * 1000 + 64))), ws).worker.worker_id for i in range(200)
    )
    assert set(spread) == {"b", "c"} and min(spread.values()) > 60


def test_new_prefixes_spread_by_cache_size_while_caches_fill() -> None:
    new = request(list(range(7000, 7000 + 2048)))  # 128 blocks nobody holds
    # A worker holding two prefixes more than the others but a little less busy right now: while
    # caches fill, the new prefix still goes to an emptier one (its future traffic comes along).
    ws = [
        cand("full", worker_cached_blocks=400, running_requests=1),
        cand("empty1", worker_cached_blocks=150, running_requests=2),
        cand("empty2", worker_cached_blocks=170, running_requests=3),
    ]
    assert KvAware(seed=0).choose(new, ws).worker.worker_id == "empty1"
    assert KvAware(KvAwareParams(spread_new_prefixes=0), seed=0).choose(new, ws).worker.worker_id == "full"
    # Within spread_new_prefixes x the prompt (0.25 x 128 blocks) of the emptiest, the cost decides.
    close = [cand("a", worker_cached_blocks=150, running_requests=2), cand("b", worker_cached_blocks=180, running_requests=1)]
    assert KvAware(seed=0).choose(new, close).worker.worker_id == "b"
    # Full caches (emptiest >= 0.9 x fullest): block counts now measure in-flight work, the cost decides.
    full = [
        cand("busy", worker_cached_blocks=1000, running_requests=1),
        cand("idle", worker_cached_blocks=920, running_requests=20),
    ]
    assert KvAware(seed=0).choose(new, full).worker.worker_id == "busy"
    # A prompt some worker holds part of is not new: the cost (here: its cache hit) decides.
    held = [cand("full", worker_cached_blocks=400, cached_tokens=512), cand("empty", worker_cached_blocks=100)]
    assert KvAware(seed=0).choose(new, held).worker.worker_id == "full"
    # Block sizes may differ: caches compare in tokens.
    mixed = [
        Candidate("big", "http://big", 64, worker_cached_blocks=100, running_requests=1),
        Candidate("small", "http://small", 16, worker_cached_blocks=200, running_requests=2),
    ]
    assert KvAware(seed=0).choose(new, mixed).worker.worker_id == "small"


def test_parameters_are_validated_and_settable_flat() -> None:
    assert make_policy("kv_aware", recompute_weight=0.5, load_bound=0).params == KvAwareParams(recompute_weight=0.5, load_bound=0)
    for bad in (
        {"cpu_tier_credit": 1.5},
        {"decode_weight": -1},
        {"load_bound": 0.5},
        {"temperature": float("nan")},
        {"spread_new_prefixes": -1},
        {"spread_while_fill_below": 1.5},
    ):
        with pytest.raises(ValueError, match="kv_aware"):
            make_policy("kv_aware", **bad)


AGENT_PREFIX = 8192  # an agent's tool schema: a long prefix, then a short turn of its own
AGENT_PROMPT = 8448


def test_a_burst_is_not_spilled_off_the_worker_still_prefilling_its_prefix() -> None:
    """One holder, one long pending prefill, a burst for the same prefix: the burst's first request
    is prefilling the 8k prefix on w0 (claimed there, pending), and the next arrives. It needs 256
    tokens of its own on w0 once those blocks are computed; anywhere else it recomputes all 8.4k. The
    pending prefill on w0 is the very work this request waits for on any worker, so it does not count
    against w0 in the load bound: w0. Counted like any other queue (the old bound), it left w0 out
    and the request recomputed the prefix on an idle worker."""
    tokens = list(range(AGENT_PROMPT))
    holder = cand(
        "w0",
        cached_tokens=AGENT_PREFIX,
        inflight_cached_tokens=AGENT_PREFIX,
        inflight_requests=1,
        pending_prefill_tokens=AGENT_PROMPT,
    )
    others = [cand(f"w{i}") for i in range(1, 8)]
    assert KvAware().choose(request(tokens), [holder, *others]).worker.worker_id == "w0"
    old = KvAware(KvAwareParams(inflight_prefix_credit=0.0)).choose(request(tokens), [holder, *others])
    assert old.worker.worker_id != "w0"


def test_waiting_for_a_prefill_in_progress_beats_recomputing_unless_the_queue_behind_it_is_long() -> None:
    """Wait for T: w0 is computing the prompt's prefix for another request (ready once its pending
    prefill is done, the T the cost counts in prefill-token equivalents); w1 is idle. Going to w0 costs
    the wait for those blocks plus 256 tokens; going to w1 costs 8.4k tokens of prefill and the fleet
    recomputing a prefix it holds. So w0. With a long queue of unrelated prefill on w0 as well (40k
    tokens of other requests), waiting costs more than recomputing: w1."""
    tokens = list(range(AGENT_PROMPT))
    computing = cand(
        "w0",
        cached_tokens=AGENT_PREFIX,
        inflight_cached_tokens=AGENT_PREFIX,
        inflight_requests=1,
        pending_prefill_tokens=AGENT_PREFIX,
    )
    assert KvAware().choose(request(tokens), [computing, cand("w1")]).worker.worker_id == "w0"
    queued = cand(
        "w0",
        cached_tokens=AGENT_PREFIX,
        inflight_cached_tokens=AGENT_PREFIX,
        inflight_requests=6,
        pending_prefill_tokens=AGENT_PREFIX + 40_000,
    )
    assert KvAware().choose(request(tokens), [queued, cand("w1")]).worker.worker_id == "w1"


def test_a_prefix_is_replicated_for_sustained_demand_not_for_one_busy_moment() -> None:
    """Replication by demand: a prefix asked for by few of the requests a router sees stays on its one
    holder while the holder's queue is within the hard bound, however busy that moment looks against
    the fleet mean; a prefix asked for by most requests (more than its holders can serve) is spread by
    the load bound, which then adds a holder."""

    def holder_busy(tokens: list[int]) -> list[Candidate]:
        return [
            cand("holder", cached_tokens=2048, pending_prefill_tokens=4000),
            *(cand(f"w{i}", pending_prefill_tokens=300) for i in range(7)),
        ]

    rare, hot = list(range(2304)), list(range(10_000, 12_304))
    background = [list(range(50_000 + 3000 * i, 50_000 + 3000 * i + 2304)) for i in range(40)]

    quiet = KvAware()
    for i, tokens in enumerate(background):  # a fleet busy with other prefixes: this one is 1 request in 41
        quiet.choose(
            RoutingInput("m", len(tokens), chains=request(tokens).chains, now_s=i * 0.1),
            [cand("w0", cached_tokens=2048), cand("w1")],
        )
    rare_request = RoutingInput("m", len(rare), chains=request(rare).chains, now_s=4.1)
    assert quiet.choose(rare_request, holder_busy(rare)).worker.worker_id == "holder"

    busy = KvAware()
    for i in range(40):  # the same prefix, request after request
        busy.choose(RoutingInput("m", len(hot), chains=request(hot).chains, now_s=i * 0.1), holder_busy(hot))
    hot_request = RoutingInput("m", len(hot), chains=request(hot).chains, now_s=4.1)
    assert busy.choose(hot_request, holder_busy(hot)).worker.worker_id != "holder"
    # Without demand tracking the bound spreads both alike (one busy moment is enough).
    plain = KvAware(KvAwareParams(demand_half_life_s=0.0))
    assert plain.choose(rare_request, holder_busy(rare)).worker.worker_id != "holder"


def test_a_prefix_most_requests_ask_for_gets_more_holders_before_any_queue_grows() -> None:
    """Replication ahead of queues: a 2048-token prefix that every request asks for, held by two of
    eight workers, each request a hit with a 256-token prefill. No queue builds (nothing pending), so
    the load bound keeps it on its holders; demand says it wants all eight. Once the prefix's decayed
    request count reaches replicate_min_requests, a request goes to a worker that does not hold it,
    and with every worker holding it the cheapest holder takes it again."""
    hot = list(range(2304))

    def fleet(holders: int) -> list[Candidate]:
        return [
            cand(f"w{i}", cached_tokens=2048 if i < holders else 0, running_requests=6 if i < holders else 0) for i in range(8)
        ]

    def at(i: int) -> RoutingInput:
        return RoutingInput("m", len(hot), chains=request(hot).chains, now_s=i * 0.05)

    policy = KvAware(seed=0)
    # Eight requests over 0.35 s, decayed with a 10 s half life: a count just under 8, not yet.
    firsts = [policy.choose(at(i), fleet(2)).worker.worker_id for i in range(8)]
    assert set(firsts) <= {"w0", "w1"}
    choice = policy.choose(at(8), fleet(2))
    assert choice.worker.worker_id not in {"w0", "w1"}  # the ninth adds a holder
    explanation = policy.explain(at(8), fleet(2), choice)
    assert "demand asks for more holders" in explanation.reason and "load bound" not in explanation.reason
    assert all(w.within_load_bound for w in explanation.workers)  # the holders were left out by replication
    # Holders for all the demand: the cheapest holder, as without replication.
    full = [cand(f"w{i}", cached_tokens=2048, running_requests=6 if i else 0) for i in range(8)]
    assert policy.choose(at(9), full).worker.worker_id == "w0"
    # Off: the two holders keep it, however long the demand lasts.
    off = KvAware(KvAwareParams(replicate_min_requests=0), seed=0)
    assert {off.choose(at(i), fleet(2)).worker.worker_id for i in range(20)} <= {"w0", "w1"}


def test_a_worker_without_room_in_its_kv_cache_is_left_out_while_another_has_room() -> None:
    # A 4608-token prompt whose first 2304 tokens one worker holds, in a 16384-token cache that three
    # such requests nearly fill (usage 888 of 1024 blocks): there it would wait for a running request
    # to finish (seconds of decode); the empty worker recomputes 2304 tokens (~0.15 s) and starts now.
    r = request(list(range(4608)))
    capacity = 16384
    full_holder = cand("holder", cached_tokens=2304, running_requests=3, kv_usage=888 / 1024, kv_capacity_tokens=capacity)
    empty = cand("empty", kv_capacity_tokens=capacity)
    policy = KvAware(seed=0)
    choice = policy.choose(r, [full_holder, empty])
    assert choice.worker.worker_id == "empty"
    assert "no room in the KV cache of holder" in policy.explain(r, [full_holder, empty], choice).reason
    # The cost alone prefers the holder (2304 uncached + 3 x 128 decode vs 4608 + 2304 recomputed):
    # so it goes there with the check off, or when the engine does not report its capacity.
    assert KvAware(KvAwareParams(kv_fit=0), seed=0).choose(r, [full_holder, empty]).worker.worker_id == "holder"
    unknown = replace(full_holder, kv_capacity_tokens=0)
    assert KvAware(seed=0).choose(r, [unknown, empty]).worker.worker_id == "holder"
    # Room for 2304 + 128 tokens at 80% usage (3276 free): the holder.
    roomy = replace(full_holder, kv_usage=0.8)
    assert KvAware(seed=0).choose(r, [roomy, empty]).worker.worker_id == "holder"
    # Prefill that routers queued there is not allocated yet, but will be: 3276 - 1000 < 2432.
    queued = replace(roomy, pending_prefill_tokens=1000)
    assert KvAware(seed=0).choose(r, [queued, empty]).worker.worker_id == "empty"
    # Room nowhere: every worker would make it wait, the cost decides as without the check.
    crowded = replace(empty, kv_usage=0.95)
    assert KvAware(seed=0).choose(r, [full_holder, crowded]).worker.worker_id == "holder"


def test_near_ties_spread_different_prompts_over_routers_and_they_agree_on_each() -> None:
    # Four workers holding none of the prompts, their costs within near_tie_tokens (512) of each
    # other (0..3 running x 128), and one far busier. Routers deciding a burst on one view would
    # all send it to w0 with near ties off; with other routers on the fleet, different prompts
    # spread over w0..w3, each prompt to the same worker whichever router decides, never to the
    # busy one. A router alone knows its own in-flight work: the cheapest.
    ws = [cand(f"w{i}", running_requests=i, worker_cached_blocks=1000) for i in range(4)]
    ws.append(cand("busy", running_requests=20, worker_cached_blocks=1000))
    prompts = [list(range(10_000 * k, 10_000 * k + 512)) for k in range(1, 41)]
    shared = [replace(request(p), other_routers=3) for p in prompts]
    one, other = KvAware(seed=1), KvAware(seed=2)
    picks = [one.choose(r, ws).worker.worker_id for r in shared]
    assert picks == [other.choose(r, list(reversed(ws))).worker.worker_id for r in shared]
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    near_tie = next(r for r, w in zip(shared, picks) if w != "w0")
    reason = one.explain(near_tie, ws, one.choose(near_tie, ws)).reason
    assert "within near_tie_tokens" in reason and "3 other routers" in reason
    assert {KvAware(seed=0).choose(request(p), ws).worker.worker_id for p in prompts} == {"w0"}
    cheapest_only = KvAware(KvAwareParams(near_tie_tokens=0), seed=0)
    assert {cheapest_only.choose(r, ws).worker.worker_id for r in shared} == {"w0"}
    # A worker holding more of the prompt is not a near tie of those that hold less: it keeps the prompt.
    held = replace(request(prompts[0]), other_routers=3)
    holder = cand("holder", cached_tokens=256, running_requests=3, worker_cached_blocks=1000)
    assert {KvAware(seed=s).choose(held, [*ws, holder]).worker.worker_id for s in range(5)} == {"holder"}


def test_a_worker_with_room_at_a_small_extra_cost_wins_even_while_most_workers_lack_room() -> None:
    # rag with a tight cache: six of eight workers hold the 256-token system prompt and are nearly
    # full (three 4608-token requests each), two hold nothing and are empty. Fewer than half have
    # room, so the room rule alone stands down; but the empty ones cost only 128 tokens more (256
    # recomputed vs three running decodes), and on a full holder the request waits for a decode.
    r = request(list(range(4608)))
    capacity = 16384
    full = [
        cand(f"h{i}", cached_tokens=256, running_requests=3, kv_usage=888 / 1024, kv_capacity_tokens=capacity) for i in range(6)
    ]
    empty = [cand(f"e{i}", kv_capacity_tokens=capacity) for i in range(2)]
    policy = KvAware(seed=0)
    choice = policy.choose(r, full + empty)
    assert choice.worker.worker_id in {"e0", "e1"}
    reason = policy.explain(r, full + empty, choice).reason
    assert "no room in the KV cache of h0, h1, h2, h3, h4, h5" in reason and "kv_fit_near_tokens" not in reason
    # A worker with room but far costlier (prefill queued there) is left out with the full ones.
    queued = replace(empty[1], pending_prefill_tokens=3000)
    choice = policy.choose(r, [*full, empty[0], queued])
    assert choice.worker.worker_id == "e0"
    reason = policy.explain(r, [*full, empty[0], queued], choice).reason
    assert (
        "no room in the KV cache of h0, h1, h2, h3, h4, h5 " in reason
        and "(512) of the lowest cost were considered: left out e1" in reason
    )
    assert KvAware(KvAwareParams(kv_fit_near_tokens=0), seed=0).choose(r, full + empty).worker.worker_id.startswith("h")
    # A long prefix on the full workers: moving would recompute 2048 tokens, so the holders keep it
    # (the fleet's KV is oversubscribed; the request waits wherever it goes).
    long_held = [replace(c, cached_tokens=2304) for c in full]
    assert KvAware(seed=0).choose(r, long_held + empty).worker.worker_id.startswith("h")
