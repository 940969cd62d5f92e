"""The fleet simulator: reproducible, uses the real policies/index, and tells policies apart."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.tools.sim_engine.scheduler import SimRequest
from kvroute.tools.simulator.fleet import FleetConfig, oracle_hit_rate, simulate_policy
from kvroute.tools.simulator.workloads import GeneratedWorkload, generate, load_mooncake_trace


def test_kv_aware_near_ceiling_where_round_robin_thrashes() -> None:
    workload = generate(GeneratedWorkload("shared-prefix", requests=300, rate_rps=8, groups=32, seed=3))
    config = FleetConfig(workers=8, num_blocks=1024, block_size=16, seed=3)
    kv = simulate_policy("kv_aware", workload, config)
    rr = simulate_policy("round_robin", workload, config)
    ceiling = oracle_hit_rate(workload, 16, 8 * 1024)
    assert kv.hit_rate > 2 * rr.hit_rate
    assert kv.hit_rate >= 0.85 * ceiling
    assert sorted(kv.ttft_s)[len(kv.ttft_s) // 2] < sorted(rr.ttft_s)[len(rr.ttft_s) // 2]
    assert oracle_hit_rate(workload, 16, None) >= ceiling


def test_one_shot_has_nothing_to_share() -> None:
    workload = generate(GeneratedWorkload("one-shot", requests=100, rate_rps=5, seed=1))
    assert oracle_hit_rate(workload, 16, None) == 0.0
    assert simulate_policy("kv_aware", workload, FleetConfig(workers=4, seed=1)).hit_rate == 0.0


def test_every_generated_workload_runs() -> None:
    for name in ("multi-turn", "rag", "agent"):
        workload = generate(GeneratedWorkload(name, requests=60, rate_rps=5, seed=2))
        run = simulate_policy("kv_aware", workload, FleetConfig(workers=4, seed=2))
        assert len(run.e2e_s) == 60 and run.hit_rate > 0


def test_seed_makes_runs_bit_for_bit_reproducible() -> None:
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "simulate",
        "--workload",
        "rag",
        "--requests",
        "80",
        "--rate",
        "5",
        "--workers",
        "4",
        "--policies",
        "random,kv_aware",
        "--seed",
        "7",
        "--json",
    ]
    outputs = [subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert all(o.returncode == 0 for o in outputs), outputs[0].stderr
    first, second = (json.loads(o.stdout.strip().splitlines()[-1]) for o in outputs)
    assert first == second and set(first["policies"]) == {"random", "kv_aware"}


def test_mooncake_trace_rows_map_to_shared_token_blocks(tmp_path: Path) -> None:
    # Rows in the Mooncake conversation trace's format (timestamp ms, lengths, 512-token hash ids).
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1500, "output_length": 0, "hash_ids": [0, 1, 3]},
        {"timestamp": 500, "input_length": 300, "output_length": 5, "hash_ids": [4]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_mooncake_trace(trace)
    assert loaded.block_size == 512  # Mooncake's rows name no block size
    first, second, third = loaded.requests
    assert [r.arrival_s for r in (first, second, third)] == [0.0, 0.25, 0.5]
    assert len(first.tokens) == 1100 and len(second.tokens) == 1500 and len(third.tokens) == 300
    assert first.tokens[:1024] == second.tokens[:1024] and first.tokens[1024:] != second.tokens[1024:1100]
    assert second.output_tokens == 1  # an engine always produces at least one token
    trace.write_text('{"timestamp": 0}\n')
    import pytest

    with pytest.raises(ValueError, match=":1: not a Mooncake trace row"):
        load_mooncake_trace(trace)


def test_parallel_sweep_gives_the_sequential_numbers() -> None:
    from kvroute.tools.simulator.sweep import run_policies

    workload = generate(GeneratedWorkload("multi-turn", requests=120, rate_rps=6, seed=4))
    config = FleetConfig(workers=4, num_blocks=512, seed=4)
    seen: list[dict[str, int]] = []
    parallel = run_policies(
        ["kv_aware", "random", "least_loaded"], workload, config, jobs=2, progress=lambda counts: seen.append(dict(counts))
    )
    sequential = run_policies(["kv_aware", "random", "least_loaded"], workload, config, jobs=1)
    assert list(parallel) == ["kv_aware", "random", "least_loaded"]
    for name in parallel:
        assert parallel[name].ttft_s == sequential[name].ttft_s and parallel[name].hit_tokens == sequential[name].hit_tokens
    assert seen[-1] == {"kv_aware": 120, "random": 120, "least_loaded": 120}


def test_a_failing_policy_fails_the_sweep_instead_of_hanging() -> None:
    import pytest

    from kvroute.tools.simulator.sweep import run_policies

    workload = generate(GeneratedWorkload("one-shot", requests=10, rate_rps=5, seed=1))
    with pytest.raises((RuntimeError, ValueError), match="no_such_policy"):
        run_policies(["kv_aware", "no_such_policy"], workload, FleetConfig(workers=2), jobs=2)


def test_report_and_plots_are_written(tmp_path: Path) -> None:
    report, plots = tmp_path / "report.md", tmp_path / "plots"
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "simulate",
        "--workload",
        "shared-prefix",
        "--requests",
        "60",
        "--rate",
        "5",
        "--workers",
        "2",
        "--policies",
        "round_robin,kv_aware",
        "--report",
        str(report),
        "--plots",
        str(plots),
    ]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("ttft_cdf.png", "hit_rate.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    text = report.read_text()
    assert "| kv_aware |" in text and "](plots/ttft_cdf.png)" in text
    assert "simulated 100%" in out.stderr  # progress, as plain lines when stderr is not a terminal


def first_token_at(w, req: SimRequest) -> float:
    """When `req` (queued on `w`) gets its first token: step on from the end of `w`'s running step."""
    clock = w.step_end
    while True:
        result = w.scheduler.step()
        clock += result.seconds
        if req in result.first_tokens:
            return clock


def test_true_ttft_is_what_the_engine_then_takes() -> None:
    """The oracle's estimate, mid-step, with chunked prefill, a queue ahead and a cached prefix,
    equals the TTFT the scheduler then produces when nothing else arrives."""
    from kvroute.tools.simulator.fleet import _Worker, true_ttft

    config = FleetConfig(workers=1, num_blocks=512, block_size=16, max_num_batched_tokens=256, seed=1)
    w = _Worker(0, config)
    fresh = iter(range(1000, 100_000))
    shared = [next(fresh) for _ in range(320)]
    sched = w.scheduler

    def submit(prompt: list[int], rid: str) -> SimRequest:
        req = SimRequest(rid, prompt, 100)
        sched.add(req)
        return req

    submit(shared, "d")  # prefilled and cached first: the prefix the measured prompt will hit
    t = 0.0
    while sched.waiting or any(not r.prefill_done for r in sched.running):
        t += sched.step().seconds
    submit([next(fresh) for _ in range(600)], "a")  # chunked over three steps at 256 tokens
    first = sched.step()
    w.busy, w.step_end = True, t + first.seconds
    now = t + first.seconds / 3  # the measured prompt arrives a third into that step
    submit([next(fresh) for _ in range(300)], "b")  # queued ahead of it
    prompt = shared + [next(fresh) for _ in range(200)]

    blocked, estimate, hit = true_ttft(w, prompt, 10, now, config.max_num_batched_tokens)

    measured = submit(prompt, "c")
    clock = first_token_at(w, measured)
    assert not blocked and hit == 320 and measured.hit_tokens == 320
    assert abs(estimate - (clock - now)) < 1e-9


def test_true_ttft_counts_the_prefix_that_requests_ahead_cache_before_it_is_admitted() -> None:
    """Blocks are cached when their chunk is scheduled, and every prompt ahead is scheduled in full
    before this one is admitted: a prefix still being prefilled (or only queued) ahead is a hit."""
    from kvroute.tools.simulator.fleet import _Worker, true_ttft

    config = FleetConfig(workers=1, num_blocks=512, block_size=16, max_num_batched_tokens=256, seed=1)
    w = _Worker(0, config)
    fresh = iter(range(1000, 100_000))
    first, second = [next(fresh) for _ in range(320)], [next(fresh) for _ in range(160)]
    sched = w.scheduler
    sched.add(SimRequest("a", first + [next(fresh) for _ in range(280)], 100))  # 600 tokens: three steps
    step = sched.step()  # a's first chunk: 16 of first's 20 blocks cached so far
    w.busy, w.step_end = True, step.seconds
    sched.add(SimRequest("b", first + second + [next(fresh) for _ in range(40)], 100))  # queued; hits a's blocks
    prompt = first + second + [next(fresh) for _ in range(100)]

    blocked, estimate, hit = true_ttft(w, prompt, 10, 0.0, config.max_num_batched_tokens)

    measured = SimRequest("c", prompt, 10)
    sched.add(measured)
    clock = first_token_at(w, measured)
    assert sched.running[1].hit_tokens == 320 and measured.hit_tokens == 480  # a's 20 blocks, then b's next 10
    assert not blocked and hit == measured.hit_tokens
    assert abs(estimate - clock) < 1e-9


def test_true_ttft_flags_an_engine_without_a_free_sequence_slot() -> None:
    from kvroute.tools.simulator.fleet import _Worker, true_ttft

    config = FleetConfig(workers=1, num_blocks=256, max_num_seqs=1, seed=1)
    w = _Worker(0, config)
    w.scheduler.add(SimRequest("busy", list(range(100, 164)), 50))
    w.scheduler.step()
    assert true_ttft(w, list(range(500, 564)), 10, 0.0, config.max_num_batched_tokens)[0]
    idle = _Worker(0, config)
    assert not true_ttft(idle, list(range(500, 564)), 10, 0.0, config.max_num_batched_tokens)[0]


def test_ttft_oracle_runs_as_a_simulator_reference() -> None:
    workload = generate(GeneratedWorkload("hot-prefix", requests=200, rate_rps=12, groups=8, seed=2))
    config = FleetConfig(workers=4, num_blocks=1024, seed=2)
    oracle = simulate_policy("ttft_oracle", workload, config)
    rr = simulate_policy("round_robin", workload, config)
    assert len(oracle.e2e_s) == 200 and oracle.hit_rate > rr.hit_rate
    assert sorted(oracle.ttft_s)[100] <= sorted(rr.ttft_s)[100]


def test_seed_summary_counts_ties_for_every_policy_and_never_the_oracle() -> None:
    from kvroute.tools.simulator.seeds import markdown, summarize

    def result(hit: float, p50: float, p99: float) -> dict:
        return {"hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99}

    per_seed = {
        3: {"kv_aware": result(0.8, 50.0, 76.0), "approx_tree": result(0.9, 49.0, 76.0), "ttft_oracle": result(0.9, 40.0, 70.0)},
        4: {"kv_aware": result(0.6, 52.0, 80.0), "approx_tree": result(0.7, 53.0, 90.0), "ttft_oracle": result(0.9, 41.0, 71.0)},
    }
    summary = summarize(per_seed)
    kv, tree, oracle = summary["kv_aware"], summary["approx_tree"], summary["ttft_oracle"]
    assert kv["ttft_p99_ms"] == {"mean": 78.0, "min": 76.0, "max": 80.0}
    assert kv["hit_rate"]["mean"] == 0.7
    assert (kv["lowest_p50_seeds"], kv["lowest_p99_seeds"]) == (1, 2)  # seed 3's p99 is a tie: both count
    assert (tree["lowest_p50_seeds"], tree["lowest_p99_seeds"]) == (1, 1)
    assert (oracle["lowest_p50_seeds"], oracle["lowest_p99_seeds"]) == (0, 0)  # a reference, not a router policy
    text = "\n".join(markdown(per_seed, summary))
    assert "| kv_aware | 50.00 / 76.00 | 52.00 / 80.00 |" in text
    assert "| kv_aware | 70.0% | 51.00 [50.00, 52.00] | 78.00 [76.00, 80.00] | 1 of 2 | 2 of 2 |" in text
    assert "| ttft_oracle |" in text and "(reference)" in text


def test_simulate_over_several_seeds(tmp_path: Path) -> None:
    report = tmp_path / "seeds.md"
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "simulate",
        "--workload",
        "shared-prefix",
        "--requests",
        "60",
        "--rate",
        "5",
        "--workers",
        "2",
        "--policies",
        "round_robin,kv_aware",
        "--seeds",
        "1,2",
        "--report",
        str(report),
        "--json",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["seeds"]) == {"1", "2"} and set(result["summary"]) == {"round_robin", "kv_aware"}
    single = subprocess.run(
        argv[: argv.index("--seeds")] + ["--seed", "2", "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert json.loads(single.stdout.strip().splitlines()[-1])["policies"] == result["seeds"]["2"]  # same runs
    assert "lowest p99" in report.read_text()
    bad = subprocess.run(
        argv[: argv.index("--seeds")] + ["--seeds", "1,1"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "expected distinct integers" in bad.stderr


def test_routers_that_see_each_other_at_once_decide_exactly_as_one_router() -> None:
    """Each router decides on its own view, fed by the control plane's change log; with no view delay,
    what four routers share through it (reservations, prefill done, releases, engine events, load)
    makes them decide as one router does, request for request, with near ties and replication ahead of
    queues off (routers that know of others spread near ties on purpose, and each counts a prefix's
    demand from its own requests; what this checks is the state they share). A late view makes them
    differ: the delay is really applied."""
    from kvroute.tools.simulator.workloads import GeneratedWorkload, generate

    workload = generate(GeneratedWorkload("bursts", requests=240, rate_rps=4, seed=3, groups=8, burst_gap_ms=1.5))
    config = {
        "workers": 4,
        "num_blocks": 1024,
        "block_size": 16,
        "seed": 3,
        "kv_aware_params": {"near_tie_tokens": 0.0, "replicate_min_requests": 0.0},
    }
    one = simulate_policy("kv_aware", workload, FleetConfig(**config), detail=True)
    four = simulate_policy("kv_aware", workload, FleetConfig(**config, routers=4), detail=True)
    assert four.requests == one.requests and four.hit_tokens == one.hit_tokens
    stale = simulate_policy("kv_aware", workload, FleetConfig(**config, routers=4, view_delay_s=0.05), detail=True)
    assert stale.requests != one.requests


def pd_workload(requests: int = 300, rate: float = 10.0) -> list:
    return generate(
        GeneratedWorkload(
            "shared-prefix", requests=requests, rate_rps=rate, groups=8, system_prompt_tokens=2048, output_tokens=32, seed=0
        )
    )


def test_pd_pools_route_prefill_by_policy_and_hand_the_kv_to_decode() -> None:
    workload = pd_workload()
    # 8 prefixes x 128 blocks: one prefill worker's 640 blocks hold half of them, the pool of two all.
    colocated = FleetConfig(workers=4, num_blocks=640, block_size=16)
    pd = dataclasses.replace(colocated, prefill_workers=2)
    kv, rr = simulate_policy("kv_aware", workload, pd), simulate_policy("round_robin", workload, pd)
    for run in (kv, rr):
        assert len(run.ttft_s) == len(run.e2e_s) == len(workload) and run.rejected == 0
        assert run.busy_s[2] > 0 and run.busy_s[3] > 0  # the decode pool generated
    assert kv.hit_rate > rr.hit_rate + 0.2  # round-robin makes each prefill worker hold every prefix
    # A decode leg waits for its prefill and the transfer: TTFT grows with the time per block.
    slow = simulate_policy("kv_aware", workload, dataclasses.replace(pd, transfer_s_per_block=0.01))
    prompt_blocks = len(workload[0].tokens) // 16
    assert sorted(slow.ttft_s)[len(slow.ttft_s) // 2] > sorted(kv.ttft_s)[len(kv.ttft_s) // 2] + 0.8 * prompt_blocks * 0.01
    for bad in (dataclasses.replace(colocated, prefill_workers=4), dataclasses.replace(colocated, prefill_workers=5)):
        with pytest.raises(ValueError, match="prefill_workers"):
            simulate_policy("kv_aware", workload[:5], bad)
    with pytest.raises(ValueError, match="ttft_oracle"):
        simulate_policy("ttft_oracle", workload[:5], pd)


def test_simulate_compares_pd_pools_with_colocated_at_the_same_worker_count() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "simulate",
            "--workload",
            "shared-prefix",
            "--requests",
            "200",
            "--workers",
            "4",
            "--num-blocks",
            "640",
            "--policies",
            "kv_aware,round_robin,ttft_oracle",
            "--prefill-workers",
            "2",
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    policies = json.loads(out.stdout.strip().splitlines()[-1])["policies"]
    assert set(policies) == {"kv_aware", "round_robin", "ttft_oracle", "kv_aware P/D 2+2", "round_robin P/D 2+2"}
    assert policies["kv_aware P/D 2+2"]["hit_rate"] > policies["round_robin P/D 2+2"]["hit_rate"]
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "simulate",
            "--workload",
            "shared-prefix",
            "--workers",
            "4",
            "--prefill-workers",
            "4",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "leaves no decode worker" in refused.stderr
