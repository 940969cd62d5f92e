"""`kvroute bench decision` runs end to end on a small setup (the figures are the benchmark's job)."""

from __future__ import annotations

from bench.decision import run_decision


def test_decision_bench_runs_against_a_control_plane_with_requests_in_flight() -> None:
    result = run_decision(prompt_tokens=512, workers=4, iterations=5, other_blocks=10)
    assert result["fail_open"] == 0  # every decision used the index's answer
    assert result["inflight_elsewhere"] == 128 and result["workers"] == 4
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["cold_tokenize_p50_ms"] > 0 and result["query_p50_ms"] > 0
