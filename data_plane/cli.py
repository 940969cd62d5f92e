"""`kvroute router`."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvroute.addresses import (
    control_plane_addresses,
    dns_server,
    listen_host,
    parse_port_map,
    port,
    port_map,
    port_or_off,
    static_workers,
)
from kvroute.aio import cancel_and_wait
from kvroute.process import (
    add_log_level_argument,
    add_port_file_argument,
    announce_when_ready,
    non_negative,
    positive,
    seconds,
    wait_for_stop_signal,
    write_port_file,
)
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
    from kvroute.data_plane.access.admission import DEFAULT_MAX_CONCURRENT_REQUESTS
    from kvroute.data_plane.access.api_keys import ENV_API_KEYS
    from kvroute.data_plane.decision.policies import POLICIES, kv_aware_param  # pure module, cheap to import for --help
    from kvroute.data_plane.ops.traffic_capture import CAPTURE_BLOCK_TOKENS
    from kvroute.data_plane.prepare.model_tokenizers import DEFAULT_MAX_LOADED
    from kvroute.prefix_index.backends import BACKENDS

    p.add_argument(
        "--control-plane",
        type=control_plane_addresses,
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="control plane gRPC address (replicas: HOST:PORT,HOST:PORT,...)",
    )
    p.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES), help="routing policy")
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH_OR_ID",
        help="the default model's tokenizer: a local model directory with tokenizer.json, or a model id "
        "in the local Hugging Face cache (never downloaded)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the default model: the served name --tokenizer belongs to, and the model the workers no "
        "agent reports on serve (--static-workers, --discover-engines) (unset: the tokenizer "
        "directory's name, or the model id)",
    )
    p.add_argument(
        "--model-tokenizer",
        type=_model_tokenizer,
        action="append",
        default=[],
        metavar="MODEL=PATH_OR_ID",
        help="another model's tokenizer, repeatable. The router serves every model its workers register "
        "(and those given here, which answer 503 until a worker of theirs registers); a served model "
        "without one uses the tokenizer of its own id in the local Hugging Face cache, else is routed "
        "on load alone. A model neither served nor given here gets a 404 model_not_found",
    )
    p.add_argument(
        "--serve-models",
        type=_model_list,
        default="",
        metavar="MODEL,...",
        help="serve only these models (with the default one and those of --model-tokenizer): this "
        "router follows only their workers and index, and any other model gets a 404 "
        "(unset: every model the fleet serves)",
    )
    p.add_argument(
        "--max-loaded-tokenizers",
        type=positive(int),
        default=DEFAULT_MAX_LOADED,
        metavar="N",
        help="tokenizers kept loaded at once, each loaded when its model is first asked for; past N the "
        "least recently used is unloaded (kvroute_router_tokenizer_loads_total counts loads)",
    )
    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="listen address (HTTP and gRPC)")
    p.add_argument("--port", type=port, default=8080, help="OpenAI-compatible HTTP port")
    p.add_argument(
        "--grpc-port", type=port_or_off, default=50052, help="gRPC Route port (0 = any free port; off = no gRPC listener)"
    )
    p.add_argument(
        "--index",
        default="local",
        choices=("local", "remote"),
        help="where a decision reads the prefix index: `local` = this router's own view of the fleet, "
        "followed from the control plane (ControlPlane.Follow), no query on a request's path; "
        "`remote` = a query to the control plane per decision, under --query-timeout-ms (a "
        "router that cannot hold a view). Only policies that read the index use either",
    )
    p.add_argument(
        "--view-max-stale-s",
        type=seconds(),
        default=120.0,
        metavar="S",
        help="--index local: with no control plane heard from for this long, decide on load alone "
        "(counted as fail-open `view_stale`) until one answers again. Generous on purpose: the cached "
        "prefixes move slowly, and a view a minute old still routes most requests to their cache",
    )
    p.add_argument(
        "--index-backend",
        choices=BACKENDS,
        default="auto",
        help="--index local: the view's prefix index, as the control plane's (native: C, ~40 bytes per "
        "entry; bitmask: pure Python; auto: native when its extension is built)",
    )
    p.add_argument(
        "--view-lag-bound-s",
        type=seconds(),
        default=2.0,
        metavar="S",
        help="--index local: /ready says degraded when no control plane was heard from for this long",
    )
    p.add_argument(
        "--query-timeout-ms",
        type=positive(float),
        default=5.0,
        help="deadline of the control-plane query, past which the router decides on load alone; with "
        "--query-timeout-factor, the shortest deadline",
    )
    p.add_argument(
        "--query-timeout-factor",
        type=non_negative(float),
        default=0.0,
        help="adaptive deadline: this x the slowest of the last 256 query latencies (late answers "
        "included), within [--query-timeout-ms, --query-timeout-max-ms]; 0 (default) = fixed. "
        "On a loaded host 2 with --query-timeout-ms 25 kept every decision on the index (docs/operations.md)",
    )
    p.add_argument(
        "--reservation-ttl-ms",
        type=positive(int),
        default=60_000,
        help="gRPC Route(reserve=true): how long a reservation counts as in flight unless released "
        "(a request may ask for its own, up to an hour)",
    )
    p.add_argument(
        "--max-reservations",
        type=positive(int),
        default=100_000,
        help="gRPC Route(reserve=true): reservations held at once; past it Route answers RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--query-timeout-max-ms",
        type=positive(float),
        default=100.0,
        help="longest adaptive deadline (also the deadline until 32 latencies are known)",
    )
    p.add_argument(
        "--kv-aware-param",
        type=kv_aware_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one of kv_aware's weights for this router's model, repeatable (names and "
        "meaning: kvroute.data_plane.decision.policies.KvAwareParams, e.g. recompute_weight=0.5, load_bound=1.5)",
    )
    p.add_argument(
        "--router-id", default=None, help="this router's id in the control plane's shared in-flight state (default: HOST-PID)"
    )
    p.add_argument(
        "--no-router-session",
        action="store_true",
        help="do not share in-flight requests with other routers (unary queries only); a policy that "
        "reads no index (all but kv_aware) never opens the session",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=positive(int),
        default=131072,
        help="reject longer prompts with a 400 (context_length_exceeded); a prompt whose text is longer "
        "than this many tokens of the tokenizer's longest could cover is rejected without tokenizing",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive(int),
        default=4 * 1024 * 1024,
        metavar="N",
        help="reject larger request bodies with a 413, from their Content-Length before reading them "
        "(default 4 MiB: ~3x a 128k-token chat as JSON; raise it for inline base64 images)",
    )
    p.add_argument(
        "--tokenizer-cache-tokens",
        type=non_negative(int),
        default=4_000_000,
        metavar="N",
        help="budget of the cache of already-seen prompt segments (system prompts, earlier turns), in tokens: "
        "each segment costs its ids plus 64 for bookkeeping, ~4 bytes each; "
        "0 tokenizes every prompt whole",
    )
    p.add_argument(
        "--static-workers",
        type=static_workers,
        default="",
        metavar="ID[@MODEL]=URL,...",
        help="fallback fleet used only while the control plane has never been reachable; the router "
        "checks these engines itself (--health-check-*). Each serves MODEL, else the default model "
        "(--model)",
    )
    p.add_argument(
        "--discover-engines",
        action="append",
        default=[],
        type=_discovery_target,
        metavar="TARGET",
        help="engines without an agent, found by DNS and followed as the answer changes, repeatable: "
        "dns://NAME:PORT (NAME's A records, else AAAA: each address an engine at PORT, e.g. a "
        "Kubernetes headless Service) or dnssrv://NAME (SRV records, e.g. "
        "_http._tcp.SERVICE.NAMESPACE.svc.cluster.local: each target at its port). Routed on load "
        "and health-checked (--health-check-*); an engine an agent also reports on (same "
        "endpoint) is that agent's worker, on the index",
    )
    p.add_argument(
        "--discovery-interval-s", type=seconds(), default=5.0, metavar="S", help="--discover-engines: resolve every S seconds"
    )
    p.add_argument(
        "--discovery-empty-grace-s",
        type=seconds(allow_zero=True),
        default=30.0,
        metavar="S",
        help="--discover-engines: an empty answer (NXDOMAIN, no records) after engines were found "
        "removes them only once answers stayed empty this long (a failed resolution never does)",
    )
    p.add_argument(
        "--dns-server",
        type=dns_server,
        default="",
        metavar="IP[:PORT]",
        help="--discover-engines: ask this DNS server (port 53 unless given) instead of those of "
        "/etc/resolv.conf (whose search list then does not apply: give full names)",
    )
    p.add_argument(
        "--health-check-interval-s",
        type=seconds(allow_zero=True),
        default=5.0,
        metavar="S",
        help="active health checks of the workers no agent reports on (--static-workers, "
        "--discover-engines): one GET --health-check-path to each every S seconds; 0 = none",
    )
    p.add_argument(
        "--health-check-timeout-s",
        type=seconds(),
        default=5.0,
        metavar="S",
        help="a health check not answered within S seconds failed",
    )
    p.add_argument(
        "--health-failure-threshold",
        type=positive(int),
        default=3,
        metavar="N",
        help="failed health checks in a row that take a worker out of routing (its first check alone decides)",
    )
    p.add_argument(
        "--health-success-threshold",
        type=positive(int),
        default=2,
        metavar="N",
        help="passed health checks in a row that bring a worker that was out back",
    )
    p.add_argument(
        "--health-check-path",
        type=_url_path,
        default="/health",
        metavar="PATH",
        help="the path health checks GET; a 2xx answer passes (vLLM and SGLang serve /health)",
    )
    p.add_argument(
        "--capture-trace",
        default=None,
        metavar="PATH",
        help="record routed requests to PATH as a Mooncake JSONL trace for `kvroute simulate --trace` "
        "(lengths, timestamps and dense block ids only, no prompt content; "
        "the file is truncated at startup)",
    )
    p.add_argument(
        "--capture-block-tokens",
        type=positive(int),
        default=CAPTURE_BLOCK_TOKENS,
        metavar="N",
        help="tokens per captured block id, written into every row; sharing shorter than this is invisible "
        "in the trace (Mooncake's own traces use 512)",
    )
    p.add_argument(
        "--capture-sample-rate",
        type=_sample_rate,
        default=1.0,
        metavar="FLOAT",
        help="fraction of requests to capture, in (0, 1]; deterministic (every 1/rate-th request)",
    )
    p.add_argument(
        "--stage-timing",
        action="store_true",
        help="keep per-stage timings of proxied requests (parse, prepare, keys, query, score, connect, "
        "first_byte) and serve them at GET /debug/stages (kvroute bench proxy turns this on)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=positive(int),
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        metavar="N",
        help="HTTP requests in progress at once (proxied streams included); past it a 429 with Retry-After, never a queue",
    )
    p.add_argument(
        "--api-keys-file",
        default="",
        metavar="PATH",
        help="require `Authorization: Bearer <key>` (gRPC: metadata authorization) for the APIs; one "
        "`sha256:<hex> [name] [scope=all|route]` a line, reloaded when it changes. "
        f"{ENV_API_KEYS}=key,... adds keys (or sha256:<hex>) from the environment. "
        "/health, /ready, /metrics stay open",
    )
    p.add_argument(
        "--pd",
        default="",
        choices=("vllm", "sglang"),
        help="prefill/decode disaggregation: each request's prompt goes to a prefill worker (chosen by "
        "--policy among workers of role prefill) and its generation to a decode worker (fewest "
        "requests among workers of role decode), with the engine's protocol: vllm (KV connector "
        "kv_transfer_params) or sglang (bootstrap host/port/room); default: off, whole requests",
    )
    p.add_argument(
        "--pd-role",
        type=_pd_roles,
        default="",
        metavar="ID=ROLE,...",
        help="--pd: roles (prefill or decode) of workers that register none (--static-workers, "
        "--discover-engines); an agent's `--role` is used otherwise",
    )
    p.add_argument(
        "--pd-bootstrap-port",
        type=port_map,
        default="",
        metavar="PORT|ID=PORT,...",
        help="--pd sglang: the prefill workers' bootstrap port (--disaggregation-bootstrap-port), one for "
        "all and/or per worker id (default: SGLang's 8998)",
    )
    p.add_argument(
        "--forward-authorization",
        action="store_true",
        help="pass the client's Authorization header on to the engine (default: dropped, it is the router's API key)",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--http-tls",
        nargs="?",
        const="tls",
        default="",
        choices=("tls", "mtls"),
        help="serve HTTPS on --port with --tls-cert/--tls-key; `mtls` also requires client "
        "certificates signed by --tls-ca (default: plain HTTP; the gRPC port is TLS whenever "
        "--tls-cert is set)",
    )
    p.add_argument(
        "--engine-tls-ca",
        default="",
        metavar="PEM",
        help="CA bundle that verifies https:// engines (default: the system's); the router's --tls-cert "
        "is presented to them when set",
    )
    add_grpc_message_argument(p, DEFAULT_GRPC_MAX_MESSAGE_BYTES)
    add_log_level_argument(p)
    add_port_file_argument(p)


def _discovery_target(value: str) -> str:
    from kvroute.data_plane.engines.engine_discovery import DiscoveryError, parse_target

    try:
        return parse_target(value).spec
    except DiscoveryError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pd_roles(value: str) -> str:
    from kvroute.data_plane.http.pd import parse_roles

    try:
        parse_roles(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value.strip()


def _model_tokenizer(value: str) -> str:
    from kvroute.data_plane.prepare.model_tokenizers import parse_model_tokenizer

    try:
        parse_model_tokenizer(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value.strip()


def _model_list(value: str) -> str:
    names = [name.strip() for name in value.split(",")]
    if value.strip() and not all(names):
        raise argparse.ArgumentTypeError(f"{value!r} is not MODEL,MODEL,... (an empty name)")
    return ",".join(names) if value.strip() else ""


def _url_path(value: str) -> str:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"must be a URL path starting with / (no spaces), got {value!r}")
    return value


def validate(args: argparse.Namespace) -> None:
    """The router's (and `kvroute epp`'s) checks of flags that are valid alone but not together, run when
    its configuration is parsed (at start and by `kvroute config check`): ValueError naming the flags.
    Whether TLS files load is checked at start only (they live where the process runs)."""
    from kvroute.data_plane.prepare.model_tokenizers import default_model_name, parse_model_tokenizer

    if args.kv_aware_param and args.policy != "kv_aware":
        raise ValueError("--kv-aware-param needs --policy kv_aware")
    if (getattr(args, "pd_role", "") or getattr(args, "pd_bootstrap_port", "")) and not getattr(args, "pd", ""):
        # the picker has no P/D mode, so none of these
        raise ValueError("--pd-role and --pd-bootstrap-port need --pd vllm|sglang")
    named = [parse_model_tokenizer(value)[0] for value in args.model_tokenizer]
    default = args.model or (default_model_name(args.tokenizer) if args.tokenizer else None)
    if default in named or len(set(named)) != len(named):
        raise ValueError("--model-tokenizer names a model twice (or the default model, whose tokenizer is --tokenizer)")
    http_tls = getattr(args, "http_tls", "")  # the picker has no HTTP API
    if http_tls and not args.tls_cert:
        raise ValueError("--http-tls needs --tls-cert and --tls-key")
    if http_tls == "mtls" and not args.tls_ca:
        raise ValueError("--http-tls mtls needs --tls-ca (the CA that signs client certificates)")


def _sample_rate(value: str) -> float:
    rate = float(value)
    if not 0.0 < rate <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return rate


async def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvroute.data_plane.access.admission import Admission, ApiKeyInterceptor
    from kvroute.data_plane.access.api_keys import ApiKeys, KeyFileError
    from kvroute.data_plane.grpc.api import RouterGrpcService, add_router_service
    from kvroute.data_plane.grpc.app_reservations import AppReservations
    from kvroute.data_plane.http.api import RouterHttpApi
    from kvroute.data_plane.http.pd import SGLANG_DEFAULT_BOOTSTRAP_PORT, PdRouting, parse_roles
    from kvroute.data_plane.http.proxy import BackendProxy
    from kvroute.data_plane.ops.stage_timing import StageSamples
    from kvroute.data_plane.ops.traffic_capture import TrafficCapture
    from kvroute.data_plane.service.routing_service import build_routing_service
    from kvroute.listeners import GrpcListener, check_port, start_http_site
    from kvroute.tls import grpc_message_options
    from kvroute.v1 import kvroute_pb2 as pb

    log = logging.getLogger("kvroute.router")
    service = build_routing_service(args, "router")  # shared with `kvroute epp`: routing_service.py
    model, kv_params = service.model, service.kv_params
    inflight, metrics, router, preparer = service.inflight, service.metrics, service.router, service.preparer
    tls_files = service.tls_files  # its listeners serve TLS when it has a certificate
    try:
        engine_ssl = engine_client_context(args.engine_tls_ca, tls_files) if args.engine_tls_ca else None
        api_keys = ApiKeys.from_environment(args.api_keys_file)
    except (TlsConfigError, KeyFileError, OSError) as exc:
        raise SystemExit(f"kvroute router: error: {exc}") from None
    listener_tls = server_tls(tls_files) if tls_files.cert else None
    proxy = BackendProxy(
        inflight, service.health, metrics, forward_authorization=args.forward_authorization, engine_ssl=engine_ssl
    )
    admission = Admission(api_keys, args.max_concurrent_requests, metrics.registry)
    capture = None
    if args.capture_trace:
        capture = TrafficCapture(args.capture_trace, args.capture_sample_rate, metrics, block_tokens=args.capture_block_tokens)
        capture.start()
    pd = None
    if args.pd:
        default_port, ports = parse_port_map(args.pd_bootstrap_port)
        pd = PdRouting(args.pd, router, proxy, parse_roles(args.pd_role), ports, default_port or SGLANG_DEFAULT_BOOTSTRAP_PORT)
    http = RouterHttpApi(
        router,
        proxy,
        preparer,
        capture=capture,
        max_body_bytes=args.max_body_bytes,
        stages=StageSamples() if args.stage_timing else None,
        admission=admission,
        pd=pd,
    )
    # handler_cancellation: a client that goes away cancels its handler, which closes the backend
    # connection, so the engine stops generating for nobody.
    runner = web.AppRunner(http.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    grpc_server: GrpcListener | None = None
    reservations: AppReservations | None = None
    health_task = ready_task = None
    try:
        http_ssl = (
            listener_tls.ssl_context(require_client_cert=args.http_tls == "mtls") if args.http_tls and listener_tls else None
        )
        http_port = await start_http_site(runner, "--port", args.host, args.port, ssl_context=http_ssl)
        if args.grpc_port is not None:
            grpc_server = GrpcListener(
                "--grpc-port",
                str(check_port("--grpc-port", args.host, args.grpc_port)),
                (pb.DESCRIPTOR.services_by_name["Router"].full_name,),  # + "" for grpc.health
                grpc_message_options(args.grpc_max_message_bytes),
                credentials=listener_tls.grpc_credentials() if listener_tls else None,
                interceptors=[ApiKeyInterceptor(admission)] if api_keys.enabled else (),
            )
            reservations = AppReservations(inflight, metrics, args.reservation_ttl_ms / 1000, max_held=args.max_reservations)
            add_router_service(RouterGrpcService(router, preparer, reservations, capture), grpc_server.server)
            await grpc_server.start(serving=http.readiness().ready)
            # grpc.health.v1 says what GET /ready says (data_plane/service/readiness.py)
            health_task = asyncio.create_task(grpc_server.follow(lambda: http.readiness().ready))
        service.start(engine_ssl)  # after the listeners: a port in use is the only line printed
        log.info(
            "router listening: %s://%s:%d grpc=%s policy=%s%s model=%s control-plane=%s%s%s; %s",
            "https" if http_ssl else "http",
            args.host,
            http_port,
            grpc_server.port if grpc_server else "off",
            args.policy,
            f" pd={args.pd}" if args.pd else "",
            model,
            args.control_plane,
            "".join(f" {k}={v:g}" for k, v in kv_params.items()),
            (f" tls={'mtls' if tls_files.mutual else 'tls'}" if tls_files.enabled else "")
            + (f" api-keys={len(api_keys)}" if api_keys.enabled else ""),
            "decisions on this router's own view of the fleet"
            if service.control_plane.view is not None
            else service.control_plane.query_deadline.describe(),
        )
        log.info("%s", http.prompt_bound_note)

        def announce_ready() -> None:
            body = http.readiness().body()
            models = list(body["models"]) or [model]
            log.info(
                "router ready: %d of %d workers of %s %s healthy (GET /ready answers 200)",
                body["healthy_workers"],
                body["workers"],
                "model" if len(models) == 1 else "models",
                ", ".join(models),
            )

        ready_task = asyncio.create_task(announce_when_ready(lambda: http.readiness().ready, announce_ready))
        write_port_file(args.port_file, {"http": http_port, **({"grpc": grpc_server.port} if grpc_server else {})})
        await wait_for_stop_signal()
        log.info("router stopping")
    finally:
        await cancel_and_wait(health_task, ready_task)
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
    from kvroute.data_plane.service.routing_service import run_routing_process

    return run_routing_process("router", serve(args), args.log_level)
