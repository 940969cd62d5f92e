"""The benches' helper processes (`synthetic_agents.py`, `follower.py`) as `ManagedProcess`es that say
when they are ready and what they saw through JSON files.

    agents = start_agents(workdir, "agents", address, "--workers", "8", "--rate", "10000", "--wait-signal")
    ready = agents.wait_ready(60)         # the JSON its --ready-file got
    agents.signal(signal.SIGUSR1)         # e.g. start the events
    report = agents.finish()              # SIGTERM, then the JSON its --report-file got
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvroute.tools.local_cluster import ManagedProcess, wait_until


@dataclass
class ChildProcess:
    process: ManagedProcess
    ready_file: Path
    report_file: Path

    def start(self, taskset: str = "") -> ChildProcess:
        """Start it (on the CPUs of `taskset`, e.g. "1", when given)."""
        self.process.start()
        if taskset and self.process.popen is not None:
            pin(self.process.popen.pid, taskset)
        return self

    @property
    def pid(self) -> int:
        return pid_of_managed(self.process)

    def wait_ready(self, timeout_s: float) -> dict:
        return wait_until(lambda: _read(self.ready_file), timeout_s, f"{self.process.name} ready", [self.process], interval=0.01)

    def signal(self, sig: int) -> None:
        assert self.process.popen is not None
        self.process.popen.send_signal(sig)

    def finish(self, timeout_s: float = 60.0) -> dict:
        """Stop it (SIGTERM) and return its report."""
        self.process.stop(timeout=timeout_s)
        report = _read(self.report_file)
        if report is None:
            raise RuntimeError(f"{self.process.name} wrote no report:\n{self.process.log_tail()}")
        return report


def pid_of_managed(process: ManagedProcess) -> int:
    """The pid of a started process."""
    if process.popen is None:
        raise RuntimeError(f"{process.name} was not started")
    return process.popen.pid


def pin(pid: int, cpus: str) -> None:
    """Run process `pid` on the CPUs `cpus` names ("1", "0,1"), as `taskset -a -p` would: every thread it
    has now (gRPC's, tokio's...) and, through them, the ones they start later."""
    cores = {int(c) for c in cpus.split(",")}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _child(module: str, workdir: Path, name: str, args: tuple[str, ...]) -> ChildProcess:
    ready, report = workdir / f"{name}.ready.json", workdir / f"{name}.report.json"
    for path in (ready, report):
        path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", module, *args, "--ready-file", str(ready), "--report-file", str(report)]
    return ChildProcess(ManagedProcess(name, argv, workdir / f"{name}.log"), ready, report)


def start_agents(workdir: Path, name: str, control_plane: str, *args: str, taskset: str = "") -> ChildProcess:
    """`kvroute.tools.bench.synthetic_agents` against `control_plane`, with its own flags `args`."""
    return _child("kvroute.tools.bench.synthetic_agents", workdir, name, ("--control-plane", control_plane, *args)).start(taskset)


def start_follower(workdir: Path, name: str, control_plane: str, *args: str, taskset: str = "") -> ChildProcess:
    """`kvroute.tools.bench.follower` following `control_plane`, with its own flags `args`."""
    return _child("kvroute.tools.bench.follower", workdir, name, ("--control-plane", control_plane, *args)).start(taskset)
