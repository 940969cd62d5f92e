"""Run several policies over one workload, in parallel processes, with one progress line.

Each policy run is independent and seeded, so running them in child processes gives the same
numbers bit for bit as running them one after another. Children come from a fork server, not a
plain fork of the caller: the caller may hold gRPC or tokenizer threads (a test process, a
notebook), and a forked copy of those can crash. The workload is pickled to each child (its token
arrays pickle as raw bytes, about a second for the full Mooncake trace); results come back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from kvroute.tools.simulator.fleet import FleetConfig, PolicyRun, simulate_policy
from kvroute.tools.simulator.workloads import SimWorkloadRequest

ProgressFn = Callable[[dict[str, int]], None]


def default_jobs(policies: int) -> int:
    return max(1, min(policies, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _child(name: str, workload: list[SimWorkloadRequest], config: FleetConfig, conn: Connection) -> None:
    try:
        run = simulate_policy(name, workload, config, progress=lambda done: conn.send(("progress", done)))
        conn.send(("done", run))
    except BaseException as exc:  # noqa: BLE001 - report it, do not leave the parent waiting
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_policies(
    names: list[str], workload: list[SimWorkloadRequest], config: FleetConfig, jobs: int = 1, progress: ProgressFn | None = None
) -> dict[str, PolicyRun]:
    """PolicyRun per policy name, in the order given."""
    done_count = {name: 0 for name in names}
    if jobs <= 1 or len(names) <= 1:
        results = {}
        for name in names:

            def report(done: int, name: str = name) -> None:
                done_count[name] = done
                if progress:
                    progress(done_count)

            results[name] = simulate_policy(name, workload, config, progress=report)
            report(len(workload))
        return results
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    pending = list(names)
    running: dict[Connection, tuple[str, mp.process.BaseProcess]] = {}
    results: dict[str, PolicyRun] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(name, workload, config, child_end), daemon=True)
                proc.start()
                child_end.close()
                running[parent_end] = (name, proc)
            for conn in wait(list(running)):
                name, proc = running[conn]  # type: ignore[index]
                try:
                    kind, payload = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    kind, payload = "error", f"simulation process exited with code {proc.exitcode}"
                if kind == "progress":
                    done_count[name] = payload
                elif kind == "done":
                    results[name] = payload
                    done_count[name] = len(workload)
                else:
                    raise RuntimeError(f"policy {name}: {payload}")
                if kind != "progress":
                    del running[conn]  # type: ignore[arg-type]
                    conn.close()  # type: ignore[union-attr]
                    proc.join()
                if progress:
                    progress(done_count)
    finally:
        for conn, (_, proc) in running.items():
            proc.kill()
            conn.close()
    return {name: results[name] for name in names}


class ProgressLine:
    """One self-overwriting stderr line on a terminal; a plain line per 25% otherwise (CI logs)."""

    def __init__(self, total_per_policy: int, policies: int, stream=None) -> None:
        self.total = max(1, total_per_policy * policies)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_quarter = 0
        self._last_draw = 0.0

    def __call__(self, done_count: dict[str, int]) -> None:
        done = sum(done_count.values())
        frac = min(1.0, done / self.total)
        now = time.monotonic()
        if self.tty:
            if frac < 1.0 and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            bar = "#" * int(frac * 30)
            eta = (now - self.started) * (1 - frac) / frac if frac > 0 else 0.0
            self.stream.write(f"\r  [{bar:<30}] {frac:6.1%}  {now - self.started:5.1f}s elapsed, ~{eta:4.0f}s left ")
            if frac >= 1.0:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 4) > self._last_quarter:
            self._last_quarter = int(frac * 4)
            print(f"  simulated {frac:.0%} ({done}/{self.total} request-runs, {now - self.started:.1f}s)", file=self.stream)
