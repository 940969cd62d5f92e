"""Routing policies are pure: candidates in, choice out."""

from __future__ import annotations

from collections import Counter

from data_plane.policies import Candidate, KvAware, LeastLoaded, RoutingInput, make_policy

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
    assert LeastLoaded(seed=0).choose(REQ, [cand("a", running_requests=3), cand("b", inflight_requests=1)]).worker.worker_id == "b"


def test_unknown_policy_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
