"""`kvroute control-plane`."""

from __future__ import annotations

import argparse
import logging

from kvroute import aio
from kvroute.telemetry import setup_tracing, shutdown_tracing


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="gRPC address agents and routers connect to")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="drop a worker (and its blocks) after this long without a message from its agent")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics listener")
    p.add_argument("--log-level", default="INFO", help="Python logging level")


def run(args: argparse.Namespace) -> int:
    from control_plane.server import ControlPlaneConfig, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("kvroute-control-plane")
    try:
        return aio.run(serve(ControlPlaneConfig(listen=args.listen, heartbeat_timeout_s=args.heartbeat_timeout,
                                                metrics_host=args.metrics_host, metrics_port=args.metrics_port)))
    finally:
        shutdown_tracing()
