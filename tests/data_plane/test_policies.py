"""Routing policies are pure: candidates in, choice out."""

from __future__ import annotations

from collections import Counter

from kvroute.data_plane.decision.policies import Candidate, KvAware, LeastLoaded, RoutingInput, make_policy

REQ = RoutingInput("m", prompt_tokens=4096)


def cand(worker_id: str, **kw) -> Candidate:
    return Candidate(worker_id=worker_id, endpoint=f"http://{worker_id}", block_size=16, **kw)


def test_kv_aware_prefers_the_cached_worker_at_equal_load() -> None:
    choice = KvAware(seed=0).choose(REQ, [cand("a"), cand("b", cached_tokens=4000), cand("c")])
    assert choice.worker.worker_id == "b"
    assert choice.scores["b"] < choice.scores["a"] == choice.scores["c"]


def test_kv_aware_leaves_a_cached_worker_with_a_deep_queue() -> None:
    busy = cand("b", cached_tokens=4000, waiting_requests=8, pending_prefill_tokens=20000)
    assert KvAware(seed=0).choose(REQ, [cand("a"), busy]).worker.worker_id == "a"


def test_kv_aware_ties_break_at_random_not_first() -> None:
    policy = KvAware(seed=1)
    picks = Counter(policy.choose(REQ, [cand("a"), cand("b"), cand("c")]).worker.worker_id for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_round_robin_cycles_and_least_loaded_follows_load() -> None:
    rr = make_policy("round_robin")
    assert [rr.choose(REQ, [cand("b"), cand("a")]).worker.worker_id for _ in range(4)] == ["a", "b", "a", "b"]
    assert (
        LeastLoaded(seed=0).choose(REQ, [cand("a", running_requests=3), cand("b", inflight_requests=1)]).worker.worker_id == "b"
    )


def test_unknown_policy_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_kv_aware_leaves_a_cached_worker_whose_engine_reports_a_deep_queue() -> None:
    # Only the engine knows about this queue (other routers' requests): waiting_requests alone.
    busy = cand("b", cached_tokens=4000, waiting_requests=6)
    assert KvAware(seed=0).choose(REQ, [cand("a"), busy]).worker.worker_id == "a"
    # ...but a shallow queue is worth waiting behind for a 4000-token hit.
    assert KvAware(seed=0).choose(REQ, [cand("a"), cand("b", cached_tokens=4000, waiting_requests=1)]).worker.worker_id == "b"


def test_kv_aware_cost_is_the_documented_formula() -> None:
    from kvroute.data_plane.decision.policies import KvAwareParams

    p = KvAwareParams(queue_weight=0.5, mean_prompt_tokens=1000, decode_weight=10)
    c = cand("a", cached_tokens=1000, pending_prefill_tokens=300, waiting_requests=7, running_requests=3, inflight_requests=5)
    # 7 waiting, 5 of them possibly ours (their prefill is in pending_prefill_tokens): 2 are estimated.
    assert KvAware(p).cost(REQ, c) == (4096 - 1000) + 300 + 0.5 * 2 * 1000 + 10 * 5
    ours = cand("a", cached_tokens=1000, pending_prefill_tokens=300, waiting_requests=2, running_requests=3, inflight_requests=5)
    assert KvAware(p).cost(REQ, ours) == (4096 - 1000) + 300 + 10 * 5  # our own queue is not counted twice
    assert make_policy("kv_aware", queue_weight=0.5, mean_prompt_tokens=1000, decode_weight=10).params == p


def test_round_robin_is_per_model_and_scores_give_the_retry_order() -> None:
    rr = make_policy("round_robin", seed=3)  # seed accepted and ignored
    ws = [cand("a"), cand("b"), cand("c")]
    other = RoutingInput("other-model", 10)
    assert rr.choose(REQ, ws).worker.worker_id == "a"
    assert rr.choose(other, ws).worker.worker_id == "a"  # its own cycle
    choice = rr.choose(REQ, ws)
    assert choice.worker.worker_id == "b" and choice.scores == {"b": 0.0, "c": 1.0, "a": 2.0}


def test_random_is_seeded_or_injected_and_distributes() -> None:
    import random

    ws = [cand("a"), cand("b"), cand("c")]
    picks = [make_policy("random", seed=7).choose(REQ, ws).worker.worker_id for _ in range(3)]
    assert picks == [make_policy("random", seed=7).choose(REQ, ws).worker.worker_id for _ in range(3)]
    policy = make_policy("random", rng=random.Random(1))
    spread = Counter(policy.choose(REQ, ws).worker.worker_id for _ in range(300))
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) > 60


def test_policies_need_candidates() -> None:
    import pytest

    for name in ("kv_aware", "round_robin", "random", "least_loaded"):
        with pytest.raises(ValueError, match="at least one candidate"):
            make_policy(name).choose(REQ, [])
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("least_loaded", queue_weight=1.0)
