"""`kvroute bench decision` runs end to end on a small setup (the figures are the benchmark's job)."""

from __future__ import annotations

import pytest

from kvroute.tools.bench.decision import run_decision

pytestmark = pytest.mark.e2e  # starts kvroute processes


def test_decision_bench_runs_against_a_control_plane_with_requests_in_flight() -> None:
    result = run_decision(prompt_tokens=512, workers=4, iterations=5, other_blocks=10, index="remote")
    assert result["fail_open"] == 0  # every decision used the index's answer
    assert result["inflight_elsewhere"] == 128 and result["workers"] == 4
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["cold_tokenize_p50_ms"] > 0 and result["query_p50_ms"] > 0
    # The floor under the query: a bare stream round trip with the query's and answer's sizes.
    assert result["query_bytes"] > 512 // 16 * 8 and result["answer_bytes"] > 4 * 2
    assert result["grpc_echo_p50_ms"] > 0
    assert 0 < result["control_plane_answer_mean_ms"] < result["query_p50_ms"] * 10


def test_decision_bench_on_the_routers_own_view_sees_the_requests_in_flight() -> None:
    result = run_decision(prompt_tokens=512, workers=4, iterations=5, other_blocks=10, index="local")
    assert result["fail_open"] == 0 and result["index"] == "local"
    assert result["view_entries"] >= 4 * 10 and result["view_snapshots"] == 1
    assert 0 < result["query_p50_ms"] <= result["p50_ms"]  # the view's answer, in this process
    assert "grpc_echo_p50_ms" not in result  # no query to put a floor under


def test_grpc_echo_answers_every_message_on_one_stream() -> None:
    import subprocess
    import sys

    from kvroute import aio
    from kvroute.tools.bench.grpc_echo import round_trips_ms
    from kvroute.tools.local_cluster import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kvroute.tools.bench.grpc_echo", "--port", str(port), "--reply-bytes", "300"]
    )
    try:
        samples = aio.run_value(round_trips_ms(f"127.0.0.1:{port}", 4000, iterations=20, warmup=2))
    finally:
        server.terminate()
        server.wait(10)
    assert len(samples) == 20 and all(s > 0 for s in samples)


def test_answer_bench_times_the_answer_the_serving_path_gives() -> None:
    from kvroute.tools.bench.answer import build, run_answer
    from kvroute.v1 import kvroute_pb2 as pb

    answer, query_bytes, _ = build(workers=6, prompt_blocks=32, other_blocks=10, inflight_requests=12, block_size=16, seed=1)
    reply = pb.RouterReply.FromString(answer())
    columns = reply.result.columns
    assert len(columns.worker_id) == 6 and reply.result.query_id == 1
    assert sum(columns.reserved_requests) == 12  # the other router's requests, all of them
    assert sum(columns.reserved_prefill_tokens) == 12 * 256
    assert max(columns.matched_blocks) <= 32 and any(columns.matched_blocks)
    assert query_bytes > 32 * 8
    result = run_answer(workers=6, prompt_tokens=512, other_blocks=10, inflight_requests=12, iterations=5, pause_ms=0.1)
    assert all(result[k] > 0 for k in ("back_to_back_p50_us", "after_pause_p50_us", "after_traffic_p50_us"))
    assert result["back_to_back_p99_us"] >= result["back_to_back_p50_us"] and "unmarked_p50_us" not in result
    bounded = run_answer(
        workers=6, prompt_tokens=512, other_blocks=10, inflight_requests=12, iterations=5, pause_ms=0.1, max_index_entries=10_000
    )
    assert bounded["unmarked_p50_us"] > 0 and bounded["index_entries"] == result["index_entries"] < 10_000
    with pytest.raises(ValueError, match="must exceed"):
        run_answer(workers=6, prompt_tokens=512, other_blocks=10, inflight_requests=12, iterations=5, max_index_entries=10)
