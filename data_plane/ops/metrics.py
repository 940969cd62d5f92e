"""The router's Prometheus metrics, one CollectorRegistry per router instance (GET /metrics).

Names follow Prometheus conventions (base units, `_total` on counters: prometheus_client appends it);
docs/metrics.md lists every one and tests/e2e/test_metrics_catalogue.py checks that list, the Grafana
dashboard and the alert rules against live processes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvroute.build_info import register_build_info

# Request and time-to-first-token durations: a cached 20-token answer in ~10 ms up to long generations.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class TokenizersInUse(Protocol):
    """What the tokenizer collector reads at scrape time (ModelTokenizers)."""

    @property
    def tokenized_chars(self) -> int: ...
    @property
    def charged_tokens(self) -> int: ...

    loads: Mapping[str, int]

    def loaded(self) -> list: ...


class _TokenizerCollector:
    """Read at scrape time: the tokenizers count in worker threads, with no registry of their own."""

    def __init__(self, tokenizers: TokenizersInUse) -> None:
        self.tokenizers = tokenizers

    def collect(self) -> Iterator[Metric]:
        tokenizers = self.tokenizers
        yield CounterMetricFamily(
            "kvroute_router_tokenized_chars",
            "Characters of prompt text handed to the tokenizers (segment-cache hits included; "
            "prompts rejected by their length in characters are not)",
            value=tokenizers.tokenized_chars,
        )
        # Bounded by --tokenizer-cache-tokens per tokenizer: it grows until full, so a soak reads its RSS next to this.
        yield GaugeMetricFamily(
            "kvroute_router_tokenizer_cache_bytes",
            "Estimated memory of the loaded tokenizers' segment caches: 4 bytes per token charged "
            "against --tokenizer-cache-tokens (ids plus each segment's bookkeeping)",
            value=4 * tokenizers.charged_tokens,
        )
        yield GaugeMetricFamily(
            "kvroute_router_tokenizers_loaded",
            "Tokenizers loaded now (at most --max-loaded-tokenizers)",
            value=len(tokenizers.loaded()),
        )
        loads = CounterMetricFamily(
            "kvroute_router_tokenizer_loads",
            "Times a model's tokenizer was loaded (more than once: it was unloaded for others, past --max-loaded-tokenizers)",
            labels=["model"],
        )
        for model, count in sorted(tokenizers.loads.items()):
            loads.add_metric([model], count)
        yield loads


class WorkerStates(Protocol):
    """What the worker-state collector reads at scrape time (data_plane.cli wires the router's own)."""

    def known_workers(self) -> list[str]: ...
    def sitting_out(self) -> frozenset[str]: ...
    def failing_health_checks(self) -> frozenset[str]: ...


class _WorkerStateCollector:
    """Per worker the router knows: healthy (routable), or not: failing its active health checks or
    sitting out after a failed request (the circuit breaker)."""

    def __init__(self, states: WorkerStates) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        states = self.states
        out, down = states.sitting_out(), states.failing_health_checks()
        known = sorted(set(states.known_workers()) | out | down)
        healthy = GaugeMetricFamily(
            "kvroute_router_worker_healthy",
            "1 for a worker the router may send requests to; 0 while it fails its active "
            "health checks or sits out after a failed request "
            "(kvroute_router_worker_sitting_out says which)",
            labels=["worker"],
        )
        sitting = GaugeMetricFamily(
            "kvroute_router_worker_sitting_out",
            "1 while a worker sits out the cooldown after a failed attempt (circuit open)",
            labels=["worker"],
        )
        for worker in known:
            healthy.add_metric([worker], 0 if worker in out or worker in down else 1)
            sitting.add_metric([worker], 1 if worker in out else 0)
        yield healthy
        yield sitting


class _ViewCollector:
    """This router's view of the fleet (--index local): how fresh, how big, how it got there."""

    def __init__(self, view) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view
        counters, state = view.counters, view.state
        silence = view.silence_s()
        yield GaugeMetricFamily(
            "kvroute_router_view_synced",
            "1 once this router's view of the fleet has synced (a snapshot applied), else 0",
            value=1 if view.synced else 0,
        )
        yield GaugeMetricFamily(
            "kvroute_router_view_position",
            "The control plane's feed position the view has applied (changes, numbered per control-plane process)",
            value=view.position.seq if view.position is not None else 0,
        )
        yield GaugeMetricFamily(
            "kvroute_router_view_lag_seconds",
            "How old the newest change applied was when it arrived (control plane's clock against this router's)",
            value=view.lag_s,
        )
        yield GaugeMetricFamily(
            "kvroute_router_view_silence_seconds",
            "Seconds since a control plane was last heard on the follow stream (it sends at least every 0.5 s; -1 = never)",
            value=silence if silence != float("inf") else -1,
        )
        for name, value, what in (
            ("changes", counters.changes, "Changes applied to the view"),
            ("snapshots", counters.snapshots, "Snapshots applied (start, failover, fallen behind)"),
            ("resumes", counters.resumed, "Follow streams resumed from the view's position"),
            ("malformed_changes", counters.malformed, "Changes refused (the view resynchronises)"),
            ("stream_failures", counters.stream_failures, "Follow streams that failed"),
        ):
            yield CounterMetricFamily(f"kvroute_router_view_{name}", what, value=value)
        yield GaugeMetricFamily(
            "kvroute_router_view_workers", "Workers in the view", value=len(state.registry) if state is not None else 0
        )
        yield GaugeMetricFamily(
            "kvroute_router_view_index_entries",
            "(block key, worker, tier) entries in the view's index",
            value=state.index.entry_count() if state is not None else 0,
        )


class DiscoveredTarget(Protocol):
    engines: dict[str, str]
    failures: int
    last_success_unix: float


class Discovering(Protocol):
    """What the discovery collector reads (`engine_discovery.EngineDiscovery`)."""

    states: dict[str, DiscoveredTarget]


class _DiscoveryCollector:
    """Engines found by DNS (--discover-engines), per target as given."""

    def __init__(self, discovery: Discovering) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator[Metric]:
        engines = GaugeMetricFamily(
            "kvroute_router_discovered_engines",
            "Engines the target's DNS answer holds (kept through failed resolutions and an empty answer's grace)",
            labels=["target"],
        )
        failures = CounterMetricFamily(
            "kvroute_router_discovery_failures",
            "Resolutions of the target that failed (timeout, SERVFAIL, refused...): its engines were kept",
            labels=["target"],
        )
        last = GaugeMetricFamily(
            "kvroute_router_discovery_last_success_timestamp_seconds",
            "Unix time of the target's last DNS answer, empty ones included (0 = none yet)",
            labels=["target"],
        )
        for target, state in self.discovery.states.items():
            engines.add_metric([target], len(state.engines))
            failures.add_metric([target], state.failures)
            last.add_metric([target], state.last_success_unix)
        yield engines
        yield failures
        yield last


@dataclass(frozen=True, slots=True)
class ModelTokenCounters:
    """One model's children of the routing-quality counters (RouterMetrics.tokens_of)."""

    prompt: Counter
    predicted_cached: Counter
    engine_prompt: Counter
    engine_cached: Counter


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        register_build_info(r, "router")
        # Every HTTP request the router answers (data_plane.http_api's middleware), by route and status.
        self.http_requests = Counter(
            "kvroute_router_http_requests",
            "HTTP requests answered, by route (the path template; unmatched paths are `other`) and status code",
            ["route", "code"],
            registry=r,
        )
        self.http_request_seconds = Histogram(
            "kvroute_router_http_request_duration_seconds",
            "Time from a request's arrival to its response's last byte, by route",
            ["route"],
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        self.http_in_flight = Gauge("kvroute_router_http_requests_in_flight", "HTTP requests being answered now", registry=r)
        # gRPC Router calls (Route, PrefillDone, Release), by status code (data_plane.grpc_api).
        self.grpc_requests = Counter(
            "kvroute_router_grpc_requests",
            "gRPC Router calls answered, by method and status code (OK, INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE...)",
            ["method", "code"],
            registry=r,
        )
        self.grpc_request_seconds = Histogram(
            "kvroute_router_grpc_request_duration_seconds",
            "Time answering a gRPC Router call, by method",
            ["method"],
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        self.ttft_seconds = Histogram(
            "kvroute_router_time_to_first_token_seconds",
            "Time from a streamed request's arrival to its first body byte relayed to the "
            "client (the engine's prefill plus the router's own work)",
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        # Decisions (HTTP proxy, POST /v1/route and gRPC Route alike).
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds",
            "Routing decision time: block keys + control-plane query + policy",
            registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25),
        )
        self.fail_open = Counter(
            "kvroute_router_fail_open",
            "Decisions made on load alone, without the index, by why: "
            "deadline_exceeded, unavailable (or another gRPC status), index_empty (the control plane "
            "lists no worker of the model yet), index_unknown_workers (none this router knows), "
            "error",
            ["reason"],
            registry=r,
        )
        self.query_deadline_seconds = Gauge(
            "kvroute_router_query_deadline_seconds",
            "The control-plane query's current deadline (adaptive: --query-timeout-*)",
            registry=r,
        )
        # gRPC application path: Route with `reserve` (data_plane/grpc/app_reservations.py).
        self.reservations = Counter(
            "kvroute_router_reservations",
            "Reservations of Route(reserve=true) by event: reserved, then completed, failed, "
            "cancelled (Release's outcome, unspecified if none) or expired (TTL passed)",
            ["event"],
            registry=r,
        )
        self.reservations_held = Gauge(
            "kvroute_router_reservations_held", "Reservations of Route(reserve=true) held now", registry=r
        )
        # Proxied requests, counted on the worker that served them.
        self.proxied_requests = Counter(
            "kvroute_router_proxied_requests",
            "Requests proxied to a worker that answered, by policy and worker",
            ["policy", "worker"],
            registry=r,
        )
        self.backend_errors = Counter(
            "kvroute_router_backend_errors",
            "Backend failures before the first byte (connection refused, 5xx...)",
            ["worker"],
            registry=r,
        )
        self.retries = Counter(
            "kvroute_router_retries", "Attempts sent to the next-best worker after one failed before its first byte", registry=r
        )
        self.sit_outs = Counter(
            "kvroute_router_worker_sit_outs", "Times a worker began sitting out after a failure", ["worker"], registry=r
        )
        # Routing quality: what the router expected cached beside what the engines say they reused.
        # Per model: one router serves several, and each has its own hit rate.
        self.prompt_tokens = Counter(
            "kvroute_router_prompt_tokens", "Prompt tokens of proxied requests, by model", ["model"], registry=r
        )
        self.predicted_cached_tokens = Counter(
            "kvroute_router_predicted_cached_tokens",
            "Prompt tokens of proxied requests the index expected cached on their worker, by model",
            ["model"],
            registry=r,
        )
        self.engine_prompt_tokens = Counter(
            "kvroute_router_engine_prompt_tokens",
            "Prompt tokens of answers whose usage reports cached tokens "
            "(usage.prompt_tokens, as the engine counted them), by model",
            ["model"],
            registry=r,
        )
        self.engine_cached_tokens = Counter(
            "kvroute_router_engine_cached_tokens",
            "Cached prompt tokens the engines reported in their answers (usage.prompt_tokens_details.cached_tokens), by model",
            ["model"],
            registry=r,
        )
        self._token_counters: dict[str, ModelTokenCounters] = {}
        # Traffic capture (--capture-trace): rows written to the trace, rows lost to a full buffer or a failed write.
        self.capture_rows = Counter("kvroute_router_capture_rows", "Mooncake trace rows written by --capture-trace", registry=r)
        self.capture_dropped = Counter(
            "kvroute_router_capture_dropped_rows",
            "Trace rows dropped by --capture-trace (buffer full or write failed)",
            registry=r,
        )
        self._tokenizer_watched = False
        self._workers_watched = False
        self._view_watched = False
        self._discovery_watched = False

    def tokens_of(self, model: str) -> ModelTokenCounters:
        """The routing-quality counters of `model` (children kept: labels() costs a few us per call)."""
        counters = self._token_counters.get(model)
        if counters is None:
            counters = self._token_counters[model] = ModelTokenCounters(
                self.prompt_tokens.labels(model),
                self.predicted_cached_tokens.labels(model),
                self.engine_prompt_tokens.labels(model),
                self.engine_cached_tokens.labels(model),
            )
        return counters

    def watch_discovery(self, discovery: Discovering) -> None:
        """Export what --discover-engines found, read at scrape time (once)."""
        if not self._discovery_watched:
            self.registry.register(_DiscoveryCollector(discovery))
            self._discovery_watched = True

    def watch_view(self, view) -> None:
        """Export the view's freshness and size (--index local), read at scrape time (once)."""
        if not self._view_watched:
            self.registry.register(_ViewCollector(view))
            self._view_watched = True

    def watch_workers(self, states: WorkerStates) -> None:
        """Export each known worker's health and sit-out state, read from `states` at scrape time (once)."""
        if not self._workers_watched:
            self.registry.register(_WorkerStateCollector(states))
            self._workers_watched = True

    def watch_tokenizers(self, tokenizers: TokenizersInUse) -> None:
        """Export what the tokenizers did and hold, read at scrape time (once per registry)."""
        if not self._tokenizer_watched:
            self.registry.register(_TokenizerCollector(tokenizers))
            self._tokenizer_watched = True
