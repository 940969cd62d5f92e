"""`kvroute simulate --grid`: the table and JSON cover every point, the ratios are kv_aware's mean over
the best other policy's mean, and parallel points give the sequential numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvroute.tools.simulator.grid import GridSpec, kv_aware_ratio, run_grid

TINY = [
    "--grid",
    "--grid-sources",
    "one-shot,shared-prefix",
    "--grid-caches",
    "default,tight",
    "--grid-rates",
    "high",
    "--grid-routers",
    "1,2",
    "--requests",
    "40",
    "--seeds",
    "1,2",
    "--policies",
    "kv_aware,round_robin,least_loaded,chwbl",
]


def _simulate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "simulate", *argv], check=False, capture_output=True, text=True, timeout=300
    )


def test_tiny_grid_reports_every_point_and_the_ratio_to_the_best_other_policy() -> None:
    out = _simulate(*TINY, "--jobs", "2")
    assert out.returncode == 0, out.stderr
    *table, last = out.stdout.strip().splitlines()
    document = json.loads(last)
    assert document["grid"]["routers"] == [1, 2] and document["grid"]["seeds"] == [1, 2]
    points = document["points"]
    assert [(p["source"], p["cache"], p["routers"]) for p in points] == [
        (s, c, r) for s in ("one-shot", "shared-prefix") for c in ("default", "tight") for r in (1, 2)
    ]
    assert {p["view_delay_ms"] for p in points if p["routers"] == 2} == {10.0}
    assert [p["num_blocks"] for p in points if p["routers"] == 1] == [1024, 512, 1024, 512]
    for p in points:
        assert list(p["policies"]) == ["kv_aware", "round_robin", "least_loaded", "chwbl"]
        for metric in ("ttft_p50_ms", "ttft_p99_ms"):
            # By hand: each policy's mean over the seeds, then kv_aware's over the lowest of the others'.
            means = {name: sum(s[metric] for s in r["per_seed"].values()) / 2 for name, r in p["policies"].items()}
            assert all(means[name] == pytest.approx(r[metric], abs=1e-3) for name, r in p["policies"].items())
            best = min(v for name, v in means.items() if name != "kv_aware")
            tail = "p50" if metric == "ttft_p50_ms" else "p99"
            assert p[f"kv_aware_ratio_{tail}"] == pytest.approx(means["kv_aware"] / best, rel=1e-3)
            assert means[p[f"best_other_{tail}"]] == best
        assert p["meets_p50"] == (p["kv_aware_ratio_p50"] <= 1.02)
        assert p["meets_p99"] == (p["kv_aware_ratio_p99"] <= 1.1)
        assert 0.0 <= p["ceiling"] <= p["ceiling_infinite"] <= 1.0
    for routers in ("1", "2"):
        at = [p for p in points if p["routers"] == int(routers)]
        assert document["summary"][routers] == {
            "points": 4,
            "meet_p50": sum(p["meets_p50"] for p in at),
            "meet_p99": sum(p["meets_p99"] for p in at),
            "meet_both": sum(p["meets_p50"] and p["meets_p99"] for p in at),
        }
    rows = [line for line in table if line.startswith(("| one-shot", "| shared-prefix"))]
    assert len(rows) == len(points)
    for row, p in zip(rows, points):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:4] == [p["source"], p["cache"], "high", str(p["routers"])]
        assert cells[-3:-1] == [f"{p['kv_aware_ratio_p50']:.3f}", f"{p['kv_aware_ratio_p99']:.3f}"]
        assert ("p50 (vs" in cells[-1]) == (not p["meets_p50"]) and ("p99 (vs" in cells[-1]) == (not p["meets_p99"])
    assert any(line.startswith(f"| 1 | 4 | {document['summary']['1']['meet_p50']} | ") for line in table)

    # The same grid in one process: the same numbers, bit for bit.
    assert (
        run_grid(
            GridSpec(
                sources=("one-shot", "shared-prefix"),
                caches=("default", "tight"),
                rates=("high",),
                routers=(1, 2),
                requests=40,
                seeds=(1, 2),
                policies=("kv_aware", "round_robin", "least_loaded", "chwbl"),
            ),
            jobs=1,
        )
        == document
    )


def test_ratio_is_against_the_lowest_other_policy() -> None:
    assert kv_aware_ratio({"kv_aware": 110.0, "round_robin": 100.0, "chwbl": 120.0}) == (1.1, "round_robin")
    assert kv_aware_ratio({"chwbl": 50.0, "kv_aware": 25.0, "round_robin": 80.0}) == (0.5, "chwbl")
    assert kv_aware_ratio({"kv_aware": 0.0, "round_robin": 0.0}) == (1.0, "round_robin")


def test_bad_grid_input_is_one_line_and_exit_2(tmp_path) -> None:
    missing = _simulate("--grid", "--grid-sources", "mooncake", "--grid-trace", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "is not a file" in missing.stderr
    without_kv_aware = _simulate("--grid", "--policies", "round_robin,chwbl")
    assert without_kv_aware.returncode == 2 and "name it" in without_kv_aware.stderr
    unknown = _simulate("--grid", "--grid-caches", "huge")
    assert unknown.returncode == 2 and "unknown cache size 'huge'" in unknown.stderr
