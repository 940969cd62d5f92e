"""`kvroute bench live`: the token-id folding keeps a workload's sharing structure, the ordering
check means what it says, and a small live run (control plane, sim engines with agents, one router
per policy, all processes) shows kv_aware's hit-rate win that the simulator predicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.tools.bench.live import FIRST_PLAIN_TOKEN, map_token_ids, pairwise_agree
from kvroute.tools.simulator.workloads import GeneratedWorkload, generate

pytestmark = pytest.mark.e2e  # starts kvroute processes


def sharing_preserved(workload_name: str, vocab_size: int, block_size: int = 16) -> bool:
    """Block key k of the raw workload <-> block key k of the folded one, one to one, across every
    request: then every engine cache and the index see exactly the raw workload's reuse."""
    workload = generate(
        GeneratedWorkload(workload_name, requests=150, rate_rps=20, groups=8, system_prompt_tokens=2048, output_tokens=16, seed=0)
    )
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for req in workload:
        raw = prompt_block_keys(req.tokens, block_size, "m")
        folded = prompt_block_keys(map_token_ids(req.tokens, vocab_size), block_size, "m")
        if len(raw) != len(folded):
            return False
        for a, b in zip(raw, folded):
            if forward.setdefault(a, b) != b or backward.setdefault(b, a) != a:
                return False
    return True


def test_folded_ids_are_in_vocabulary_and_deterministic() -> None:
    tokens = [0, 1, 6, 7, 2040, 2041, 10_000_000, 1_999_999_999]
    folded = map_token_ids(tokens, 2048)
    assert folded == map_token_ids(tokens, 2048)
    assert all(FIRST_PLAIN_TOKEN <= t < 2048 for t in folded)
    assert folded[:2] == [FIRST_PLAIN_TOKEN, FIRST_PLAIN_TOKEN + 1]


def test_folding_keeps_the_block_sharing_structure() -> None:
    for name in ("shared-prefix", "multi-turn", "rag", "agent", "one-shot"):
        assert sharing_preserved(name, 2048), name
    # The check has teeth: folding into 16 ids makes every shared prefix start with the same block.
    assert not sharing_preserved("shared-prefix", FIRST_PLAIN_TOKEN + 16)


def test_sessions_reach_the_router_and_the_closed_loop_simulation() -> None:
    from kvroute.tools.bench.live import LiveRun, request_bodies, sim_workload

    workload = generate(GeneratedWorkload("multi-turn", requests=12, rate_rps=5, seed=1))
    assert any(r.session for r in workload)
    bodies = [json.loads(b) for b in request_bodies(workload, "tiny-llama", 2048)]
    assert [b.get("user", "") for b in bodies] == [r.session for r in workload]
    run = LiveRun("session", speedup=2.0, sent_s={i: 0.5 * i for i in range(12)})
    replayed = sim_workload(workload, run, closed=True)
    assert [r.session for r in replayed] == [r.session for r in workload]
    assert [r.arrival_s for r in replayed] == [1.0 * i for i in range(12)]


def test_pairwise_agreement() -> None:
    assert pairwise_agree({"a": 0.8, "b": 0.4}, {"a": 0.7, "b": 0.5})
    assert not pairwise_agree({"a": 0.8, "b": 0.4}, {"a": 0.5, "b": 0.7})
    assert pairwise_agree({"a": 0.8, "b": 0.4, "c": 0.3}, {"a": 0.9, "b": 0.5, "c": 0.5})  # simulated tie b = c
    assert not pairwise_agree({"a": 0.8, "b": 0.4, "c": 0.9}, {"a": 0.9, "b": 0.5, "c": 0.5})
    assert pairwise_agree({"a": None, "b": 0.4}, {"a": 0.1, "b": 0.5})  # no live value: nothing to compare


def test_live_kv_aware_beats_round_robin_like_the_simulator(tmp_path: Path) -> None:
    requests = 120
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "live",
            "--workload",
            "shared-prefix",
            "--requests",
            str(requests),
            "--policies",
            "kv_aware,round_robin",
            "--kv-aware-param",
            "load_bound=1.5",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The weights reach kv_aware's router and its simulation, and no other router.
    assert result["fleet"]["kv_aware_params"] == {"load_bound": 1.5}
    assert "load_bound=1.5" in (tmp_path / "router-kv_aware.log").read_text()
    assert "load_bound" not in (tmp_path / "router-round_robin.log").read_text()
    kv, rr = result["policies"]["kv_aware"], result["policies"]["round_robin"]
    for p in (kv, rr):
        assert p["live"]["requests"] == requests and p["live"]["errors"] == 0, p
        assert p["live"]["ttft_p50_ms"] > 0 and p["sim"]["ttft_p50_ms"] > 0, p
    # Round-robin thrashes the small caches, kv_aware keeps each prefix on one engine.
    assert kv["live"]["hit_rate"] > rr["live"]["hit_rate"] + 0.15, result
    assert kv["sim"]["hit_rate"] > rr["sim"]["hit_rate"], result
    assert result["ordering"]["hit_rate"] is True, result
    # Round-robin's placement does not depend on timing, so live and simulated caches see the same stream.
    assert abs(rr["live"]["hit_rate"] - rr["sim"]["hit_rate"]) < 0.08, result


def test_the_endpoint_picker_runs_beside_its_router(tmp_path: Path) -> None:
    """--epp: the same policy through `kvroute epp`, the client sending to the engine it picked; its
    hit rate is the router's up to timing (docs/benchmarks/2026-12-04-epp.md: within 2.3 points in a run)."""
    requests = 120
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "live",
            "--workload",
            "shared-prefix",
            "--requests",
            str(requests),
            "--policies",
            "kv_aware",
            "--epp",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    router, picker = result["policies"]["kv_aware"], result["policies"]["epp:kv_aware"]
    assert picker["live"]["requests"] == requests and picker["live"]["errors"] == 0, picker
    assert len(picker["live"]["per_worker"]) > 1 and set(picker["live"]["per_worker"]) <= {f"engine-{i}" for i in range(4)}
    assert picker["sim"] == router["sim"]  # the picker's run is simulated as its policy
    assert abs(picker["live"]["hit_rate"] - router["live"]["hit_rate"]) < 0.1, result
    assert "epp ready" in (tmp_path / "epp-kv_aware.log").read_text()


def test_bad_kv_aware_weights_fail_before_any_process_starts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "live", "--kv-aware-param", "load_bound=0.5"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "load_bound must be 0 (off) or >= 1.0" in out.stderr
    assert "starting" not in out.stderr


def test_pd_fleet_kv_aware_prefill_choice_beats_round_robin(tmp_path: Path) -> None:
    """--pd: the same workload through a P/D fleet, the prefill worker chosen by each policy."""
    requests = 80
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "live",
            "--pd",
            "vllm",
            "--engines",
            "2",
            "--decode-engines",
            "1",
            "--requests",
            str(requests),
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fleet"]["pd"] == "vllm" and set(result["policies"]) == {"kv_aware", "round_robin"}
    kv, rr = (result["policies"][p]["live"] for p in ("kv_aware", "round_robin"))
    for run in (kv, rr):
        assert run["requests"] == requests and run["errors"] == 0, run
        assert run["per_worker"] == {"decode-0": requests}, run  # every answer from the decode pool
        assert set(run["per_prefill_worker"]) == {"prefill-0", "prefill-1"}, run
    assert kv["hit_rate"] > rr["hit_rate"] + 0.15, result  # the prefix stays on its prefill worker
    assert "pd=vllm" in (tmp_path / "router-pd-kv_aware.log").read_text()


def test_pd_refuses_an_existing_fleet_before_any_process_starts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "live", "--pd", "vllm", "--router-url", "http://127.0.0.1:1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--pd starts its own P/D fleet" in out.stderr
    assert "starting" not in out.stderr
