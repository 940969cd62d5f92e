"""`kvroute router`."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvroute.process import add_log_level_argument, add_port_file_argument, wait_for_stop_signal, write_port_file
from kvroute.tls import (
    TlsConfigError,
    add_grpc_message_argument,
    add_tls_arguments,
    engine_client_context,
    server_tls,
)

# Control-plane answers (ListWorkers of a large fleet) and Route requests with long prompts.
DEFAULT_GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.data_plane.admission import DEFAULT_MAX_CONCURRENT_REQUESTS
    from kvroute.data_plane.api_keys import ENV_API_KEYS
    from kvroute.data_plane.decision.policies import POLICIES  # pure module, cheap to import for --help
    from kvroute.data_plane.traffic_capture import CAPTURE_BLOCK_TOKENS

    p.add_argument("--control-plane", default="127.0.0.1:50051", metavar="HOST:PORT", help="control plane gRPC address")
    p.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES), help="routing policy")
    p.add_argument("--tokenizer", required=True, metavar="PATH", help="local model directory with tokenizer.json")
    p.add_argument("--model", default=None, help="served model name the tokenizer belongs to; other models get a 404 "
                        "(unset: the tokenizer directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (HTTP and gRPC)")
    p.add_argument("--port", type=int, default=8080, help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=50052, help="gRPC Route port (0 = off)")
    p.add_argument("--index", default="local", choices=("local", "remote"),
                   help="where a decision reads the prefix index: `local` = this router's own view of the fleet, "
                        "followed from the control plane (ControlPlane.Follow), no query on a request's path; "
                        "`remote` = a query to the control plane per decision, under --query-timeout-ms (a "
                        "router that cannot hold a view). Only policies that read the index use either")
    p.add_argument("--view-max-stale-s", type=_positive_float, default=120.0, metavar="S",
                   help="--index local: with no control plane heard from for this long, decide on load alone "
                        "(counted as fail-open `view_stale`) until one answers again. Generous on purpose: the cached "
                        "prefixes move slowly, and a view a minute old still routes most requests to their cache")
    p.add_argument("--view-lag-bound-s", type=_positive_float, default=2.0, metavar="S",
                   help="--index local: /ready says degraded when no control plane was heard from for this long")
    p.add_argument("--query-timeout-ms", type=float, default=5.0,
                   help="deadline of the control-plane query, past which the router decides on load alone; with "
                        "--query-timeout-factor, the shortest deadline")
    p.add_argument("--query-timeout-factor", type=float, default=0.0,
                   help="adaptive deadline: this x the slowest of the last 256 query latencies (late answers "
                        "included), within [--query-timeout-ms, --query-timeout-max-ms]; 0 (default) = fixed. "
                        "On a loaded host 2 with --query-timeout-ms 25 kept every decision on the index (README)")
    p.add_argument("--reservation-ttl-ms", type=int, default=60_000,
                   help="gRPC Route(reserve=true): how long a reservation counts as in flight unless released "
                        "(a request may ask for its own, up to an hour)")
    p.add_argument("--max-reservations", type=int, default=100_000,
                   help="gRPC Route(reserve=true): reservations held at once; past it Route answers RESOURCE_EXHAUSTED")
    p.add_argument("--query-timeout-max-ms", type=float, default=100.0,
                   help="longest adaptive deadline (also the deadline until 32 latencies are known)")
    p.add_argument("--kv-aware-param", action="append", default=[], metavar="NAME=VALUE",
                   help="override one of kv_aware's weights for this router's model, repeatable (names and "
                        "meaning: kvroute.data_plane.decision.policies.KvAwareParams, e.g. recompute_weight=0.5, load_bound=1.5)")
    p.add_argument("--router-id", default=None,
                   help="this router's id in the control plane's shared in-flight state (default: HOST-PID)")
    p.add_argument("--no-router-session", action="store_true",
                   help="do not share in-flight requests with other routers (unary queries only); a policy that "
                        "reads no index (all but kv_aware) never opens the session")
    p.add_argument("--max-prompt-tokens", type=int, default=131072,
                   help="reject longer prompts with a 400 (context_length_exceeded); a prompt whose text is longer "
                        "than this many tokens of the tokenizer's longest could cover is rejected without tokenizing")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                   help="reject larger request bodies with a 413, from their Content-Length before reading them "
                        "(default 4 MiB: ~3x a 128k-token chat as JSON; raise it for inline base64 images)")
    p.add_argument("--tokenizer-cache-tokens", type=int, default=4_000_000, metavar="N",
                   help="budget of the cache of already-seen prompt segments (system prompts, earlier turns), in tokens: "
                        "each segment costs its ids plus 64 for bookkeeping, ~4 bytes each; "
                        "0 tokenizes every prompt whole")
    p.add_argument("--static-workers", default="", metavar="ID=URL,...",
                   help="fallback fleet used only while the control plane has never been reachable; the router "
                        "checks these engines itself (--health-check-*)")
    p.add_argument("--health-check-interval-s", type=_seconds(allow_zero=True), default=5.0, metavar="S",
                   help="active health checks of the workers no agent reports on (--static-workers): one GET "
                        "--health-check-path to each every S seconds; 0 = none")
    p.add_argument("--health-check-timeout-s", type=_seconds(allow_zero=False), default=5.0, metavar="S",
                   help="a health check not answered within S seconds failed")
    p.add_argument("--health-failure-threshold", type=_positive_int, default=3, metavar="N",
                   help="failed health checks in a row that take a worker out of routing (its first check "
                        "alone decides)")
    p.add_argument("--health-success-threshold", type=_positive_int, default=2, metavar="N",
                   help="passed health checks in a row that bring a worker that was out back")
    p.add_argument("--health-check-path", type=_url_path, default="/health", metavar="PATH",
                   help="the path health checks GET; a 2xx answer passes (vLLM and SGLang serve /health)")
    p.add_argument("--capture-trace", default=None, metavar="PATH",
                   help="record routed requests to PATH as a Mooncake JSONL trace for `kvroute simulate --trace` "
                        "(lengths, timestamps and dense block ids only, no prompt content; "
                        "the file is truncated at startup)")
    p.add_argument("--capture-block-tokens", type=_block_tokens, default=CAPTURE_BLOCK_TOKENS, metavar="N",
                   help="tokens per captured block id, written into every row; sharing shorter than this is invisible "
                        "in the trace (Mooncake's own traces use 512)")
    p.add_argument("--capture-sample-rate", type=_sample_rate, default=1.0, metavar="FLOAT",
                   help="fraction of requests to capture, in (0, 1]; deterministic (every 1/rate-th request)")
    p.add_argument("--stage-timing", action="store_true",
                   help="keep per-stage timings of proxied requests (parse, prepare, keys, query, score, connect, "
                        "first_byte) and serve them at GET /debug/stages (kvroute bench proxy turns this on)")
    p.add_argument("--max-concurrent-requests", type=_positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   metavar="N", help="HTTP requests in progress at once (proxied streams included); past it a 429 "
                                     "with Retry-After, never a queue")
    p.add_argument("--api-keys-file", default="", metavar="PATH",
                   help="require `Authorization: Bearer <key>` (gRPC: metadata authorization) for the APIs; one "
                        "`sha256:<hex> [name] [scope=all|route]` a line, reloaded when it changes. "
                        f"{ENV_API_KEYS}=key,... adds keys (or sha256:<hex>) from the environment. "
                        "/health, /ready, /metrics stay open")
    p.add_argument("--forward-authorization", action="store_true",
                   help="pass the client's Authorization header on to the engine (default: dropped, it is the "
                        "router's API key)")
    add_tls_arguments(p)
    p.add_argument("--http-tls", nargs="?", const="tls", default="", choices=("tls", "mtls"),
                   help="serve HTTPS on --port with --tls-cert/--tls-key; `mtls` also requires client "
                        "certificates signed by --tls-ca (default: plain HTTP; the gRPC port is TLS whenever "
                        "--tls-cert is set)")
    p.add_argument("--engine-tls-ca", default="", metavar="PEM",
                   help="CA bundle that verifies https:// engines (default: the system's); the router's --tls-cert "
                        "is presented to them when set")
    add_grpc_message_argument(p, DEFAULT_GRPC_MAX_MESSAGE_BYTES)
    add_log_level_argument(p)
    add_port_file_argument(p)


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _seconds(allow_zero: bool):
    def parse(value: str) -> float:
        seconds = float(value)
        if not (seconds >= 0 if allow_zero else seconds > 0) or seconds == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else 'positive'} seconds, got {value}")
        return seconds
    parse.__name__ = "seconds"  # argparse names the type in its error: "invalid seconds value"
    return parse


def _url_path(value: str) -> str:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"must be a URL path starting with / (no spaces), got {value!r}")
    return value


def _block_tokens(value: str) -> int:
    tokens = int(value)
    if tokens <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return tokens


def _sample_rate(value: str) -> float:
    rate = float(value)
    if not 0.0 < rate <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return rate


async def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvroute.data_plane.admission import Admission, ApiKeyInterceptor
    from kvroute.data_plane.api_keys import ApiKeys, KeyFileError
    from kvroute.data_plane.app_reservations import AppReservations
    from kvroute.data_plane.grpc_api import RouterGrpcService, add_router_service
    from kvroute.data_plane.http_api import RouterHttpApi
    from kvroute.data_plane.proxy import BackendProxy
    from kvroute.data_plane.routing_service import build_routing_service
    from kvroute.data_plane.stage_timing import StageSamples
    from kvroute.data_plane.traffic_capture import TrafficCapture
    from kvroute.listeners import GrpcListener, check_port, start_http_site
    from kvroute.tls import grpc_message_options
    from kvroute.v1 import kvroute_pb2 as pb

    log = logging.getLogger("kvroute.router")
    if args.reservation_ttl_ms <= 0 or args.max_reservations <= 0:
        raise SystemExit("kvroute router: error: --reservation-ttl-ms and --max-reservations must be positive")
    service = build_routing_service(args, "router")  # shared with `kvroute epp`: routing_service.py
    model, kv_params = service.model, service.kv_params
    inflight, metrics, router, preparer = service.inflight, service.metrics, service.router, service.preparer
    tls_files = service.tls_files  # its listeners serve TLS when it has a certificate
    try:
        if args.http_tls and not tls_files.cert:
            raise TlsConfigError("--http-tls needs --tls-cert and --tls-key")
        if args.http_tls == "mtls" and not tls_files.ca:
            raise TlsConfigError("--http-tls mtls needs --tls-ca (the CA that signs client certificates)")
        engine_ssl = engine_client_context(args.engine_tls_ca, tls_files) if args.engine_tls_ca else None
        api_keys = ApiKeys.from_environment(args.api_keys_file)
    except (TlsConfigError, KeyFileError, OSError) as exc:
        raise SystemExit(f"kvroute router: error: {exc}") from None
    listener_tls = server_tls(tls_files) if tls_files.cert else None
    proxy = BackendProxy(inflight, service.health, metrics, forward_authorization=args.forward_authorization,
                         engine_ssl=engine_ssl)
    admission = Admission(api_keys, args.max_concurrent_requests, metrics.registry)
    capture = None
    if args.capture_trace:
        capture = TrafficCapture(args.capture_trace, args.capture_sample_rate, metrics,
                                 block_tokens=args.capture_block_tokens)
        capture.start()
    http = RouterHttpApi(router, proxy, preparer, capture=capture, max_body_bytes=args.max_body_bytes,
                         stages=StageSamples() if args.stage_timing else None, admission=admission)
    # handler_cancellation: a client that goes away cancels its handler, which closes the backend
    # connection, so the engine stops generating for nobody.
    runner = web.AppRunner(http.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    grpc_server: GrpcListener | None = None
    reservations: AppReservations | None = None
    health_task = None
    try:
        http_ssl = listener_tls.ssl_context(require_client_cert=args.http_tls == "mtls") \
            if args.http_tls and listener_tls else None
        http_port = await start_http_site(runner, "--port", args.host, args.port, ssl_context=http_ssl)
        if args.grpc_port:
            grpc_server = GrpcListener("--grpc-port", str(check_port("--grpc-port", args.host, args.grpc_port)),
                                       (pb.DESCRIPTOR.services_by_name["Router"].full_name,),  # + "" for grpc.health
                                       grpc_message_options(args.grpc_max_message_bytes),
                                       credentials=listener_tls.grpc_credentials() if listener_tls else None,
                                       interceptors=[ApiKeyInterceptor(admission)] if api_keys.enabled else ())
            reservations = AppReservations(inflight, metrics, args.reservation_ttl_ms / 1000,
                                           max_held=args.max_reservations)
            add_router_service(RouterGrpcService(router, preparer, reservations, capture), grpc_server.server)
            await grpc_server.start(serving=http.readiness().ready)
            # grpc.health.v1 says what GET /ready says (data_plane/readiness.py)
            health_task = asyncio.create_task(grpc_server.follow(lambda: http.readiness().ready))
        service.start(engine_ssl)  # after the listeners: a port in use is the only line printed
        log.info("router ready: %s://%s:%d grpc=%s policy=%s model=%s control-plane=%s "
                 "query-timeout=%g-%gms (x%g slowest recent)%s%s", "https" if http_ssl else "http", args.host,
                 http_port, args.grpc_port or "off",
                 args.policy, model, args.control_plane, args.query_timeout_ms, args.query_timeout_max_ms,
                 args.query_timeout_factor, "".join(f" {k}={v:g}" for k, v in kv_params.items()),
                 (f" tls={'mtls' if tls_files.mutual else 'tls'}" if tls_files.enabled else "")
                 + (f" api-keys={len(api_keys)}" if api_keys.enabled else ""))
        log.info("%s", http.prompt_bound_note)
        write_port_file(args.port_file, {"http": http_port, **({"grpc": grpc_server.port} if grpc_server else {})})
        await wait_for_stop_signal()
        log.info("router stopping")
    finally:
        if health_task:
            health_task.cancel()
        if grpc_server:
            await grpc_server.stop(0.5)
        if reservations:
            reservations.close()
        await runner.cleanup()
        if capture:  # after the servers, so rows of requests that finished while stopping are kept
            await capture.aclose()
        await service.close()
    return 0


def run(args: argparse.Namespace) -> int:
    from kvroute.data_plane.routing_service import run_routing_process

    return run_routing_process("router", serve(args), args.log_level)
