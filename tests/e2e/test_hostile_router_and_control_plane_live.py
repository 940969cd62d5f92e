"""A live fuzz of a router's HTTP and gRPC ports and of a control plane's gRPC port, as `kvroute bench fuzz
--target router-http|router-grpc|control-plane` runs it (bench/fuzz_router.py, bench/fuzz_control_plane.py),
with a few hundred inputs per target so that the tier stays under a minute.

Each starts its processes, sends malformed, random and semantically bad input between valid traffic
and then requires: no process exited, none left an input unanswered (10 s), the ports answer health
within 1 s, every valid request succeeded and every valid event is in the index (`kvroute audit`
clean for the router targets' engine; the valid agent's exact keys at the control plane, and no block
of any refused stream), and every bad input was answered as its kind must be: a 4xx with OpenAI's
error JSON on HTTP; on gRPC INVALID_ARGUMENT for bytes that do not parse, the documented status with a
message for semantically bad requests, and never UNKNOWN or INTERNAL. The 10,000-per-target runs are
in docs/benchmarks/2026-12-04-fuzz.md.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from kvroute.tools.bench.fuzz import run_target
from kvroute.tools.local_cluster import kvroute_argv

pytestmark = pytest.mark.slow

MESSAGES = 300


@pytest.mark.parametrize("target", ["router-http", "router-grpc", "control-plane"])
def test_live_fuzz(target: str, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    report = run_target(target, MESSAGES, seed=seed, workdir=tmp_path)
    summary = (
        f"seed {seed} (kvroute bench fuzz --target {target} --messages {MESSAGES} --seed {seed}): "
        f"{report.problems} failures {report.details.get('failures')}"
    )
    assert report.bad_messages == MESSAGES and report.valid_messages >= MESSAGES // 4, summary
    assert report.crashes == 0 and report.hangs == 0 and report.health_ms < 1000, summary
    assert report.applied, summary
    assert report.bad_counted == report.bad_expected, summary
    # Every family of bad input was sent at least once.
    families = {kind.split(":")[0] for kind in report.bad_expected}
    assert (
        families
        >= {
            "router-http": {"not_json", "wrong_type", "surrogate", "deep_nesting", "too_large", "mutated"},
            "router-grpc": {"unparseable", "surrogate", "semantic", "mutated", "random"},
            "control-plane": {"unparseable", "connect", "router_session", "query", "random"},
        }[target]
    ), summary
    assert report.ok, summary


def test_the_command_prints_the_table_and_json_and_exits_0(tmp_path: Path) -> None:
    done = subprocess.run(
        kvroute_argv("bench", "fuzz", "--target", "router-grpc", "--messages", "40", "--seed", "7", "--workdir", str(tmp_path)),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("target router-grpc: ") and any(line.split()[:1] == ["unparseable"] for line in lines)
    result = json.loads(lines[-1])
    assert result["ok"] and result["bad_messages"] == 40 and result["crashes"] == 0, result
    assert (tmp_path / "router-fuzz.log").exists()  # --workdir keeps the processes' logs
