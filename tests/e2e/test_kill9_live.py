"""kill -9 at every process kind under steady load (issue 17, item 6): an engine, an agent, a router
and the embedded control plane are killed in turn and started again while ~100 requests per second
go over two routers (clients as behind a load balancer: readiness-gated, a refused connection tried
on the other router). No request fails for an engine, agent or control-plane kill; a router kill
fails only what was in flight on it. The control-plane replicas over Redis: test_replica_chaos.py.
(A longer run: `kvroute bench kill`.)"""

from __future__ import annotations

import json

from kvroute.tools.bench.kill import format_table, run_kill


def test_kill9_each_process_kind_under_load(tmp_path) -> None:
    result = run_kill(rate=100.0, phase_s=4.0, down_s=1.5, workdir=tmp_path)
    print(format_table(result))
    print(json.dumps(result))
    by_kind = {f["kind"]: f for f in result["faults"]}
    assert result["baseline_failed"] == 0
    for kind in ("engine", "agent", "control_plane"):
        assert by_kind[kind]["failed"] == 0, (kind, by_kind[kind]["errors"])
        assert by_kind[kind]["requests"] > 100  # the load went on through the fault
    router = by_kind["router"]
    assert router["failed"] <= router["inflight_on_killed"], router
    for log in sorted(tmp_path.glob("*.log")):  # the survivors took every fault without a traceback
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "never retrieved" not in text, f"{log.name}:\n{text[-3000:]}"
