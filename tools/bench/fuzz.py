"""`kvroute bench fuzz --target TARGET --messages N`: hostile input at a LIVE process's socket,
interleaved with valid traffic, then checks that the process is alive, answers within 1 s, applied
every valid message and counted the bad ones.

Targets plug in through `TARGETS`: a name, a one-line description and the module holding its
`run_fuzz(messages, seed, workdir) -> FuzzReport`. A target starts the processes it needs, drives
them and reports in the shared shape below, so the table, the JSON and the verdict are the same for
every target.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

# name -> (module with run_fuzz, what it attacks)
TARGETS: dict[str, tuple[str, str]] = {
    "agent": ("kvroute.tools.bench.fuzz_agent", ("a worker agent's KV-event socket (ZMQ SUB) and its replay requests, as a hostile "
                                  "engine: malformed, random and oversize messages between valid batches")),
}


@dataclass
class FuzzReport:
    target: str
    messages: int                 # every message sent: bad + valid
    bad_messages: int             # malformed, random or oversize messages among them
    valid_messages: int
    valid_events: int             # events inside the valid messages that the target must apply
    applied: bool                 # every valid event's effect is visible where it should be
    bad_counted: dict[str, int]   # the target's own counters for bad input, by name
    bad_expected: dict[str, int]  # what they should be, from what was sent
    crashes: int                  # target processes that exited
    health_ms: float              # the target's health answer after the run
    seconds: float
    details: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(report: FuzzReport) -> FuzzReport:
    """The verdict every target shares: alive, answering within 1 s, everything applied, every bad message counted."""
    if report.crashes:
        report.problems.append(f"{report.crashes} process(es) exited")
    if not report.health_ms < 1000:
        report.problems.append(f"health answered in {report.health_ms:.0f} ms (limit 1000)")
    if not report.applied:
        report.problems.append("not every valid event was applied")
    for name, want in report.bad_expected.items():
        if report.bad_counted.get(name) != want:
            report.problems.append(f"counter {name}: {report.bad_counted.get(name)} counted, {want} expected")
    return report


def run_target(target: str, messages: int, seed: int = 0, workdir: Path | None = None) -> FuzzReport:
    module = importlib.import_module(TARGETS[target][0])
    if workdir is not None:
        return check(module.run_fuzz(messages, seed, workdir))
    with tempfile.TemporaryDirectory(prefix=f"kvroute-fuzz-{target}-") as tmp:
        return check(module.run_fuzz(messages, seed, Path(tmp)))


def add_arguments(p) -> None:
    p.add_argument("--target", choices=sorted(TARGETS), default="agent",
                   help="; ".join(f"{name}: {desc}" for name, (_, desc) in sorted(TARGETS.items())))
    p.add_argument("--messages", type=int, default=10_000,
                   help="bad messages to send (valid batches, and corrupted copies of some, come on top)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic")
    p.add_argument("--workdir", default="", help="directory for the processes' logs (empty: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")


def run(args) -> int:
    try:
        report = run_target(args.target, args.messages, args.seed, Path(args.workdir) if args.workdir else None)
    except Exception as exc:  # noqa: BLE001 - the target could not even be driven (e.g. it stopped answering)
        print(f"target {args.target}: the run failed: {type(exc).__name__}: {exc}")
        print(json.dumps({"target": args.target, "ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    result = {**asdict(report), "ok": report.ok}
    if not args.json:
        print(f"target {report.target}: {report.messages} messages ({report.bad_messages} bad, {report.valid_messages} "
              f"valid with {report.valid_events} events) in {report.seconds:.1f} s")
        print(f"{'counter':>22}  {'counted':>8}  {'expected':>8}")
        for name in sorted(report.bad_expected):
            print(f"{name:>22}  {report.bad_counted.get(name, 0):>8}  {report.bad_expected[name]:>8}")
        print(f"valid events applied: {'all' if report.applied else 'NOT ALL'}; crashes: {report.crashes}; "
              f"health after the run: {report.health_ms:.1f} ms")
        for problem in report.problems:
            print(f"problem: {problem}")
    print(json.dumps(result))
    return 0 if report.ok else 1
