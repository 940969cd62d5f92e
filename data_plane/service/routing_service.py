"""The routing service: every object a routing decision needs, built once from the router's flags.

    service = build_routing_service(args, "router")   # or "epp"
    prepared = await service.preparer.prepare(route_input)
    decision = await service.router.decide(prepared.model, prepared.token_ids, ...)

One service routes every model its fleet serves: each request among the workers of its own model
(`PreparedRequest.model`), tokenized with that model's tokenizer (`model_tokenizers.py`), its
prompt keyed in that model's namespace; `service.model` is the default model (`--model`), the one
`--tokenizer` belongs to and the workers no agent reports on serve.

`kvroute router` (cli.py) and `kvroute epp` (epp.py) both start from it, so the endpoint picker
takes exactly the router's path: request preparation (tokenizer, chat template, length checks),
block keys, the control-plane query under its deadline, the same policy with the same weights,
and the same in-flight state and backend health that later decisions read. Only the transports
differ. `service.start()` (the control-plane link and the active health checks) is left to the
caller: after its listeners are up, so that a port in use is the only line printed;
`await service.close()` stops them.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial

from kvroute.addresses import parse_static_fleet
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, KnownWorker
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.cp_link.query_deadline import QueryDeadline
from kvroute.data_plane.cp_link.router_session import default_router_id
from kvroute.data_plane.decision.policies import RoutingPolicy, make_policy, parse_kv_aware_params
from kvroute.data_plane.engines.backend_health import BackendHealth, HealthCheckConfig, HealthChecks
from kvroute.data_plane.engines.engine_discovery import DiscoveryError, EngineDiscovery, make_resolver, parse_target
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.prepare.model_tokenizers import ModelTokenizers, default_model_name, parse_model_tokenizer
from kvroute.data_plane.prepare.request_prep import RequestPreparer
from kvroute.data_plane.service.routing import Router
from kvroute.listeners import run_service
from kvroute.prefix_index.backends import IndexBackendError, make_index, resolve_backend
from kvroute.process import process_setup
from kvroute.tls import TlsConfigError, TlsFiles, client_tls, tls_files_from_args


@dataclass(slots=True)
class RoutingService:
    model: str  # the default model (--model; the workers no agent reports on serve it)
    tokenizers: ModelTokenizers  # every model's, loaded when first asked for
    kv_params: dict[str, float]  # --kv-aware-param overrides, for the start-up log line
    policy: RoutingPolicy
    control_plane: ControlPlaneClient
    inflight: RouterInflight  # written by whoever sends the request (proxy, reservations, epp)
    health: BackendHealth
    metrics: RouterMetrics
    router: Router
    preparer: RequestPreparer
    tls_files: TlsFiles  # --tls-*: the control-plane link's, and the caller's listeners'
    health_checks: HealthChecks  # active checks of the workers no agent reports on
    discovery: EngineDiscovery | None = None  # --discover-engines

    def start(self, engine_ssl: ssl.SSLContext | None = None) -> None:
        """The control-plane link, engine discovery and the active health checks (`engine_ssl`:
        verifies https:// engines, as the proxy does)."""
        self.control_plane.start()
        if self.discovery is not None:
            self.discovery.start()
        self.health_checks.start(engine_ssl)

    async def close(self) -> None:
        await self.health_checks.close()
        if self.discovery is not None:
            await self.discovery.close()
        await self.control_plane.close()


def unmonitored_workers(known: list[KnownWorker]) -> dict[str, str]:
    """worker_id -> endpoint of the workers no agent reports on: their load and liveness never reach
    the control plane, so the router checks them itself: the --static-workers while that fleet is
    in use and the engines found by DNS (model "": no agent reports what they serve)."""
    return {w.worker_id: w.endpoint for w in known if not w.model}


def engine_discovery(args: argparse.Namespace, command: str) -> EngineDiscovery | None:
    """The --discover-engines targets (checked by their argparse type), or None without any."""
    if not args.discover_engines:
        if args.dns_server:
            raise SystemExit(f"kvroute {command}: error: --dns-server needs --discover-engines")
        return None
    try:
        resolver = make_resolver(args.dns_server)
    except DiscoveryError as exc:
        raise SystemExit(f"kvroute {command}: error: --discover-engines: {exc}") from None
    targets = list({t.spec: t for t in map(parse_target, args.discover_engines)}.values())  # each once
    return EngineDiscovery(targets, resolver, args.discovery_interval_s, args.discovery_empty_grace_s)


def build_routing_service(args: argparse.Namespace, command: str) -> RoutingService:
    """From the routing flags `kvroute router` defines (cli.add_arguments); `command` names the
    process in error messages. The flags were checked when parsed (their types, cli.validate)."""
    model = args.model or default_model_name(args.tokenizer)
    sources = {model: args.tokenizer, **dict(map(parse_model_tokenizer, args.model_tokenizer))}
    tokenizers = ModelTokenizers(sources, model, cache_tokens=args.tokenizer_cache_tokens, max_loaded=args.max_loaded_tokenizers)
    static = parse_static_fleet(args.static_workers)
    # --serve-models: these and the ones given a tokenizer or static workers; else every model (empty: no filter).
    only_models = (
        (frozenset(args.serve_models.split(",")) | frozenset(sources) | frozenset(w.model for w in static.values() if w.model))
        if args.serve_models
        else frozenset()
    )
    tokenizers.check_sources()  # FileNotFoundError: one line and exit 2 (run_routing_process)
    tokenizers.load_now(model)  # the default model's now: its char bound is logged at start
    kv_params = parse_kv_aware_params(args.kv_aware_param)
    policy = make_policy(args.policy, **kv_params)
    # In-flight requests are shared so that other routers' index queries count them; a policy that reads
    # no index neither queries nor announces (three messages per request, ~0.08 ms measured).
    share_inflight = policy.needs.index and not args.no_router_session
    deadline = QueryDeadline(args.query_timeout_ms / 1000, args.query_timeout_max_ms / 1000, args.query_timeout_factor)
    try:
        tls_files = tls_files_from_args(args, server=False)
    except TlsConfigError as exc:
        raise SystemExit(f"kvroute {command}: error: {exc}") from None
    # A policy that reads the index reads it from this router's own view unless --index remote.
    view = None
    if policy.needs.index and args.index == "local":
        try:
            resolve_backend(args.index_backend)
        except IndexBackendError as exc:
            raise SystemExit(f"kvroute {command}: error: {exc}") from None
        # Every model (unless --serve-models): the router serves whichever its fleet does.
        view = FleetView(
            args.router_id or default_router_id(),
            models=only_models,
            max_stale_s=args.view_max_stale_s,
            lag_bound_s=args.view_lag_bound_s,
            index_factory=partial(make_index, args.index_backend),
        )
    discovery = engine_discovery(args, command)
    # The control-plane link presents the certificate when it has one (mTLS), verifies with the CA.
    control_plane = ControlPlaneClient(
        args.control_plane,
        static_workers={wid: w.url for wid, w in static.items()},
        static_models={wid: w.model for wid, w in static.items() if w.model},
        router_id=args.router_id,
        use_session=share_inflight,
        query_deadline=deadline,
        tls=client_tls(tls_files),
        max_message_bytes=args.grpc_max_message_bytes,
        view=view,
        discovery=discovery,
        unreported_model=model,
        only_models=only_models,
    )
    # Built once: the proxy writes in-flight state and backend failures, decisions read them.
    inflight = RouterInflight(control_plane.session)
    checks = health_check_config(args)
    health = BackendHealth(failures_to_down=checks.failures_to_down, successes_to_up=checks.successes_to_up)
    metrics = RouterMetrics()
    if view is not None:
        metrics.watch_view(view)
    if discovery is not None:
        metrics.watch_discovery(discovery)
    router = Router(control_plane, policy, inflight, health, metrics)
    preparer = RequestPreparer(tokenizers, control_plane, args.max_prompt_tokens)
    health_checks = HealthChecks(
        health,
        lambda: unmonitored_workers(
            [w for served in control_plane.models() | {model} for w in control_plane.workers_for(served)]
        ),
        checks,
    )
    return RoutingService(
        model,
        tokenizers,
        kv_params,
        policy,
        control_plane,
        inflight,
        health,
        metrics,
        router,
        preparer,
        tls_files,
        health_checks,
        discovery,
    )


def health_check_config(args: argparse.Namespace) -> HealthCheckConfig:
    """The --health-check-* flags (checked by their argparse types)."""
    return HealthCheckConfig(
        args.health_check_interval_s,
        args.health_check_timeout_s,
        args.health_failure_threshold,
        args.health_success_threshold,
        args.health_check_path,
    )


def run_routing_process(command: str, serving: Coroutine[object, object, int], log_level: str) -> int:
    """`kvroute router` / `kvroute epp` run `serving` (their `serve(args)`) the same way: a port in use
    is one line and exit 2 (`run_service`), and so is a bad --tokenizer, without a traceback."""
    with process_setup(f"kvroute-{command}", log_level):
        try:
            return run_service(command, serving)
        except (FileNotFoundError, OSError) as exc:
            logging.getLogger(f"kvroute.{command}").error("%s cannot start: %s", command, exc)
            return 2
