"""`kvroute demo` (what `make demo` runs), shortened: it cleans up after itself, measures every
policy at the same time on fleets of its own, and says when other load disturbed the measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvroute.tools.demo import machine_line
from kvroute.tools.disturbance import CpuSnapshot, Disturbance, DisturbanceMonitor, read_snapshot
from kvroute.tools.local_cluster import wait_until

pytestmark = pytest.mark.e2e  # starts kvroute processes

SHORT = (
    "--engines",
    "2",
    "--conversations",
    "6",
    "--turns",
    "2",
    "--system-prompts",
    "2",
    "--system-prompt-words",
    "200",
    "--arrival-rate",
    "20",
    "--think-time",
    "0.05",
)


def run_demo(tmpdir: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmpdir)}  # where its own temporary directory goes
    return subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "demo", *SHORT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_demo_removes_its_temporary_directory_and_keeps_a_given_workdir(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = run_demo(tmpdir)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout.splitlines()[-1])["policies"]) == {"kv_aware", "round_robin"}
    assert list(tmpdir.iterdir()) == [], "the demo left its temporary directory behind"

    workdir = tmp_path / "kept"
    out = run_demo(tmpdir, "--workdir", str(workdir), "--policies", "kv_aware")
    assert out.returncode == 0, out.stderr
    assert (workdir / "kv_aware" / "control-plane.log").exists() and (workdir / "tiny-llama" / "tokenizer.json").exists()
    assert list(tmpdir.iterdir()) == []


def test_the_demo_serves_two_models_behind_each_router(tmp_path: Path) -> None:
    """`--models 2`: each model's requests reach that model's engines only, and hit their caches."""
    out = run_demo(tmp_path, "--models", "2", "--engines", "4", "--policies", "kv_aware")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])["policies"]["kv_aware"]
    assert result["misrouted"] == 0 and result["requests"] == 12, result
    assert set(result["hit_rate_by_model"]) == {"tiny-llama", "tiny-llama-2"}, result
    assert min(result["hit_rate_by_model"].values()) > 0, result  # the second turn reuses the first's prefix
    assert "kv_aware: hit rate by model tiny-llama " in out.stdout


# ---------------------------------------------------------------- disturbance: the detector, then live


def snapshots(
    seconds: int,
    own_cores: float,
    outside_cores: list[float] | float,
    steal_cores: float = 0.0,
    wait_ms_per_s: float = 0.0,
    interval: float = 0.5,
) -> list[CpuSnapshot]:
    """Synthetic /proc readings: our processes use `own_cores`, others `outside_cores` (per interval)."""
    n = int(seconds / interval)
    outside = outside_cores if isinstance(outside_cores, list) else [outside_cores] * n
    out, busy, steal, own, wait = [], 100.0, 1.0, 50.0, 2.0
    for i in range(n + 1):
        out.append(CpuSnapshot(1000 + i * interval, busy, steal, own, {41: wait, 42: wait / 2}))
        if i < n:
            own += own_cores * interval
            busy += (own_cores + outside[i]) * interval
            steal += steal_cores * interval
            wait += wait_ms_per_s / 1000 * interval
    return out


def test_the_detector_stays_quiet_without_outside_load() -> None:
    d = Disturbance.from_snapshots(snapshots(10, own_cores=1.6, outside_cores=0.05, wait_ms_per_s=40), cores=2)
    assert not d.disturbed and d.warning() is None
    assert d.outside_cores_mean == pytest.approx(0.05) and d.seconds == pytest.approx(10)
    assert d.loop_wait_ms_per_s_max == pytest.approx(40) and d.loop_wait_ms_per_s_mean == pytest.approx(30)
    assert "other processes 0.05 of 2 cores" in machine_line(d)


def test_the_detector_fires_on_steady_load_a_burst_or_steal_and_says_how_much() -> None:
    steady = Disturbance.from_snapshots(snapshots(10, own_cores=1.0, outside_cores=1.0, wait_ms_per_s=180), cores=2)
    assert steady.disturbed
    warning = steady.warning()
    assert warning.startswith("measurement disturbed: other processes took 1.00 of this machine's 2 CPU cores")
    assert "waited 135 ms per second for a CPU (worst loop 180)" in warning
    # Two seconds of a full core in a quiet ten: the mean stays low, the worst window does not.
    burst = Disturbance.from_snapshots(snapshots(10, 1.0, [0.0] * 8 + [1.0] * 4 + [0.0] * 8), cores=2)
    assert burst.outside_cores_mean == pytest.approx(0.2) and burst.outside_cores_peak == pytest.approx(1.0)
    assert burst.disturbed and "1.00 at the worst moment" in burst.warning()
    stolen = Disturbance.from_snapshots(snapshots(10, 1.0, 0.0, steal_cores=0.4), cores=2)
    assert stolen.disturbed and "(steal 0.40)" in stolen.warning()
    # Our own processes' CPU is never counted as outside load, however busy they are.
    assert not Disturbance.from_snapshots(snapshots(10, own_cores=2.0, outside_cores=0.0), cores=2).disturbed


def test_without_readings_nothing_is_claimed() -> None:
    assert not Disturbance.from_snapshots(snapshots(10, 1.0, 2.0)[:1], cores=2).disturbed
    monitor = DisturbanceMonitor([], [], read=lambda: (_ for _ in ()).throw(OSError("no /proc")))
    monitor.start()
    d = monitor.stop()
    assert not d.measured and not d.disturbed and "not measured" in machine_line(d)


def test_the_monitor_samples_in_the_background() -> None:
    readings = iter(snapshots(60, own_cores=1.0, outside_cores=1.2, interval=0.5))
    monitor = DisturbanceMonitor([], [], interval_s=0.01, read=lambda: next(readings))
    monitor.start()
    wait_until(lambda: len(monitor.snapshots) >= 5, 10, "five samples taken in the background")
    d = monitor.stop()
    assert d.disturbed and d.outside_cores_mean == pytest.approx(1.2)


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_the_proc_readings_tell_an_outside_hog_from_our_own_processes() -> None:
    hog, mine = hogs(2)
    try:
        time.sleep(0.3)
        first = read_snapshot([os.getpid(), mine.pid], [mine.pid])
        time.sleep(2.0)
        last = read_snapshot([os.getpid(), mine.pid], [mine.pid])
    finally:
        for p in (hog, mine):
            p.kill()
            p.wait()
    seconds = last.at_s - first.at_s
    # Ours: the one hog we own, about a core on an idle machine; a shared CI machine leaves it less, so
    # the claim is only that its CPU is counted as ours at all.
    assert (last.own_cpu_s - first.own_cpu_s) / seconds > 0.1
    d = Disturbance.from_snapshots([first, last], cores=os.cpu_count() or 1)
    assert d.outside_cores_mean > 0.3, d.to_json()  # the other hog, at least
    assert mine.pid in last.loop_wait_s


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_short_demo_beside_a_cpu_hog_says_it_was_disturbed(tmp_path: Path) -> None:
    noise = hogs(2)  # two busy processes on a two-core machine: the demo has to wait for CPU
    try:
        out = run_demo(tmp_path, "--conversations", "12", timeout=200)
    finally:
        for p in noise:
            p.kill()
            p.wait()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    disturbance = result["disturbance"]
    assert disturbance["disturbed"] and disturbance["outside_cores_mean"] >= 0.5, disturbance
    warnings = [line for line in out.stdout.splitlines() if line.startswith("warning: measurement disturbed")]
    assert len(warnings) == 1 and f"took {disturbance['outside_cores_mean']:.2f} of" in warnings[0]
