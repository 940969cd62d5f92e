"""What every kvroute process sets up around its work, the one way each `cli.py` does it:

    def add_arguments(p):
        ...
        add_log_level_argument(p)                 # --log-level, checked at parse time
        add_port_file_argument(p)                 # --port-file: where the bound ports go once listening
        p.add_argument("--workers", type=name_list(KNOWN, "worker"))  # NAME,NAME: checked when parsed

    def run(args):
        with process_setup("kvroute-router", args.log_level):  # logging, then tracing; tracing flushed at exit
            return run_service("router", serve(args))

    async def serve(args):
        ...                                       # listen (port 0 = any free port), then
        write_port_file(args.port_file, {"http": http_port})
        log.info("listening on ...")              # then, once: log.info("ready") when /ready would say 200
        ready_task = asyncio.create_task(announce_when_ready(is_ready, lambda: log.info("... ready")))
        await wait_for_stop_signal()              # SIGINT or SIGTERM: stop cleanly

Tracing stays off unless the OTel variables ask for it (`kvroute.telemetry`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from kvroute.telemetry import setup_tracing, shutdown_tracing

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def log_level(value: str) -> str:
    """argparse type: a Python logging level name, any case (a usage error, not a traceback at start-up)."""
    level = value.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"unknown log level {value!r} (DEBUG, INFO, WARNING, ERROR)")
    return level


def name_list(choices: Collection[str] | None, what: str, *, allow_empty: bool = False) -> Callable[[str], str]:
    """argparse type: NAME[,NAME...], each one of `choices` (any name when None), none twice; returns the
    names comma-joined (so the flag keeps its string form). `what` names one entry in messages."""

    def parse(text: str) -> str:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names and not allow_empty:
            raise argparse.ArgumentTypeError(f"no {what} in {text!r}")
        for name in names:
            if choices is not None and name not in choices:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r} (choose from {', '.join(choices)})")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names a {what} twice")
        return ",".join(names)

    parse.__name__ = f"{what} list"
    return parse


def _number(kind: type, holds: Callable[[int | float], bool], wanted: str) -> Callable[[str], int | float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value {text!r}: expected a number {wanted}") from None
        if not holds(value):  # written so that NaN fails too
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def positive(kind: type) -> Callable[[str], int | float]:
    """argparse type: a number > 0 of `kind` (int or float; a usage error, not a traceback at start-up)."""
    return _number(kind, lambda value: value > 0, "> 0")


def non_negative(kind: type) -> Callable[[str], int | float]:
    """argparse type: a number >= 0 of `kind`."""
    return _number(kind, lambda value: value >= 0, ">= 0")


def seconds(allow_zero: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number of seconds, > 0 (>= 0 with `allow_zero`, where 0 usually means off)."""
    wanted = ">= 0 seconds" if allow_zero else "positive seconds"
    parse = _number(
        float, (lambda value: 0 <= value < float("inf")) if allow_zero else (lambda value: 0 < value < float("inf")), wanted
    )
    parse.__name__ = "seconds"  # argparse names the type in its error: "invalid seconds value"
    return parse


def int_list(text: str) -> str:
    """argparse type: N[,N...] of integers, none twice (e.g. seeds); returns them comma-joined."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.lstrip("-").isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers")
    if len(set(map(int, items))) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers")
    return ",".join(items)


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", type=log_level, default="INFO", help="Python logging level")


def add_port_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port-file",
        default="",
        metavar="PATH",
        help='once listening, write the bound ports there as JSON (e.g. {"http": 8000}): what a '
        "supervisor reads after starting the process with port 0",
    )


def write_port_file(path: str, ports: dict[str, int]) -> None:
    """Write `ports` (listener name -> bound port) to `path` ("" = nowhere) whole or not at all: a
    reader polling for the file never sees half of it."""
    if not path:
        return
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(ports, f)
    os.replace(partial, path)


@contextmanager
def process_setup(service_name: str, level: str) -> Iterator[None]:
    """Logging at `level` and tracing as `service_name` (its default OTel service name) for the
    process's life; spans still buffered are flushed when it ends."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    setup_tracing(service_name)
    try:
        yield
    finally:
        shutdown_tracing()


def on_stop_signal(callback: Callable[[], object]) -> None:
    """Call `callback` on SIGINT and SIGTERM (from the running event loop)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback)


async def announce_when_ready(ready: Callable[[], bool], announce: Callable[[], None], interval_s: float = 0.1) -> None:
    """Call `announce()` once, the first time `ready()` holds (checked every `interval_s`): a process
    logs "listening" when it binds and "ready" only when its readiness (GET /ready) says so."""
    while not ready():
        await asyncio.sleep(interval_s)
    announce()


async def wait_for_stop_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    on_stop_signal(stop.set)
    await stop.wait()
