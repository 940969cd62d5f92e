"""The README's "Running the pieces yourself" block works as written, against live processes.

The block is read out of README.md and run by bash in an empty directory, as a user pasting it
would: `kvroute tiny-model`, a control plane, a sim engine, its agent and a router in the
background, a chat request through the router with curl, the agent's /ready, and `kvroute audit`.
Only its fixed ports are swapped for free ones (other tests and helpers share this machine); then
the README's `kill %1 %2 %3 %4` must stop all four. The log lines the README says tell that the
agent follows its engine are in the agent's log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, process_group_alive, readme_sh_blocks, with_free_ports

README_PORTS = (50051, 50052, 8000, 8080, 5557, 5558, 9400)


@pytest.mark.timeout(180)
def test_running_the_pieces_yourself_works_as_written(tmp_path: Path) -> None:
    block, ports = with_free_ports(readme_sh_blocks("## Running the pieces yourself")[0], README_PORTS)
    prose = (REPO / "README.md").read_text()
    assert "`kill %1 %2 %3 %4` stops the four processes" in prose
    script = tmp_path / "pieces.sh"
    # set -e: a failing curl or audit fails the run; the kill line is the README's own.
    script.write_text("set -e\n" + block + "kill %1 %2 %3 %4\nwait\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(tmp_path.glob("*.log")))
    try:
        assert proc.returncode == 0, f"exit {proc.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{err}\n{logs}"
        lines = out.splitlines()
        assert lines[0].startswith("tiny model in models/tiny-llama"), out
        # One line from curl: the answer, not the 503s it retried through.
        completion = json.loads(lines[1]) if lines[1].startswith("{") else {}
        assert completion.get("object") == "chat.completion" and completion["model"] == "tiny-llama", f"{out}\n{logs}"
        assert completion["choices"][0]["message"]["content"], completion
        assert completion["usage"]["completion_tokens"] == 8, completion
        agent_ready = json.loads(lines[2])  # curl -f: a 503 would have stopped the script
        assert agent_ready["status"] == "ready" and agent_ready["problems"] == [], agent_ready
        assert agent_ready["engine_answering"] is True and agent_ready["event_stream_silent"] is False, agent_ready
        # The log lines the README quotes, on this run's ports.
        agent_log = (tmp_path / "agent.log").read_text()
        for quoted in ("engine http://127.0.0.1:8000 answers (model tiny-llama):\nregistering sim-0",
                       "registered with control plane 127.0.0.1:50051 as sim-0"):
            assert f"`{quoted}`" in prose, quoted
            line = quoted.replace("\n", " ").replace("8000", str(ports[8000])).replace("50051", str(ports[50051]))
            assert line in agent_log, f"{line!r} not in the agent's log:\n{agent_log}"
        audit = json.loads(lines[-1])
        assert audit["audited"] == 1 and audit["divergence"] == 0 and not audit["errors"], audit
        assert audit["workers"][0]["worker_id"] == "sim-0" and audit["workers"][0]["tiers"]["gpu"]["engine"] > 0, audit
        assert {"control-plane.log", "sim-engine.log", "agent.log", "router.log"} <= {p.name for p in tmp_path.iterdir()}
        # The README's kill line stopped every process the block started.
        deadline = time.monotonic() + 10
        while process_group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group_alive(proc.pid), f"processes outlived `kill %1 %2 %3 %4`:\n{logs}"
    finally:
        if process_group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def readme_line(prefix: str) -> str:
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(prefix)]
    assert lines, f"no README line starts with {prefix!r}"
    return lines[0]


def test_the_readme_trace_command_runs_on_the_shipped_trace(tmp_path: Path) -> None:
    trace = REPO / "traces" / "mooncake_conversation_trace.jsonl"
    assert trace.stat().st_size < 300_000  # a slice, not the whole trace
    command = readme_line("kvroute simulate --trace traces/mooncake_conversation_trace.jsonl")
    (tmp_path / "traces").symlink_to(REPO / "traces")  # the command as written, from a clone's root
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["block_size"] == 512 and result["warnings"] == []
    assert result["policies"]["kv_aware"]["hit_rate"] > 2 * result["policies"]["round_robin"]["hit_rate"] > 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"report.md", "ttft_cdf.png", "hit_rate.png"}
