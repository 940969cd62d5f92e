"""`kvroute bench replicas` runs against real processes and a real Redis and prints the keys other checks
read (its figures are measured by the bench itself, at full size, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # starts kvroute processes

KEYS = (
    "freshness_p50_ms",
    "freshness_p99_ms",
    "ingest_events_per_s",
    "ingest_in_process_events_per_s",
    "ingest_ratio",
    "catchup_s_100k",
    "answers_per_s_1_replica",
    "answers_per_s_2_replicas",
    "bytes_per_entry",
    "sessions_state_bytes",
    "sessions_restart_ready_s",
    "sessions_restart_visible_s",
)


def test_replicas_bench_cli_prints_json_last() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "replicas",
            "--batches",
            "200",
            "--trials",
            "5",
            "--catchup-blocks",
            "100000",
            "--answer-step-s",
            "0.3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    missing = [k for k in KEYS if k not in result]
    assert not missing, result
    assert result["ingest_block_events"] == 200 * 18 and result["catchup_entries_100k"] >= 100_000
    assert 0 < result["freshness_p50_ms"] <= result["freshness_p99_ms"] and result["bytes_per_entry"] > 0
    assert 0 < result["sessions_restart_ready_s"] <= result["sessions_restart_visible_s"]
