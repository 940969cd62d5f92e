"""`kvroute bench decision` runs end to end on a small setup (the figures are the benchmark's job)."""

from __future__ import annotations

from bench.decision import run_decision


def test_decision_bench_runs_against_a_control_plane_with_requests_in_flight() -> None:
    result = run_decision(prompt_tokens=512, workers=4, iterations=5, other_blocks=10)
    assert result["fail_open"] == 0  # every decision used the index's answer
    assert result["inflight_elsewhere"] == 128 and result["workers"] == 4
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["cold_tokenize_p50_ms"] > 0 and result["query_p50_ms"] > 0
    # The floor under the query: a bare stream round trip with the query's and answer's sizes.
    assert result["query_bytes"] > 512 // 16 * 8 and result["answer_bytes"] > 4 * 2
    assert result["grpc_echo_p50_ms"] > 0
    assert 0 < result["control_plane_answer_mean_ms"] < result["query_p50_ms"] * 10


def test_grpc_echo_answers_every_message_on_one_stream() -> None:
    import subprocess
    import sys

    from bench.grpc_echo import round_trips_ms
    from kvroute import aio
    from kvroute.local_cluster import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.grpc_echo", "--port", str(port), "--reply-bytes", "300"])
    try:
        samples = aio.run_value(round_trips_ms(f"127.0.0.1:{port}", 4000, iterations=20, warmup=2))
    finally:
        server.terminate()
        server.wait(10)
    assert len(samples) == 20 and all(s > 0 for s in samples)
