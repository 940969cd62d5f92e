"""A trace carries the block size its hash ids stand for, and `kvroute simulate` uses it.

At Mooncake's 512 tokens per id, prompts of a few hundred tokens are all partial blocks: a trace
captured from them shows no sharing at all, and the simulator used to replay it at 512 without a
word (kv_aware could come out behind round_robin). Captured rows now say `block_size` (64 by
default), the simulator simulates at it, plain Mooncake rows still mean 512, a trace whose
granularity hides most of its prompts gets a warning, and an empty trace is an error.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.data_plane.ops.traffic_capture import CAPTURE_BLOCK_TOKENS, TrafficCapture
from kvroute.tools.simulator.workloads import load_mooncake_trace


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "simulate", *args], capture_output=True, text=True, timeout=120, check=False
    )


def short_prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Chat-sized prompts: one of 24 system prompts of 200 tokens, then an 80-token user turn."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 30000) for _ in range(200)] for _ in range(24)]
    return [rng.choice(systems) + [rng.randrange(10, 30000) for _ in range(80)] for _ in range(n)]


async def test_a_captured_trace_carries_its_block_size_and_the_simulator_uses_it(tmp_path: Path) -> None:
    path = tmp_path / "captured.jsonl"
    capture = TrafficCapture(path, flush_interval_s=3600)
    capture.start()
    for i, prompt in enumerate(short_prompts(240)):
        capture.record(i * 40, prompt, 8, "tiny")
    await capture.aclose()

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {row["block_size"] for row in rows} == {CAPTURE_BLOCK_TOKENS} == {64}
    assert all(len(row["hash_ids"]) == 5 for row in rows)  # 280 tokens: 4 blocks of 64 and a tail
    trace = load_mooncake_trace(path)
    assert trace.block_size == 64 and len(trace.requests) == 240

    out = simulate("--trace", str(path), "--workers", "4", "--policies", "round_robin,kv_aware", "--json")
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["block_size"] == 64 and result["warnings"] == []
    policies = result["policies"]
    # The shared 192 tokens of each prompt are visible (at 512 nothing is: 0% for every policy), and
    # kv_aware finds them on the worker that holds them where round_robin has to cache each everywhere.
    assert result["oracle_hit_rate"] > 0.6
    assert policies["kv_aware"]["hit_rate"] > 0.5 and policies["kv_aware"]["hit_rate"] > policies["round_robin"]["hit_rate"] + 0.1
    assert policies["kv_aware"]["ttft_p50_ms"] < policies["round_robin"]["ttft_p50_ms"]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_plain_mooncake_trace_is_512_and_short_prompts_in_it_get_a_warning(tmp_path: Path) -> None:
    # The same short prompts as Mooncake would write them: one partial 512-token block each.
    rows = [{"timestamp": i * 40, "input_length": 280, "output_length": 8, "hash_ids": [i]} for i in range(120)]
    path = write_rows(tmp_path / "coarse.jsonl", rows)
    assert load_mooncake_trace(path).block_size == 512
    out = simulate("--trace", str(path), "--workers", "4", "--policies", "round_robin,kv_aware", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["block_size"] == 512
    assert len(result["warnings"]) == 1 and "100% of the trace's prompt tokens" in result["warnings"][0]
    assert "partial 512-token blocks" in result["warnings"][0] and "--capture-block-tokens" in result["warnings"][0]
    assert [line for line in out.stderr.splitlines() if "warning" in line] == [
        f"kvroute simulate: warning: {result['warnings'][0]}"
    ]
    # Long prompts at 512 (the public traces' case) stay quiet.
    long_rows = [{"timestamp": i * 40, "input_length": 5000, "output_length": 8, "hash_ids": list(range(10))} for i in range(20)]
    quiet = simulate(
        "--trace", str(write_rows(tmp_path / "long.jsonl", long_rows)), "--workers", "2", "--policies", "kv_aware", "--json"
    )
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
    # --block-size still overrides the trace's.
    finer = simulate("--trace", str(path), "--workers", "2", "--policies", "kv_aware", "--block-size", "16", "--json")
    assert json.loads(finer.stdout.splitlines()[-1])["block_size"] == 16


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [
                {"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [0, 1], "block_size": 64},
                {"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [0]},
            ],
            ":2: block_size 512 (a row without one means 512), but line 1 has 64",
        ),
        (
            [{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [0], "block_size": 64}],
            ":1: 1 hash ids of 64 tokens cannot cover input_length 100",
        ),
        (
            [{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [0], "block_size": 0}],
            ":1: block_size must be positive, got 0",
        ),
    ],
)
def test_inconsistent_block_sizes_are_one_line_errors(tmp_path: Path, rows: list[dict], message: str) -> None:
    out = simulate("--trace", str(write_rows(tmp_path / "bad.jsonl", rows)), "--workers", "2")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and message in out.stderr, out.stderr


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_trace_is_an_error_not_a_table_of_zeros(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    out = simulate("--trace", str(path), "--workers", "2")
    assert out.returncode == 2, out.stdout
    assert out.stdout == ""
    assert out.stderr.splitlines() == [f"kvroute simulate: error: {path} holds no request: nothing to simulate"]


def test_no_requests_and_a_missing_trace_are_one_line_errors(tmp_path: Path) -> None:
    out = simulate("--workload", "shared-prefix", "--requests", "0")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["kvroute simulate: error: --requests 0: nothing to simulate"]
    missing = simulate("--trace", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and missing.stdout == "" and len(missing.stderr.splitlines()) == 1
    assert "No such file" in missing.stderr
