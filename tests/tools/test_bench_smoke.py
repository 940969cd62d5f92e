"""The benchmarks run and report sane figures (their speed, and their targets, are `kvroute bench`'s
business, not the tests')."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvroute.prefix_index.backends import resolve_backend
from kvroute.tools.bench.ingest import run_ingest

pytestmark = pytest.mark.e2e  # starts kvroute processes


@pytest.mark.parametrize("backend", ["native", "bitmask"])
def test_ingest_counts_every_block_event(backend: str) -> None:
    result = run_ingest(n_batches=40, blocks_per_event=4, block_size=16, workers=4, index_backend=backend, memory_entries=20_000)
    assert result["index_backend"] == backend
    assert result["block_events"] == 40 * (4 + 2)  # each batch stores 4 blocks and removes 2
    assert result["block_events_per_s"] > 0 and 20 < result["bytes_per_block_entry"] < 2000
    assert set(result["apply_events_per_s"]) == set(result["apply_events_per_wall_s"]) == {"packed", "pb", "list"}
    assert all(rate > 0 for rate in result["apply_events_per_s"].values())
    assert result["index_entries_measured"] == 20_000 and result["rss_bytes_per_entry"] > 0
    assert 0.8 < result["estimated_bytes_per_entry"] / result["bytes_per_block_entry"] < 1.2
    if backend == "native":  # exact: every allocation is counted, and made where tracemalloc sees it
        assert result["estimated_bytes_per_entry"] == result["bytes_per_block_entry"] <= 64
    bounded = run_ingest(
        n_batches=40,
        blocks_per_event=4,
        block_size=16,
        workers=4,
        max_index_entries=50,
        index_backend=backend,
        memory_entries=2000,
        rss=False,
    )
    assert bounded["block_events"] == result["block_events"]  # what was applied; the bound drops afterwards
    assert bounded["index_entries"] <= 50 < result["index_entries"] and bounded["evicted_entries"] > 0


def test_decision_bench_cli_prints_json_last() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "decision",
            "--prompt-tokens",
            "512",
            "--workers",
            "4",
            "--iterations",
            "10",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fail_open"] == 0 and result["workers"] == 4 and result["p50_ms"] > 0


@pytest.mark.parametrize("backend", ["native", "bitmask"])
def test_answer_bench_cli_prints_json_last(backend: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "answer",
            "--workers",
            "4",
            "--iterations",
            "10",
            "--pause-ms",
            "0.1",
            "--index-backend",
            backend,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["workers"] == 4 and result["back_to_back_p50_us"] > 0 and result["pause_ms"] == 0.1
    assert result["index_backend"] == backend and result["match_tiers_p50_us"] > 0 and result["match_tiers_cpu_p99_us"] > 0
    assert result["skewed_match_tiers_cpu_p50_us"] > 0
    assert ("match_columns_p50_us" in result) == (backend == "native")


def test_proxy_bench_reports_every_target_and_the_router_stages() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "proxy",
            "--requests",
            "20",
            "--engines",
            "1",
            "--policies",
            "round_robin,kv_aware",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    targets = {"passthrough", "kvroute:round_robin", "kvroute:kv_aware"}
    assert set(result["added_p50_ms"]) == set(result["added_p99_ms"]) == targets
    assert all(s["p50"] > 0 for s in result["latency_ms"].values())
    stages = result["stages_ms"]
    assert set(stages["kvroute:kv_aware"]) == {"parse", "prepare", "keys", "query", "score", "connect", "first_byte"}
    # round_robin neither tokenizes nor queries: those stages are next to nothing.
    assert stages["kvroute:round_robin"]["query"]["p50"] < stages["kvroute:kv_aware"]["query"]["p50"]
    # kv_aware decides on its own view of the fleet (--index local, the router's default); round_robin holds none.
    assert result["decides_on_own_view"] == {"kvroute:round_robin": False, "kvroute:kv_aware": True}


def _bench_json(*args: str, timeout: float = 600, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_follow_bench_measures_lag_placement_catchup_memory_and_ingest(tmp_path) -> None:
    result = _bench_json(
        "follow",
        "--batches",
        "100",
        "--rate",
        "100",
        "--catchup-entries",
        "5000",
        "--catchup-runs",
        "1",
        "--memory-entries",
        "5000",
        "--ingest-batches",
        "400",
        "--workdir",
        str(tmp_path),
    )
    for mode in ("", "_redis"):  # embedded, and two replicas over a redis-server of the bench's own
        assert result[f"view_lag{mode}_samples"] >= 50 and result[f"view_lag{mode}_unseen"] == 0
        assert 0 < result[f"view_lag{mode}_p50_ms"] <= result[f"view_lag{mode}_p99_ms"] < 60_000
        assert result[f"placement_visible{mode}_samples"] >= 10 and result[f"placement_visible{mode}_unseen"] == 0
        assert 0 < result[f"placement_visible{mode}_p50_ms"] <= result[f"placement_visible{mode}_p99_ms"] < 60_000
        assert result[f"disturbance{mode}"]["measured"]
    assert result["catchup_entries"] >= 5000 and 0 < result["router_catchup_s_1m"] < 120
    assert result["router_catchup_process_s_1m"] >= result["router_catchup_s_1m"]
    assert result["view_entries"] >= 5000 and 20 < result["bytes_per_entry"] < 2000
    assert result["ingest_block_events"] == 400 * 16 * 2 and result["ingest_events_per_s"] > 0
    assert result["grpc_echo_p50_ms"] > 0 and result["index_backend"] == resolve_backend("auto")


@pytest.mark.parametrize("index", ["local", "remote"])
def test_decision_bench_decides_while_the_fleet_changes(index: str) -> None:
    result = _bench_json(
        "decision",
        "--prompt-tokens",
        "512",
        "--workers",
        "4",
        "--iterations",
        "20",
        "--follow-rate",
        "5000",
        "--other-blocks",
        "500",
        "--index",
        index,
    )
    assert result["index"] == index and result["follow_rate"] == 5000 and result["fail_open"] == 0
    assert result["decisions"] == 20 and 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["query_p50_ms"] > 0 and result["control_plane_applied_events_per_s"] > 0
    if index == "local":  # the view applied the feed's changes meanwhile, in this process
        assert result["view_applied_events_per_s"] > 0 and result["view_entries"] >= 4 * 500
    else:
        assert result["grpc_echo_p50_ms"] > 0 and result["control_plane_answer_mean_ms"] > 0


def test_saturate_bench_says_in_one_line_when_nginx_or_wrk_is_missing(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "saturate", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "apt-get install -y nginx wrk" in out.stderr


@pytest.mark.skipif(
    not (shutil.which("nginx") and shutil.which("wrk")), reason="nginx and wrk are not installed (apt-get install -y nginx wrk)"
)
def test_saturate_bench_reports_rate_and_cpu_per_request_per_target(tmp_path) -> None:
    result = _bench_json("saturate", "--seconds", "1", "--rounds", "1", "--engines", "2", "--workdir", str(tmp_path))
    targets = {"direct", "kvroute:round_robin", "kvroute:kv_aware"}
    assert set(result["requests_per_s"]) == set(result["cpu_us_per_request"]) == targets
    assert all(result["requests_per_s"][t] > 0 and result["cpu_us_per_request"][t] > 0 for t in targets)
    assert all(n == 0 for n in result["non_2xx"].values())
    # kvroute's figure counts its control plane's share; the router's own part is in it.
    parts = result["cpu_us_per_request_by_part"]["kvroute:kv_aware"]
    assert set(parts) == {"router", "control_plane"}
    assert abs(parts["router"] + parts["control_plane"] - result["cpu_us_per_request"]["kvroute:kv_aware"]) < 1
