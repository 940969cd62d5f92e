"""The micro-benchmarks run and report sane figures (their speed is measured by `kvroute bench`, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvroute.tools.bench.ingest import run_ingest

pytestmark = pytest.mark.e2e  # starts kvroute processes


@pytest.mark.parametrize("backend", ["native", "bitmask"])
def test_ingest_counts_every_block_event(backend: str) -> None:
    result = run_ingest(n_batches=40, blocks_per_event=4, block_size=16, workers=4, index_backend=backend,
                        memory_entries=20_000)
    assert result["index_backend"] == backend
    assert result["block_events"] == 40 * (4 + 2)  # each batch stores 4 blocks and removes 2
    assert result["block_events_per_s"] > 0 and 20 < result["bytes_per_block_entry"] < 2000
    assert set(result["apply_events_per_s"]) == set(result["apply_events_per_wall_s"]) == {"packed", "pb", "list"}
    assert all(rate > 0 for rate in result["apply_events_per_s"].values())
    assert result["index_entries_measured"] == 20_000 and result["rss_bytes_per_entry"] > 0
    assert 0.8 < result["estimated_bytes_per_entry"] / result["bytes_per_block_entry"] < 1.2
    if backend == "native":  # exact: every allocation is counted, and made where tracemalloc sees it
        assert result["estimated_bytes_per_entry"] == result["bytes_per_block_entry"] <= 64
    bounded = run_ingest(n_batches=40, blocks_per_event=4, block_size=16, workers=4, max_index_entries=50,
                         index_backend=backend, memory_entries=2000, rss=False)
    assert bounded["block_events"] == result["block_events"]  # what was applied; the bound drops afterwards
    assert bounded["index_entries"] <= 50 < result["index_entries"] and bounded["evicted_entries"] > 0


def test_decision_bench_cli_prints_json_last() -> None:
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "bench", "decision", "--prompt-tokens", "512",
                          "--workers", "4", "--iterations", "10", "--json"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fail_open"] == 0 and result["workers"] == 4 and result["p50_ms"] > 0


@pytest.mark.parametrize("backend", ["native", "bitmask"])
def test_answer_bench_cli_prints_json_last(backend: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "bench", "answer", "--workers", "4", "--iterations",
                          "10", "--pause-ms", "0.1", "--index-backend", backend, "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["workers"] == 4 and result["back_to_back_p50_us"] > 0 and result["pause_ms"] == 0.1
    assert result["index_backend"] == backend and result["match_tiers_p50_us"] > 0 and result["match_tiers_cpu_p99_us"] > 0
    assert result["skewed_match_tiers_cpu_p50_us"] > 0
    assert ("match_columns_p50_us" in result) == (backend == "native")


def test_proxy_bench_reports_every_target_and_the_router_stages() -> None:
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "bench", "proxy", "--requests", "20", "--engines", "1",
                          "--policies", "round_robin,kv_aware", "--json"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    targets = {"passthrough", "kvroute:round_robin", "kvroute:kv_aware"}
    assert set(result["added_p50_ms"]) == set(result["added_p99_ms"]) == targets
    assert all(s["p50"] > 0 for s in result["latency_ms"].values())
    stages = result["stages_ms"]
    assert set(stages["kvroute:kv_aware"]) == {"parse", "prepare", "keys", "query", "score", "connect", "first_byte"}
    # round_robin neither tokenizes nor queries: those stages are next to nothing.
    assert stages["kvroute:round_robin"]["query"]["p50"] < stages["kvroute:kv_aware"]["query"]["p50"]
