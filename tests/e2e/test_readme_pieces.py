"""The README's "Running the pieces yourself" block works as written, against live processes.

The block is read out of README.md and run by bash in an empty directory, as a user pasting it
would: `kvroute tiny-model`, a control plane, a sim engine, its agent and a router in the
background, a chat request through the router with curl, and `kvroute audit`. Only its fixed
ports are swapped for free ones (other tests and helpers share this machine); then the README's
`kill %1 %2 %3 %4` must stop all four. The DNS discovery block ("Engines without an agent") is run
the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, process_group_alive, readme_sh_blocks, with_free_ports

README_PORTS = (50051, 50052, 8000, 8080, 5557, 5558)


@dataclass
class BlockRun:
    returncode: int
    out: str
    err: str
    logs: str   # the tail of every *.log the block wrote
    pgid: int   # the block's process group: every process it started


def run_block(tmp_path: Path, block: str) -> BlockRun:
    """`block` run by bash in `tmp_path` as a user pasting it would, under `set -e`, then the README's
    `kill %1 %2 %3 %4` and a wait; the processes left (if any) are the caller's to check and end."""
    script = tmp_path / "block.sh"
    script.write_text("set -e\n" + block + "kill %1 %2 %3 %4\nwait\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(tmp_path.glob("*.log")))
    return BlockRun(proc.returncode, out, err, logs, proc.pid)


@contextmanager
def stopped_by_the_kill_line(run: BlockRun) -> Iterator[None]:
    """The checks inside, then: the README's kill line stopped every process the block started (those
    left are killed either way)."""
    try:
        yield
        deadline = time.monotonic() + 10
        while process_group_alive(run.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group_alive(run.pgid), f"processes outlived `kill %1 %2 %3 %4`:\n{run.logs}"
    finally:
        if process_group_alive(run.pgid):
            os.killpg(run.pgid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_running_the_pieces_yourself_works_as_written(tmp_path: Path) -> None:
    block, ports = with_free_ports(readme_sh_blocks("## Running the pieces yourself")[0], README_PORTS)
    prose = (REPO / "README.md").read_text()
    assert "`kill %1 %2 %3 %4` stops the four processes" in prose
    run = run_block(tmp_path, block)
    out, logs = run.out, run.logs
    with stopped_by_the_kill_line(run):
        assert run.returncode == 0, f"exit {run.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{run.err}\n{logs}"
        lines = out.splitlines()
        assert lines[0].startswith("tiny model in models/tiny-llama"), out
        # One line from curl: the answer, not the 503s it retried through.
        completion = json.loads(lines[1]) if lines[1].startswith("{") else {}
        assert completion.get("object") == "chat.completion" and completion["model"] == "tiny-llama", f"{out}\n{logs}"
        assert completion["choices"][0]["message"]["content"], completion
        assert completion["usage"]["completion_tokens"] == 8, completion
        audit = json.loads(lines[-1])
        assert audit["audited"] == 1 and audit["divergence"] == 0 and not audit["errors"], audit
        assert audit["workers"][0]["worker_id"] == "sim-0" and audit["workers"][0]["tiers"]["gpu"]["engine"] > 0, audit
        assert {"control-plane.log", "sim-engine.log", "agent.log", "router.log"} <= {p.name for p in tmp_path.iterdir()}


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


DISCOVERY_PORTS = (8001, 8002, 8053, 8081, 50051)


@pytest.mark.timeout(180)
def test_dns_discovery_works_as_written(tmp_path: Path) -> None:
    """The README's DNS discovery block: two sim engines without agents, `kvroute sim-dns` answering
    SRV records from a file, a router that finds both through it (its --control-plane on a port where
    nothing listens) and four requests that land on both; then its `kill %1 %2 %3 %4` stops all four."""
    block, ports = with_free_ports(readme_sh_blocks("### Engines without an agent: DNS discovery")[0], DISCOVERY_PORTS)
    prose = (REPO / "README.md").read_text()
    assert "Engines found this way are routed on load" in prose and "routed on the index as well" in prose
    assert "`kill %1 %2 %3 %4` stops the four processes" in prose.split("### Engines without an agent")[1]
    run = run_block(tmp_path, block)
    out, logs = run.out, run.logs
    with stopped_by_the_kill_line(run):
        assert run.returncode == 0, f"exit {run.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{run.err}\n{logs}"
        workers = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.lower().startswith("x-kvroute")]
        assert len(workers) == 4, f"{out}\n{logs}"
        assert set(workers) == {f"127.0.0.1:{ports[8001]}", f"127.0.0.1:{ports[8002]}"}, f"{out}\n{logs}"
        assert "_http._tcp.engines.kvroute.test: 2 engines" in (tmp_path / "router.log").read_text(), logs
