"""The README's "Running the pieces yourself" block works as written, against live processes, and so do
the blocks of docs/operations.md that build on it.

The block is read out of README.md and run by bash in an empty directory, as a user pasting it
would: `kvroute tiny-model`, a control plane, a sim engine, its agent and a router in the
background, a chat request through the router with curl, the agent's /ready, and `kvroute audit`.
Only its fixed ports are swapped for free ones (other tests and helpers share this machine); then
the README's `kill %1 %2 %3 %4` must stop all four. The log lines the README says tell that the
agent follows its engine are in the agent's log. docs/operations.md's DNS discovery block ("Engines
without an agent") is run the same way, and its high-availability block after the README block's
`kvroute tiny-model` / `kvroute sim-engine` lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, doc_commands, doc_env, doc_sh_blocks, process_group_alive, with_free_ports

README_PORTS = (50051, 50052, 8000, 8080, 5557, 5558, 9400)
OPERATIONS = REPO / "docs" / "operations.md"


@dataclass
class BlockRun:
    returncode: int
    out: str
    err: str
    logs: str  # the tail of every *.log the block wrote
    pgid: int  # the block's process group: every process it started


def kill_line(jobs: int) -> str:
    """The documented line that stops a block's `jobs` background processes: `kill %1 %2 ...`."""
    return "kill " + " ".join(f"%{job}" for job in range(1, jobs + 1))


def run_block(tmp_path: Path, block: str, jobs: int = 4) -> BlockRun:
    """`block` run by bash in `tmp_path` as a user pasting it would, under `set -e`, then the documented
    kill line (`kill %1 %2 %3 %4` for four background jobs) and a wait; the processes left (if any)
    are the caller's to check and end."""
    script = tmp_path / "block.sh"
    script.write_text("set -e\n" + block + kill_line(jobs) + "\nwait\n")
    env = doc_env()
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(tmp_path.glob("*.log")))
    return BlockRun(proc.returncode, out, err, logs, proc.pid)


@contextmanager
def stopped_by_the_kill_line(run: BlockRun) -> Iterator[None]:
    """The checks inside, then: the documented kill line stopped every process the block started (those
    left are killed either way)."""
    try:
        yield
        deadline = time.monotonic() + 10
        while process_group_alive(run.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group_alive(run.pgid), f"processes outlived the README's kill line:\n{run.logs}"
    finally:
        if process_group_alive(run.pgid):
            os.killpg(run.pgid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_running_the_pieces_yourself_works_as_written(tmp_path: Path) -> None:
    block, ports = with_free_ports(doc_sh_blocks("README.md", "## Running the pieces yourself")[0], README_PORTS)
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
        agent_ready = json.loads(lines[2])  # curl -f: a 503 would have stopped the script
        assert agent_ready["status"] == "ready" and agent_ready["problems"] == [], agent_ready
        assert agent_ready["engine_answering"] is True and agent_ready["event_stream_silent"] is False, agent_ready
        # The log lines the README quotes, on this run's ports.
        agent_log = (tmp_path / "agent.log").read_text()
        for quoted in (
            "engine http://127.0.0.1:8000 answers (model tiny-llama):\nregistering sim-0",
            "registered with control plane 127.0.0.1:50051 as sim-0",
        ):
            assert f"`{quoted}`" in prose, quoted
            line = quoted.replace("\n", " ").replace("8000", str(ports[8000])).replace("50051", str(ports[50051]))
            assert line in agent_log, f"{line!r} not in the agent's log:\n{agent_log}"
        audit = json.loads(lines[-1])
        assert audit["audited"] == 1 and audit["divergence"] == 0 and not audit["errors"], audit
        assert audit["workers"][0]["worker_id"] == "sim-0" and audit["workers"][0]["tiers"]["gpu"]["engine"] > 0, audit
        assert {"control-plane.log", "sim-engine.log", "agent.log", "router.log"} <= {p.name for p in tmp_path.iterdir()}


def operations_line(prefix: str) -> str:
    lines = [line for line in OPERATIONS.read_text().splitlines() if line.startswith(prefix)]
    assert lines, f"no line of docs/operations.md starts with {prefix!r}"
    return lines[0]


def test_the_documented_trace_command_runs_on_the_shipped_trace(tmp_path: Path) -> None:
    trace = REPO / "traces" / "mooncake_conversation_trace.jsonl"
    assert trace.stat().st_size < 300_000  # a slice, not the whole trace
    command = operations_line("kvroute simulate --trace traces/mooncake_conversation_trace.jsonl")
    (tmp_path / "traces").symlink_to(REPO / "traces")  # the command as written, from a clone's root
    env = doc_env()
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["block_size"] == 512 and result["warnings"] == []
    assert result["policies"]["kv_aware"]["hit_rate"] > 2 * result["policies"]["round_robin"]["hit_rate"] > 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"report.md", "ttft_cdf.png", "hit_rate.png"}


HA_PORTS = (6380, 15050, 15051, 15052, 15060, 15061, 15062, 8080, 15080, 8000, 5557, 5558)


@pytest.mark.timeout(240)
def test_the_high_availability_block_works_as_written(tmp_path: Path) -> None:
    """Three replicas over one Redis, an agent and a router: the block waits for each to be ready before
    its audit, after the `kvroute tiny-model` / `kvroute sim-engine` lines of "Running the pieces yourself"."""
    assert shutil.which("redis-server") and shutil.which("redis-cli"), "the replica tests need redis-server"
    pieces = doc_commands(
        doc_sh_blocks("README.md", "## Running the pieces yourself")[0], "kvroute tiny-model", "kvroute sim-engine"
    )
    ha = doc_sh_blocks("docs/operations.md", "## High availability: control-plane replicas over Redis")[0]
    assert all(port < 32768 for port in map(int, re.findall(r":(\d+)\b", ha))), "a port in the ephemeral range"
    block, ports = with_free_ports(pieces + ha, HA_PORTS)
    script = tmp_path / "ha.sh"
    script.write_text("set -e\n" + block)
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=doc_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = proc.communicate(timeout=200)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(tmp_path.glob("*.log")))
        assert proc.returncode == 0, f"exit {proc.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{err}\n{logs}"
        lines = out.splitlines()
        assert lines[0].startswith("tiny model in models/tiny-llama"), out
        replicas = [json.loads(line) for line in lines[1:4]]
        assert [r["status"] for r in replicas] == ["ready"] * 3, out
        router = json.loads(lines[4])
        assert router["status"] in ("ready", "degraded") and router["workers"] == 1, out
        audit = json.loads(lines[-1])
        assert audit["audited"] == 1 and audit["divergence"] == 0 and not audit["errors"], f"{audit}\n{logs}"
        router_log = (tmp_path / "router.log").read_text()
        assert router_log.index("router listening") < router_log.index("router ready: 1 of 1 workers"), router_log
    finally:
        subprocess.run(
            ["redis-cli", "-p", str(ports[6380]), "shutdown", "nosave"], capture_output=True, timeout=10, check=False
        )  # daemonized: not in the script's process group
        if process_group_alive(proc.pid):  # the block's background processes outlive the script
            os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while process_group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if process_group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)


DISCOVERY_PORTS = (8001, 8002, 8053, 8081, 50051)


@pytest.mark.timeout(180)
def test_dns_discovery_works_as_written(tmp_path: Path) -> None:
    """docs/operations.md's DNS discovery block: two sim engines without agents, `kvroute sim-dns` answering
    SRV records from a file, a router that finds both through it (its --control-plane on a port where
    nothing listens) and four requests that land on both; then its `kill %1 %2 %3 %4` stops all four."""
    block, ports = with_free_ports(
        doc_sh_blocks("docs/operations.md", "## Engines without an agent: DNS discovery")[0], DISCOVERY_PORTS
    )
    prose = OPERATIONS.read_text()
    assert "Engines found this way are routed on load" in prose and "routed on the index as well" in prose
    assert "`kill %1 %2 %3 %4` stops the four processes" in prose.split("## Engines without an agent")[1]
    run = run_block(tmp_path, block)
    out, logs = run.out, run.logs
    with stopped_by_the_kill_line(run):
        assert run.returncode == 0, f"exit {run.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{run.err}\n{logs}"
        workers = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.lower().startswith("x-kvroute")]
        assert len(workers) == 4, f"{out}\n{logs}"
        assert set(workers) == {f"127.0.0.1:{ports[8001]}", f"127.0.0.1:{ports[8002]}"}, f"{out}\n{logs}"
        assert "_http._tcp.engines.kvroute.test: 2 engines" in (tmp_path / "router.log").read_text(), logs


PD_PORTS = (50061, 8100, 8200, 5567, 5568, 5577, 5578, 8090)


@pytest.mark.timeout(180)
def test_the_pd_fleet_block_works_as_written(tmp_path: Path) -> None:
    block, ports = with_free_ports(doc_sh_blocks("docs/operations.md", "## Prefill/decode disaggregation")[0], PD_PORTS)
    prose = (REPO / "docs" / "operations.md").read_text()
    assert f"`{kill_line(6)}` stops the six processes" in prose
    run = run_block(tmp_path, block, jobs=6)
    with stopped_by_the_kill_line(run):
        assert run.returncode == 0, f"exit {run.returncode} (ports {ports})\nstdout:\n{run.out}\nstderr:\n{run.err}\n{run.logs}"
        lines = run.out.splitlines()
        completion = json.loads(lines[1])
        assert completion["object"] == "chat.completion" and completion["usage"]["completion_tokens"] == 8, run.out
        headers = {
            name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines[2:] if ":" in line)
        }
        for name, value in (("x-kvroute-prefill-worker", "prefill-0"), ("x-kvroute-worker", "decode-0")):
            assert f"`{name}: {value}`" in prose and headers.get(name) == value, (name, run.out)
        # The decode engine got the prefill engine's transfer parameters: its KV came from there.
        answered = (tmp_path / "headers.txt").read_text().strip().split("\r\n\r\n")[-1]  # after any retried 503s
        transfer = [line for line in answered.splitlines() if line.lower().startswith("x-sim-kv-transfer:")]
        assert transfer and f"from=sim-127.0.0.1:{ports[8100]};" in transfer[0], answered


MANY_MODELS_PORTS = (50051, 8000, 8001, 8080, 5557, 5558, 5559, 5560)


@pytest.mark.timeout(180)
def test_many_models_behind_one_router_works_as_written(tmp_path: Path) -> None:
    """Two models, a sim engine and an agent each, one router: each model's requests reach its own
    engine, /v1/models lists both, an unknown model is OpenAI's 404; the kill line stops all six."""
    pieces = doc_commands(doc_sh_blocks("README.md", "## Running the pieces yourself")[0], "kvroute tiny-model")
    block, ports = with_free_ports(
        pieces + doc_sh_blocks("docs/operations.md", "## Many models behind one router")[0], MANY_MODELS_PORTS
    )
    prose = (REPO / "docs" / "operations.md").read_text().split("## Many models behind one router")[1]
    assert f"`{kill_line(6)}` stops the six processes" in prose
    run = run_block(tmp_path, block, jobs=6)
    out, logs = run.out, run.logs
    with stopped_by_the_kill_line(run):
        assert run.returncode == 0, f"exit {run.returncode} (ports {ports})\nstdout:\n{out}\nstderr:\n{run.err}\n{logs}"
        lines = out.splitlines()
        assert lines[0].startswith("tiny model in models/tiny-llama"), out
        assert lines[1].startswith("tiny model in models/tiny-chat"), out
        workers = [line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("x-kvroute-worker")]
        assert workers == ["llama-0", "chat-0", "llama-0", "chat-0"], f"{out}\n{logs}"
        models = json.loads(lines[-2])
        assert [m["id"] for m in models["data"]] == ["tiny-llama", "tiny-chat"], models
        assert json.loads(lines[-1]) == {
            "error": {
                "message": "The model `gpt-4o` does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }
        }, lines[-1]
        assert 'gets a 404,\nOpenAI\'s own answer word for word: ``{"error": {"message": "The model `gpt-4o`' in prose
