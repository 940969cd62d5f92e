"""A decision taken apart (issue 18, item 5): kv_aware's explanation agrees with its choice.

The explanation recomputes the formula term by term (`KvAware._terms`) next to the hot path's
single loop (`KvAware._costs`): the property below holds the two together on random fleets, and
the eligibility flags and the reason follow the same steps as `choose`.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.data_plane.decision.policies import Candidate, KvAware, KvAwareParams, RoutingInput, explain_scores, make_policy

BS = 16


@st.composite
def fleets(draw) -> tuple[int, list[Candidate]]:
    prompt = draw(st.integers(1, 8192))
    n = draw(st.integers(1, 8))
    candidates = []
    for i in range(n):
        cached = draw(st.integers(0, prompt)) // BS * BS
        cpu = draw(st.integers(0, cached)) // BS * BS
        disk = draw(st.integers(0, cached - cpu)) // BS * BS
        candidates.append(
            Candidate(
                f"w{i}",
                f"http://w{i}",
                BS,
                cached,
                cpu,
                disk,
                draw(st.integers(0, 40)),
                draw(st.integers(0, 40)),
                draw(st.floats(0, 1)),
                draw(st.integers(0, 40)),
                draw(st.integers(0, 200_000)),
                draw(st.integers(0, 50_000)),
            )
        )
    return prompt, candidates


params_st = st.builds(
    KvAwareParams,
    recompute_weight=st.sampled_from([0.0, 0.5, 1.0]),
    load_bound=st.sampled_from([0.0, 1.0, 1.25, 2.0]),
    spread_new_prefixes=st.sampled_from([0.0, 0.25]),
)


@given(fleets(), params_st)
def test_terms_sum_to_the_cost_and_the_winner_is_eligible(fleet, params: KvAwareParams) -> None:
    prompt, candidates = fleet
    policy = KvAware(params, seed=0)
    request = RoutingInput("m", prompt, chains={BS: list(range(1, prompt // BS + 1))})
    choice = policy.choose(request, candidates)
    explained = policy.explain(request, candidates, choice)
    assert [w.worker_id for w in explained.workers] == [c.worker_id for c in candidates]
    for w in explained.workers:
        assert sum(w.terms.values()) == w.cost == choice.scores[w.worker_id]
        assert set(w.terms) == {"uncached_prefill", "recompute", "pending_prefill", "queue", "decode"}
    winner = next(w for w in explained.workers if w.worker_id == choice.worker.worker_id)
    assert winner.within_load_bound is not False and winner.in_spread_pool is not False
    assert choice.worker.worker_id in explained.reason
    assert explained.params["load_bound"] == params.load_bound


def test_the_load_bound_is_named_when_it_moves_the_request() -> None:
    """The worker holding the whole prompt is queued far past the fleet mean: the bound leaves it
    out, the reason says so, and its flag is False."""
    hot = Candidate("hot", "http://hot", BS, 4096, pending_prefill_tokens=100_000, inflight_requests=30)
    cold = [Candidate(f"c{i}", f"http://c{i}", BS, 0) for i in range(3)]
    policy = KvAware(seed=0)
    request = RoutingInput("m", 4096, chains={BS: list(range(1, 257))})
    choice = policy.choose(request, [hot, *cold])
    explained = policy.explain(request, [hot, *cold], choice)
    assert choice.worker.worker_id != "hot"
    assert "load bound" in explained.reason and "hot" in explained.reason
    flags = {w.worker_id: w.within_load_bound for w in explained.workers}
    assert flags["hot"] is False and all(flags[c.worker_id] for c in cold)
    by_id = {w.worker_id: w for w in explained.workers}
    assert by_id["hot"].terms["uncached_prefill"] == 0 and by_id["hot"].terms["pending_prefill"] == 100_000
    assert by_id["c0"].terms["recompute"] == 4096  # the fleet holds the prompt: recomputing it elsewhere costs


def test_a_tie_is_named_as_one() -> None:
    idle = [Candidate(f"w{i}", f"http://w{i}", BS, 0) for i in range(4)]
    policy = KvAware(KvAwareParams(spread_new_prefixes=0.0), seed=0)
    request = RoutingInput("m", 64, chains={BS: [1, 2, 3, 4]})
    choice = policy.choose(request, idle)
    assert "tied on cost" in policy.explain(request, idle, choice).reason


def test_a_policy_without_a_formula_explains_by_its_scores() -> None:
    candidates = [Candidate(f"w{i}", f"http://w{i}", BS, 0, running_requests=i) for i in range(3)]
    policy = make_policy("least_loaded", seed=0)
    choice = policy.choose(RoutingInput("m", 10), candidates)
    explained = explain_scores(policy.name, choice, candidates)
    assert choice.worker.worker_id in explained.reason and not any(w.terms for w in explained.workers)
    assert [w.cost for w in explained.workers] == [choice.scores[c.worker_id] for c in candidates]
