"""Was a live measurement disturbed? CPU taken by other processes, and how long our event loops waited.

A latency measured on a shared machine includes whatever else ran on it: on a loaded 2-core box
one `make demo` run put kv_aware's TTFT p99 at twice round_robin's. While a measurement runs,
`DisturbanceMonitor` samples (Linux /proc, every `interval_s`):

- the machine's busy CPU time (`/proc/stat`) minus the CPU time of our own processes
  (`/proc/PID/stat`, all their threads): what other processes took, in cores; plus steal time
  (a hypervisor giving our virtual CPUs to someone else);
- for each process whose main thread runs an event loop (routers, engines), how long that thread
  was runnable but waiting for a CPU (`/proc/PID/schedstat`, run-queue delay): the event-loop lag
  that CPU contention adds to every request it handles.

A measurement counts as disturbed when others and steal together took at least
`MEAN_OUTSIDE_CORES` on average or `PEAK_OUTSIDE_CORES` in the worst window; the wait figure
says how much it cost. On a machine without /proc nothing is measured and nothing is claimed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

MEAN_OUTSIDE_CORES = 0.25  # averaged over the measurement
PEAK_OUTSIDE_CORES = 0.75  # in the worst window of `WINDOW_SAMPLES` intervals
WINDOW_SAMPLES = 2

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    at_s: float  # monotonic
    machine_busy_s: float  # every CPU's non-idle time, steal excluded (it is counted apart)
    steal_s: float
    own_cpu_s: float  # our processes' user + system time, all threads
    loop_wait_s: dict[int, float] = field(default_factory=dict)  # pid -> its main thread's run-queue wait


def _machine_times(proc: Path) -> tuple[float, float]:
    """(busy, steal) seconds over all CPUs from the first line of /proc/stat."""
    fields = (proc / "stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(v) for v in fields] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq) * _TICK_S, steal * _TICK_S


def process_cpu_s(pid: int, proc: Path = Path("/proc")) -> float:
    """utime + stime of every thread of `pid` (0 if it is gone)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    after_name = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    return (int(after_name[11]) + int(after_name[12])) * _TICK_S  # fields 14 and 15 of proc(5)


def _run_queue_wait_s(proc: Path, pid: int) -> float | None:
    """How long the main thread of `pid` has waited on a run queue, or None if unknown."""
    try:
        return int((proc / str(pid) / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def read_snapshot(own_pids: Iterable[int], loop_pids: Iterable[int], proc: Path = Path("/proc")) -> CpuSnapshot:
    busy, steal = _machine_times(proc)
    own = sum(process_cpu_s(pid, proc) for pid in set(own_pids))
    waits = {pid: w for pid in loop_pids if (w := _run_queue_wait_s(proc, pid)) is not None}
    return CpuSnapshot(time.monotonic(), busy, steal, own, waits)


@dataclass(frozen=True, slots=True)
class Disturbance:
    """What happened on the machine during a measurement, from a series of snapshots."""

    seconds: float
    cores: int
    outside_cores_mean: float  # other processes' CPU + steal, averaged over the measurement
    outside_cores_peak: float  # ... in the worst window
    steal_cores_mean: float
    loop_wait_ms_per_s_mean: float  # event-loop run-queue wait, per second, averaged over the watched loops
    loop_wait_ms_per_s_max: float  # ... of the worst loop
    measured: bool = True

    @property
    def disturbed(self) -> bool:
        return self.measured and (self.outside_cores_mean >= MEAN_OUTSIDE_CORES or self.outside_cores_peak >= PEAK_OUTSIDE_CORES)

    @classmethod
    def unmeasured(cls) -> Disturbance:
        return cls(0.0, os.cpu_count() or 1, 0.0, 0.0, 0.0, 0.0, 0.0, measured=False)

    @classmethod
    def from_snapshots(cls, snapshots: list[CpuSnapshot], cores: int) -> Disturbance:
        if len(snapshots) < 2 or snapshots[-1].at_s <= snapshots[0].at_s:
            return cls.unmeasured()
        first, last = snapshots[0], snapshots[-1]
        seconds = last.at_s - first.at_s

        def outside(a: CpuSnapshot, b: CpuSnapshot) -> float:
            others = max(0.0, (b.machine_busy_s - a.machine_busy_s) - (b.own_cpu_s - a.own_cpu_s))
            return (others + b.steal_s - a.steal_s) / (b.at_s - a.at_s)

        windows = [outside(a, b) for a, b in zip(snapshots, snapshots[WINDOW_SAMPLES:], strict=False)]
        waits = [
            (last.loop_wait_s[pid] - first.loop_wait_s[pid]) / seconds * 1000
            for pid in first.loop_wait_s.keys() & last.loop_wait_s.keys()
        ]
        return cls(
            seconds,
            cores,
            outside(first, last),
            max(windows, default=outside(first, last)),
            (last.steal_s - first.steal_s) / seconds,
            sum(waits) / len(waits) if waits else 0.0,
            max(waits, default=0.0),
        )

    def warning(self, loops: str = "the watched processes' event loops") -> str | None:
        """One line saying what disturbed the measurement and what it cost (`loops` names the watched
        processes' event loops), or None."""
        if not self.disturbed:
            return None
        steal = f" (steal {self.steal_cores_mean:.2f})" if self.steal_cores_mean >= 0.05 else ""
        return (
            f"measurement disturbed: other processes took {self.outside_cores_mean:.2f} of this machine's "
            f"{self.cores} CPU cores on average{steal} and {self.outside_cores_peak:.2f} at the worst moment, "
            f"and {loops} waited {self.loop_wait_ms_per_s_mean:.0f} ms per second "
            f"for a CPU (worst loop {self.loop_wait_ms_per_s_max:.0f}): latencies include that wait; rerun on "
            "an idle machine for figures to quote"
        )

    def to_json(self) -> dict:
        return {
            "measured": self.measured,
            "disturbed": self.disturbed,
            "seconds": round(self.seconds, 2),
            "cores": self.cores,
            "outside_cores_mean": round(self.outside_cores_mean, 3),
            "outside_cores_peak": round(self.outside_cores_peak, 3),
            "steal_cores_mean": round(self.steal_cores_mean, 3),
            "loop_wait_ms_per_s_mean": round(self.loop_wait_ms_per_s_mean, 1),
            "loop_wait_ms_per_s_max": round(self.loop_wait_ms_per_s_max, 1),
        }


class DisturbanceMonitor:
    """Samples snapshots in a thread between `start()` and `stop()`; `stop()` returns the Disturbance."""

    def __init__(
        self,
        own_pids: Iterable[int],
        loop_pids: Iterable[int],
        interval_s: float = 0.5,
        read: Callable[[], CpuSnapshot] | None = None,
    ) -> None:
        own, loops = set(own_pids), list(loop_pids)
        self._read = read or (lambda: read_snapshot(own, loops))
        self.interval_s = interval_s
        self.snapshots: list[CpuSnapshot] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        try:
            self.snapshots.append(self._read())
        except (OSError, ValueError):  # no /proc (not Linux): the result says "not measured"
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="kvroute-disturbance", daemon=True)
        self._thread.start()

    def stop(self) -> Disturbance:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return Disturbance.from_snapshots(self.snapshots, os.cpu_count() or 1)
