"""The baseline policies (session, chwbl, approx_tree): their rules on hand-built candidates, the
prompt tree's bounds, and all seven policies in the simulator."""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections import Counter

import pytest

from kvroute.data_plane.decision.policies import (
    POLICIES,
    ApproxTree,
    Candidate,
    PrefixHashBoundedLoad,
    PromptTree,
    RoutingInput,
    SessionAffinity,
    make_policy,
)

ALL_POLICIES = ("round_robin", "random", "least_loaded", "session", "chwbl", "approx_tree", "kv_aware")


def cand(worker_id: str, **kw) -> Candidate:
    return Candidate(worker_id=worker_id, endpoint=f"http://{worker_id}", block_size=16, **kw)


def fleet(n: int, **loads: int) -> list[Candidate]:
    return [cand(f"w{i}", inflight_requests=loads.get(f"w{i}", 0)) for i in range(n)]


def req(tokens=(), session: str = "") -> RoutingInput:
    return RoutingInput("m", len(tokens), token_ids=tokens, session_key=session)


def fresh(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_all_three_are_registered_and_validate_their_parameters() -> None:
    assert set(ALL_POLICIES) <= set(POLICIES)
    for name in ("session", "chwbl", "approx_tree"):
        assert make_policy(name, seed=1).name == name
        with pytest.raises(ValueError, match="at least one candidate"):
            make_policy(name).choose(req(), [])
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("session", queue_weight=1.0)
    with pytest.raises(ValueError, match="load_factor"):
        make_policy("chwbl", load_factor=0.9)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("approx_tree", cache_threshold=1.5)


# ---------------------------------------------------------------- session


def test_session_sticks_whatever_the_load_and_spreads_sessions() -> None:
    policy = SessionAffinity(seed=0)
    home = policy.choose(req(session="conv-7"), fleet(4)).worker.worker_id
    loaded = [cand(c.worker_id, inflight_requests=50 if c.worker_id == home else 0) for c in fleet(4)]
    assert all(policy.choose(req(session="conv-7"), loaded).worker.worker_id == home for _ in range(20))
    spread = Counter(policy.choose(req(session=f"s{i}"), fleet(4)).worker.worker_id for i in range(400))
    assert set(spread) == {"w0", "w1", "w2", "w3"} and min(spread.values()) > 60


def test_session_adding_a_worker_moves_only_its_share_and_retry_goes_where_the_session_would_move() -> None:
    policy = make_policy("session")
    keys = [f"user-{i}" for i in range(2000)]
    before = {k: policy.choose(req(session=k), fleet(8)).worker.worker_id for k in keys}
    after = {k: policy.choose(req(session=k), fleet(9)).worker.worker_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "w8" for k in moved)  # nothing moves between old workers
    assert 0.07 < len(moved) / len(keys) < 0.16  # about 1/9
    # Removing the chosen worker sends the session to the second-ranked one (score 1), i.e. the retry order.
    choice = policy.choose(req(session="user-1"), fleet(8))
    second = min((w for w, s in choice.scores.items() if s > 0), key=choice.scores.__getitem__)
    rest = [c for c in fleet(8) if c.worker_id != choice.worker.worker_id]
    assert policy.choose(req(session="user-1"), rest).worker.worker_id == second


def test_session_without_a_key_is_least_loaded() -> None:
    ws = [cand("a", running_requests=3), cand("b", inflight_requests=1), cand("c", waiting_requests=2)]
    assert SessionAffinity(seed=0).choose(req(), ws).worker.worker_id == "b"


# ---------------------------------------------------------------- chwbl


def test_chwbl_same_prefix_sticks_under_the_bound_and_leaves_past_it() -> None:
    policy = PrefixHashBoundedLoad()
    system = fresh(25, 1000)  # the hashed prefix (25 tokens by default)
    home = policy.choose(req(system + fresh(50, 5000)), fleet(4)).worker.worker_id
    # Different tails, same first 25 tokens: same worker while it is within ceil(1.25 * (total + 1) / 4).
    busy = fleet(4, **{home: 3, **{w: 2 for w in ("w0", "w1", "w2", "w3") if w != home}})  # total 9: cap 4
    assert all(policy.choose(req(system + fresh(50, s)), busy).worker.worker_id == home for s in (7000, 8000, 9000))
    over = fleet(4, **{home: 4, **{w: 2 for w in ("w0", "w1", "w2", "w3") if w != home}})  # total 10: cap 4
    choice = policy.choose(req(system + fresh(50, 7000)), over)
    assert choice.worker.worker_id != home and choice.scores[choice.worker.worker_id] == 0.0
    # Different prefixes spread over the ring.
    homes = Counter(policy.choose(req(fresh(25, 100 * i)), fleet(4)).worker.worker_id for i in range(400))
    assert set(homes) == {"w0", "w1", "w2", "w3"} and min(homes.values()) > 50


def test_chwbl_never_exceeds_the_bound_even_when_every_request_shares_one_prefix() -> None:
    policy = make_policy("chwbl", load_factor=1.25)
    loads = Counter({f"w{i}": 0 for i in range(8)})
    rng = random.Random(5)
    system = fresh(25, 1)
    for step in range(400):
        if step % 3 == 2:  # some requests finish
            busy = [w for w, n in loads.items() if n]
            loads[rng.choice(busy)] -= 1
        candidates = [cand(w, inflight_requests=n) for w, n in sorted(loads.items())]
        total = sum(loads.values())
        chosen = policy.choose(req(system + fresh(10, 10_000 + step)), candidates).worker.worker_id
        assert loads[chosen] + 1 <= math.ceil(1.25 * (total + 1) / 8)
        loads[chosen] += 1
    assert max(loads.values()) > 1  # the bound was exercised, not just an empty fleet


def test_chwbl_counts_engine_reported_load_too() -> None:
    policy = PrefixHashBoundedLoad()
    prompt = fresh(30, 42)
    home = policy.choose(req(prompt), fleet(2)).worker.worker_id
    other = "w1" if home == "w0" else "w0"
    ws = [cand(home, running_requests=2, waiting_requests=2), cand(other)]  # total 4: cap ceil(1.25 * 5 / 2) = 4
    assert policy.choose(req(prompt), ws).worker.worker_id == other


# ---------------------------------------------------------------- approx_tree


def seeded_tree_policy(**kw) -> ApproxTree:
    """a holds prompt A (1000 tokens), b holds 500 tokens, c holds 100: c has the smallest tree."""
    policy = ApproxTree(seed=0, **kw)
    policy.tree.insert(array("I", fresh(1000, 0)), "a")
    policy.tree.insert(array("I", fresh(500, 100_000)), "b")
    policy.tree.insert(array("I", fresh(100, 200_000)), "c")
    return policy


def test_approx_tree_match_above_threshold_goes_to_the_holder() -> None:
    policy = seeded_tree_policy()
    prompt = fresh(800, 0) + fresh(200, 900_000)  # 80% of it was sent to a
    assert policy.choose(req(prompt), fleet_abc()).worker.worker_id == "a"
    assert policy.tree.match(prompt, {"a", "b", "c"}) == (1000, ["a"])  # and it was recorded on a


def test_approx_tree_match_at_or_below_threshold_goes_to_the_smallest_tree() -> None:
    for shared in (100, 300):  # 10% and exactly 30%: the rule is "> cache_threshold"
        policy = seeded_tree_policy()
        prompt = fresh(shared, 0) + fresh(1000 - shared, 900_000)
        assert policy.choose(req(prompt), fleet_abc()).worker.worker_id == "c"
    assert ApproxTree(seed=0, cache_threshold=0.2).tree.max_tokens == 2**24


def test_approx_tree_imbalance_overrides_the_cache() -> None:
    prompt = fresh(900, 0) + fresh(100, 900_000)
    policy = seeded_tree_policy()
    imbalanced = fleet_abc(a=100, b=0, c=10)  # 100 - 0 > 64 and 100 > 1.5 * 0
    assert policy.choose(req(prompt), imbalanced).worker.worker_id == "b"
    # Either condition alone is not imbalance: the cache decides.
    assert seeded_tree_policy().choose(req(prompt), fleet_abc(a=60, b=0, c=0)).worker.worker_id == "a"
    assert seeded_tree_policy().choose(req(prompt), fleet_abc(a=300, b=210, c=250)).worker.worker_id == "a"


def test_approx_tree_cold_fleet_spreads_and_then_sticks() -> None:
    policy = make_policy("approx_tree", seed=3)
    systems = [fresh(1000, 1_000_000 * (g + 1)) for g in range(4)]
    first = [policy.choose(req(s + fresh(50, 1)), fleet(4)).worker.worker_id for s in systems]
    assert len(set(first)) == 4  # each cold prompt went to an empty (smallest) tree
    again = [policy.choose(req(s + fresh(50, 77)), fleet(4)).worker.worker_id for s in systems]
    assert again == first


def fleet_abc(**loads: int) -> list[Candidate]:
    return [cand(w, inflight_requests=loads.get(w, 0)) for w in ("a", "b", "c")]


# ---------------------------------------------------------------- the tree itself


def check_tree(tree: PromptTree) -> None:
    """A worker's nodes form paths from the root, and its size is the tokens on them."""
    sizes: Counter[str] = Counter()
    stack = [tree._root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.tenants and (node is tree._root or set(child.tenants) <= set(node.tenants))
            assert child.edge[0] in node.children and child.parent is node and child.end == node.end + len(child.edge)
            for w in child.tenants:
                sizes[w] += len(child.edge)
            stack.append(child)
    assert all(tree.size(w) == n for w, n in sizes.items())


def test_tree_nodes_are_runs_not_tokens() -> None:
    tree = PromptTree()
    tree.insert(fresh(10_000, 0), "a")
    assert tree.node_count() == 1 and tree.size("a") == 10_000
    tree.insert(fresh(5_000, 0) + fresh(100, 50_000), "b")  # splits one edge: shared run + two tails
    assert tree.node_count() == 3 and tree.size("b") == 5_100
    assert tree.match(fresh(7_000, 0), {"a", "b"}) == (7_000, ["a"])
    assert tree.match(fresh(7_000, 0), {"b"}) == (5_000, ["b"])
    check_tree(tree)


def test_tree_match_agrees_with_brute_force() -> None:
    rng = random.Random(11)
    tree, sent = PromptTree(), {w: [] for w in "abc"}
    for _ in range(300):
        w = rng.choice("abc")
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]  # tiny alphabet: many splits
        tree.insert(prompt, w)
        sent[w].append(prompt)
        probe = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        workers = set(rng.sample("abc", rng.randrange(1, 4)))
        best = {v: max((_lcp(p, probe) for p in sent[v]), default=0) for v in workers}
        longest = max(best.values())
        matched, holders = tree.match(probe, workers)
        assert matched == longest
        if longest:
            assert set(holders) == {v for v in workers if best[v] == longest}
    check_tree(tree)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_tree_eviction_bounds_memory_and_keeps_the_recently_used() -> None:
    tree = PromptTree(max_tokens_per_worker=2_000)
    system = fresh(200, 0)
    for i in range(500):
        tree.insert(array("I", system + fresh(300, 10_000 * (i + 1))), "a")
        assert tree.size("a") <= 2_000
        if i % 10 == 0:
            tree.insert(array("I", fresh(150, 0)), "a")  # keep using the system prompt's start
    assert tree.node_count() <= 2_000 // 100 and len(tree._lru["a"]) <= 2 * tree._nodes["a"] + 64
    last = system + fresh(300, 10_000 * 500)
    assert tree.match(last, {"a"})[0] == 500  # the newest prompt is whole
    assert tree.match(system + fresh(300, 10_000), {"a"})[0] == 200  # the oldest tail is gone, the system prompt stays
    check_tree(tree)
    # A worker is evicted on its own budget: another worker's tree is untouched.
    tree.insert(fresh(1_500, 900_000), "b")
    assert tree.size("b") == 1_500 and tree.match(fresh(1_500, 900_000), {"b"})[0] == 1_500


def test_tree_evicts_leaves_before_the_prefix_they_hang_from() -> None:
    tree = PromptTree(max_tokens_per_worker=1_000)
    shared, tail_a, tail_b = fresh(200, 0), fresh(300, 10_000), fresh(300, 20_000)
    tree.insert(shared + tail_a, "a")
    tree.insert(shared + tail_b, "b")  # splits a's edge: the shared run inherits a's last use
    tree.insert(fresh(600, 30_000), "a")  # a holds 1_100 > 1_000: its least recently used leaf goes
    assert tree.size("a") == 800
    assert tree.match(shared + tail_a, {"a"}) == (200, ["a"])  # the tail went, the prefix a still holds stayed
    check_tree(tree)


# ---------------------------------------------------------------- router and HTTP plumbing


async def test_router_passes_tokens_and_session_key_to_the_policy() -> None:
    from kvroute.data_plane.cp_link.inflight import RouterInflight
    from kvroute.data_plane.decision.policies import PolicyNeeds
    from kvroute.data_plane.service.routing import Router
    from kvroute.v1 import kvroute_pb2 as pb

    class Workers:  # a control plane that knows two workers and whose queries fail (fail open)
        reachable = False

        def workers_for(self, model, lora_name=""):
            from kvroute.data_plane.cp_link.control_plane_client import KnownWorker

            return [KnownWorker(w, model, f"http://{w}", 16, pb.WorkerLoad()) for w in ("a", "b")]

        async def query(self, model, chains, lora_name=""):
            raise RuntimeError("down")

    seen: list[RoutingInput] = []

    class Recording:
        name = "recording"
        needs = PolicyNeeds(tokens=True)

        def choose(self, request, candidates):
            seen.append(request)
            return make_policy("least_loaded", seed=0).choose(request, candidates)

    router = Router(Workers(), Recording(), RouterInflight())
    await router.decide("m", [5, 6, 7], session_key="conv-1")
    await router.decide("m", [5])
    assert (list(seen[0].token_ids), seen[0].session_key, seen[0].prompt_tokens) == ([5, 6, 7], "conv-1", 3)
    assert seen[1].session_key == ""


def test_http_session_key_is_the_header_then_the_openai_user() -> None:
    from kvroute.data_plane.api.body import session_key_of

    with_header, bare = {"x-session-id": "s-1"}, {}
    assert session_key_of(with_header, {"user": "alice"}) == "s-1"
    assert session_key_of(bare, {"user": "alice"}) == "alice"
    assert session_key_of(bare, {"user": 12}) == "" and session_key_of(bare, {}) == ""


# ---------------------------------------------------------------- simulator


def test_hot_prefix_workload_puts_one_prompt_on_most_of_the_traffic() -> None:
    from kvroute.tools.simulator.workloads import WORKLOAD_NAMES, GeneratedWorkload, generate

    assert "hot-prefix" in WORKLOAD_NAMES
    workload = generate(GeneratedWorkload("hot-prefix", requests=1000, groups=8, seed=1))
    heads = Counter(tuple(r.tokens[:16]) for r in workload)
    (_, hot), *rest = heads.most_common()
    assert 0.55 < hot / len(workload) < 0.65 and len(rest) == 8
    assert all(r.session == "" for r in workload)
    with pytest.raises(ValueError, match="hot_share"):
        generate(GeneratedWorkload("hot-prefix", requests=10, hot_share=1.5))
    turns = generate(GeneratedWorkload("multi-turn", requests=200, seed=1))
    by_session: dict[str, list] = {}
    for r in turns:
        by_session.setdefault(r.session, []).append(r.tokens)
    assert "" not in by_session and any(len(v) > 1 for v in by_session.values())
    for convo in by_session.values():  # each turn extends the previous one
        assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(convo))


def test_all_seven_policies_run_in_the_simulator_and_session_beats_round_robin_on_multi_turn() -> None:
    from kvroute.tools.simulator.fleet import FleetConfig
    from kvroute.tools.simulator.sweep import run_policies
    from kvroute.tools.simulator.workloads import GeneratedWorkload, generate

    config = FleetConfig(workers=4, num_blocks=512, block_size=16, seed=2)
    for name in ("hot-prefix", "multi-turn"):
        workload = generate(GeneratedWorkload(name, requests=160, rate_rps=6, groups=8, seed=2))
        runs = run_policies(list(ALL_POLICIES), workload, config, jobs=2)
        assert list(runs) == list(ALL_POLICIES)
        for run in runs.values():
            assert len(run.e2e_s) == 160 and run.rejected == 0
        if name == "multi-turn":
            assert runs["session"].hit_rate > runs["round_robin"].hit_rate + 0.1
