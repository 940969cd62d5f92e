"""`kvroute epp`: the endpoint picker's process (flags, listeners, readiness); the picker itself is
`epp/picker.py`.

    kvroute epp --tokenizer DIR --control-plane HOST:PORT [--grpc-port 9002] [--metrics-port N]

It takes the router's routing flags (`cli.py`'s, minus ROUTER_ONLY_FLAGS) and builds the same
routing service (`service/routing_service.py`); `--metrics-port` serves the router's /metrics,
/health and /ready.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Collection

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.addresses import port, port_or_off
from kvroute.aio import cancel_and_wait
from kvroute.data_plane.epp.picker import EXT_PROC_SERVICE, EndpointPicker
from kvroute.data_plane.service.routing_service import RoutingService

log = logging.getLogger("kvroute.epp")

# The router's flags the picker does not take: its listeners, and what only a proxying router does
# (HTTP API keys, HTTPS, concurrency, the engine link). It keeps the routing flags and the
# control-plane link's (--tls-*, --grpc-max-message-bytes).
ROUTER_ONLY_FLAGS = frozenset(
    {
        "--port",
        "--grpc-port",
        "--reservation-ttl-ms",
        "--max-reservations",
        "--capture-trace",
        "--capture-block-tokens",
        "--capture-sample-rate",
        "--stage-timing",
        "--max-concurrent-requests",
        "--api-keys-file",
        "--forward-authorization",
        "--http-tls",
        "--engine-tls-ca",
        "--pd",
        "--pd-role",
        "--pd-bootstrap-port",
    }
)


class _WithoutFlags:
    """An argparse parser that ignores the flags named in `skip` (so the router's flag definitions
    in cli.py are the picker's too, minus the router-only ones)."""

    def __init__(self, parser: argparse.ArgumentParser, skip: Collection[str]) -> None:
        self._parser, self._skip = parser, skip

    def add_argument(self, *names: str, **kwargs):
        if any(n in self._skip for n in names):
            return None
        return self._parser.add_argument(*names, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._parser, name)


def validate(args: argparse.Namespace) -> None:
    """The router's checks of flags that only fail together (the picker takes its routing flags)."""
    from kvroute.data_plane import cli as router_cli

    router_cli.validate(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.data_plane import cli as router_cli

    router_cli.add_arguments(_WithoutFlags(p, ROUTER_ONLY_FLAGS))  # type: ignore[arg-type]
    p.add_argument("--grpc-port", type=port, default=9002, help="ext_proc gRPC port (GAIE's conventional 9002)")
    p.add_argument(
        "--body-mode",
        choices=("streamed", "buffered"),
        default="streamed",
        help="the request body mode of Envoy's ext_proc filter when its messages do not say "
        "(protocol_config): streamed = FULL_DUPLEX_STREAMED (GAIE's), buffered = BUFFERED",
    )
    p.add_argument(
        "--failure-mode",
        choices=("FailClose", "FailOpen"),
        default="FailClose",
        help="the InferencePool's endpointPickerRef.failureMode: on an internal error, FailClose "
        "answers 500, FailOpen lets Envoy pick an endpoint itself",
    )
    p.add_argument(
        "--fallback-endpoints",
        type=int,
        default=0,
        metavar="N",
        help="also name the next N candidates (in the policy's order) after the chosen one, for Envoy's retries",
    )
    p.add_argument(
        "--sheddable-objectives",
        default="",
        metavar="NAME,...",
        help="x-gateway-inference-objective values whose requests may be shed (429) when every "
        "candidate is saturated (GAIE: objectives with a negative priority)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        help="serve Prometheus /metrics (the router's metrics: decisions, fail-open by reason), /health and "
        "/ready on this HTTP port (0 = any free port; default off)",
    )
    p.add_argument(
        "--saturation-load",
        type=int,
        default=0,
        metavar="N",
        help="a worker is saturated at this many requests (max of in flight and running + waiting); 0 = never shed",
    )


# ---------------------------------------------------------------------------- wire helpers


# ---------------------------------------------------------------------------- process


def status_routes(service: RoutingService) -> dict:
    """GET /metrics, /health, /ready on --metrics-port: what the router serves on its HTTP port."""
    from kvroute.data_plane.service.readiness import router_readiness, served_models
    from kvroute.status import status_routes as routes

    return routes(
        service.metrics.registry,
        health=lambda: {"status": "ok", "model": service.model, "policy": service.policy.name},
        readiness=lambda: router_readiness(
            service.control_plane, service.model, service.health, served_models(service.control_plane, service.model)
        ),
    )


async def serve(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2

    from kvroute.data_plane.service.readiness import router_readiness, served_models
    from kvroute.data_plane.service.routing_service import build_routing_service
    from kvroute.listeners import GrpcListener, check_port, start_status_site
    from kvroute.process import announce_when_ready, wait_for_stop_signal, write_port_file
    from kvroute.tls import grpc_message_options, server_tls

    if args.fallback_endpoints < 0 or args.saturation_load < 0:
        raise SystemExit("kvroute epp: error: --fallback-endpoints and --saturation-load must be >= 0")
    service = build_routing_service(args, "epp")
    picker = EndpointPicker(
        service,
        buffered=args.body_mode == "buffered",
        fail_open=args.failure_mode == "FailOpen",
        max_body_bytes=args.max_body_bytes,
        fallback_endpoints=args.fallback_endpoints,
        sheddable_objectives=[s.strip() for s in args.sheddable_objectives.split(",") if s.strip()],
        saturation_load=args.saturation_load,
    )
    # Like the router's gRPC port: TLS whenever --tls-cert is set, client certificates with --tls-ca.
    tls = service.tls_files
    listener = GrpcListener(
        "--grpc-port",
        str(check_port("--grpc-port", args.host, args.grpc_port)),
        (EXT_PROC_SERVICE,),
        grpc_message_options(args.grpc_max_message_bytes),
        credentials=server_tls(tls).grpc_credentials() if tls.cert else None,
        health_names=("readiness",),
    )  # GAIE's health service names
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, listener.server)

    def ready() -> bool:
        return router_readiness(
            service.control_plane, service.model, service.health, served_models(service.control_plane, service.model)
        ).ready

    status_runner = None
    if args.metrics_port is not None:  # before serving: a busy port must not leave a half-started picker
        status_runner, metrics_port = await start_status_site(
            "--metrics-port", args.host, args.metrics_port, status_routes(service)
        )
    await listener.start(serving=False)
    # GAIE's health names: `liveness` while the process answers; `readiness` (with "" and the ext_proc
    # service) while the router would say /ready.
    await listener.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    health_task = asyncio.create_task(listener.follow(ready))
    ready_task = None
    try:
        service.start()  # after the listener: a port in use is the only line printed
        log.info(
            "epp listening: grpc=%s:%d policy=%s model=%s control-plane=%s body-mode=%s failure-mode=%s",
            args.host,
            listener.port,
            args.policy,
            service.model,
            args.control_plane,
            args.body_mode,
            args.failure_mode,
        )
        ready_task = asyncio.create_task(
            announce_when_ready(ready, lambda: log.info("epp ready: the router's readiness holds (gRPC readiness SERVING)"))
        )
        write_port_file(args.port_file, {"grpc": listener.port, **({"metrics": metrics_port} if status_runner else {})})
        await wait_for_stop_signal()
        log.info("epp stopping")
    finally:
        await cancel_and_wait(health_task, ready_task)
        await listener.stop(0.5)
        if status_runner is not None:
            await status_runner.cleanup()
        await service.close()
    return 0


def run(args: argparse.Namespace) -> int:
    from kvroute.data_plane.service.routing_service import run_routing_process

    return run_routing_process("epp", serve(args), args.log_level)
