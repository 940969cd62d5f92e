"""Traces across the event path (issue 18, item 3): an agent's batch span and the control plane's
apply span are one trace, the apply a child of the send, over the real Connect stream between
two processes (console exporter; OTEL_TRACES_SAMPLER decides what is sampled)."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.tools.local_cluster import LocalCluster, http_post_json, wait_until


def console_spans(log: Path) -> list[dict]:
    """The spans the console exporter printed into a process's log (one indented JSON object each)."""
    spans, lines = [], []
    for line in log.read_text(errors="replace").splitlines():
        if line == "{":
            lines = [line]
        elif lines:
            lines.append(line)
            if line == "}":
                try:
                    spans.append(json.loads("\n".join(lines)))
                except json.JSONDecodeError:
                    pass
                lines = []
    return spans


def test_control_plane_apply_span_is_a_child_of_the_agents_batch_span(local_fleet, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    cluster: LocalCluster = local_fleet("agent-traces")
    cluster.start_control_plane()
    (engine,) = cluster.start_sim_fleet(1)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(1)
    status, _ = http_post_json(
        engine.url + "/v1/completions", {"model": cluster.model, "prompt": "the cache router worker " * 40, "max_tokens": 2}
    )
    assert status == 200
    agent_log = cluster.workdir / f"agent-{engine.worker_id}.log"
    cp_log = cluster.workdir / "control-plane.log"

    def linked() -> tuple[dict, dict] | None:
        sends = {
            s["context"]["span_id"]: s
            for s in console_spans(agent_log)
            if s["name"] == "kvroute.agent.send_batch"
            and s["attributes"].get("kvroute.events", 0) > 0
            and not s["attributes"].get("kvroute.snapshot")
        }
        for apply in console_spans(cp_log):
            if apply["name"] == "kvroute.cp.apply_batch" and apply.get("parent_id") in sends:
                return sends[apply["parent_id"]], apply
        return None

    send, apply = wait_until(linked, 15, "a batch span in the agent's log with its apply span in the control plane's")
    assert send["context"]["trace_id"] == apply["context"]["trace_id"]
    assert send["attributes"]["kvroute.worker_id"] == engine.worker_id == apply["attributes"]["kvroute.worker_id"]
    assert apply["attributes"]["kvroute.events"] >= 1
    assert send["kind"] == "SpanKind.PRODUCER" and apply["kind"] == "SpanKind.CONSUMER"
