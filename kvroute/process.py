"""What every kvroute process sets up around its work, the one way each `cli.py` does it:

    def add_arguments(p):
        ...
        add_log_level_argument(p)                 # --log-level, checked at parse time
        add_port_file_argument(p)                 # --port-file: where the bound ports go once listening

    def run(args):
        with process_setup("kvroute-router", args.log_level):  # logging, then tracing; tracing flushed at exit
            return run_service("router", serve(args))

    async def serve(args):
        ...                                       # listen (port 0 = any free port), then
        write_port_file(args.port_file, {"http": http_port})
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
from collections.abc import Callable, Iterator
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


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", type=log_level, default="INFO", help="Python logging level")


def add_port_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port-file", default="", metavar="PATH",
                        help="once listening, write the bound ports there as JSON (e.g. {\"http\": 8000}): what a "
                             "supervisor reads after starting the process with port 0")


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


async def wait_for_stop_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    on_stop_signal(stop.set)
    await stop.wait()
