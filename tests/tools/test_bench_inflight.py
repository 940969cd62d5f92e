"""`kvroute bench inflight` runs against a control-plane process and reports visibility delays
(their size is measured by the bench, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # starts kvroute processes


def test_inflight_bench_cli_prints_json_last() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "inflight", "--trials", "5", "--block-keys", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["trials"] == 5 and result["block_keys"] == 8
    # Each trial needs at least one query to see the reservation and one to see its release.
    assert result["polls_per_trial"] >= 2
    assert 0 < result["reserve_visible_p50_ms"] <= result["reserve_visible_p99_ms"]
    assert 0 < result["release_visible_p50_ms"] <= result["release_visible_p99_ms"]
