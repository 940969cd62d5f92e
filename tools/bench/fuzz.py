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
import random
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

# name -> (module, its function run_fuzz(messages, seed, workdir) -> FuzzReport, what it attacks)
TARGETS: dict[str, tuple[str, str, str]] = {
    "agent-zmq": (
        "kvroute.tools.bench.fuzz_agent",
        "run_fuzz",
        (
            "a worker agent's KV-event socket (ZMQ SUB) and its replay requests, as a hostile engine: malformed, random "
            "and oversize messages between valid batches"
        ),
    ),
    "router-http": (
        "kvroute.tools.bench.fuzz_router",
        "run_fuzz_http",
        (
            "a router's OpenAI HTTP API: bodies that are not JSON, wrong types, lone surrogates, huge numbers, deep "
            "nesting, oversize bodies, bad paths and headers, random and mutated bodies, between valid requests"
        ),
    ),
    "router-grpc": (
        "kvroute.tools.bench.fuzz_router",
        "run_fuzz_grpc",
        (
            "a router's gRPC Router API: bytes that do not parse, invalid UTF-8, semantically bad, random and mutated "
            "requests, between valid Route calls (some reserving)"
        ),
    ),
    "control-plane": (
        "kvroute.tools.bench.fuzz_control_plane",
        "run_fuzz",
        (
            "the control plane's gRPC port: bytes that do not parse, bad registrations, batches and queries, random "
            "messages on every method and stream, between a valid agent's batches"
        ),
    ),
}
TARGETS["agent"] = TARGETS["agent-zmq"]  # its first name


@dataclass
class FuzzReport:
    target: str
    messages: int  # every message sent: bad + valid
    bad_messages: int  # malformed, random or oversize messages among them
    valid_messages: int
    valid_events: int  # events inside the valid messages that the target must apply
    applied: bool  # every valid event's effect is visible where it should be
    bad_counted: dict[str, int]  # the target's own counters for bad input, by name
    bad_expected: dict[str, int]  # what they should be, from what was sent
    crashes: int  # target processes that exited
    health_ms: float  # the target's health answer after the run
    seconds: float
    details: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    hangs: int = 0  # inputs the target did not answer in time

    @property
    def ok(self) -> bool:
        return not self.problems


def check(report: FuzzReport) -> FuzzReport:
    """The verdict every target shares: alive, answering within 1 s, everything applied, every bad message counted."""
    if report.crashes:
        report.problems.append(f"{report.crashes} process(es) exited")
    if report.hangs:
        report.problems.append(f"{report.hangs} input(s) not answered in time")
    if not report.health_ms < 1000:
        report.problems.append(f"health answered in {report.health_ms:.0f} ms (limit 1000)")
    if not report.applied:
        report.problems.append("not every valid event was applied")
    for name, want in report.bad_expected.items():
        if report.bad_counted.get(name) != want:
            report.problems.append(f"counter {name}: {report.bad_counted.get(name)} counted, {want} expected")
    return report


@dataclass
class Outcomes:
    """What a request/response target saw, per kind of input: how many were sent, how many were answered
    as that kind must be, and what came back. Becomes a FuzzReport whose counters are those two counts
    ("counted" = answered as expected, "expected" = sent); kinds named valid* are the valid traffic."""

    sent: Counter = field(default_factory=Counter)
    as_expected: Counter = field(default_factory=Counter)
    answers: dict[str, Counter] = field(default_factory=dict)
    expect: dict[str, str] = field(default_factory=dict)
    hangs: int = 0
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # the first few inputs answered wrongly

    def add(
        self, kind: str, expect: str, got: str, ok: bool, hang: bool = False, seconds: float = 0.0, example: str | None = None
    ) -> None:
        self.sent[kind] += 1
        self.as_expected[kind] += ok
        self.answers.setdefault(kind, Counter())[got] += 1
        self.expect[kind] = expect
        self.hangs += hang
        self.slowest_s = max(self.slowest_s, seconds)
        if not ok and example is not None and len(self.failures) < 20:
            self.failures.append(example)

    def report(self, target: str, *, applied: bool, crashes: int, health_ms: float, seconds: float, details: dict) -> FuzzReport:
        valid_kinds = [kind for kind in self.sent if kind.startswith("valid")]
        valid = sum(self.sent[kind] for kind in valid_kinds)
        total = sum(self.sent.values())
        return FuzzReport(
            target=target,
            messages=total,
            bad_messages=total - valid,
            valid_messages=valid,
            valid_events=valid,
            applied=applied and all(self.as_expected[kind] == self.sent[kind] for kind in valid_kinds),
            bad_counted=dict(self.as_expected),
            bad_expected=dict(self.sent),
            crashes=crashes,
            health_ms=health_ms,
            seconds=seconds,
            hangs=self.hangs,
            details={
                **details,
                "slowest_answer_s": round(self.slowest_s, 3),
                "answers": {kind: {"expected": self.expect[kind], **dict(c)} for kind, c in self.answers.items()},
                "failures": self.failures,
            },
        )


def unparseable_bytes(rng: random.Random, message_class) -> bytes:
    """Bytes protobuf refuses to parse as `message_class`: random, a length past the end, a field number 0,
    a wire type that does not exist, or a string that is not UTF-8."""
    shape = rng.randrange(4)
    if shape == 0:
        data = rng.randbytes(rng.randrange(1, 64)) + b"\x0f"  # then field 1 of wire type 7 (none such)
    elif shape == 1:
        data = b"\x0a" + bytes([rng.randrange(2, 127)]) + rng.randbytes(1)  # field 1, longer than what follows
    elif shape == 2:
        data = b"\x00" + rng.randbytes(rng.randrange(8))  # field number 0
    else:
        strings = [f for f in message_class.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
        number = rng.choice(strings).number if strings else 1
        bad = rng.choice((b"\xed\xa0\x80", b"\xff", b"\xc3", b"a\x80b", b"\xf8\x88\x80\x80\x80"))
        data = bytes([number << 3 | 2, len(bad)]) + bad
    try:
        message_class.FromString(data)
    except Exception:  # noqa: BLE001 - DecodeError; what else protobuf raises is as good
        return data
    return data + b"\x0f"


def run_target(target: str, messages: int, seed: int = 0, workdir: Path | None = None) -> FuzzReport:
    module, function, _ = TARGETS[target]
    run_fuzz = getattr(importlib.import_module(module), function)
    if workdir is not None:
        return check(run_fuzz(messages, seed, workdir))
    with tempfile.TemporaryDirectory(prefix=f"kvroute-fuzz-{target}-") as tmp:
        return check(run_fuzz(messages, seed, Path(tmp)))


def add_arguments(p) -> None:
    p.add_argument(
        "--target",
        choices=sorted(TARGETS),
        default="agent-zmq",
        help="; ".join(f"{name}: {desc}" for name, (*_, desc) in sorted(TARGETS.items()) if name != "agent")
        + " (agent: the same as agent-zmq)",
    )
    p.add_argument(
        "--messages",
        type=int,
        default=10_000,
        help="bad inputs to send (valid traffic, about one per four bad inputs, comes on top)",
    )
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
        print(
            f"target {report.target}: {report.messages} messages ({report.bad_messages} bad, {report.valid_messages} "
            f"valid with {report.valid_events} events) in {report.seconds:.1f} s"
        )
        width = max([22, *map(len, report.bad_expected)])
        print(f"{'counter':>{width}}  {'counted':>8}  {'expected':>8}")
        for name in sorted(report.bad_expected):
            print(f"{name:>{width}}  {report.bad_counted.get(name, 0):>8}  {report.bad_expected[name]:>8}")
        print(
            f"valid events applied: {'all' if report.applied else 'NOT ALL'}; crashes: {report.crashes}; "
            f"hangs: {report.hangs}; health after the run: {report.health_ms:.1f} ms"
        )
        for problem in report.problems:
            print(f"problem: {problem}")
    print(json.dumps(result))
    return 0 if report.ok else 1
