"""The router's Prometheus metrics, one CollectorRegistry per router instance (GET /metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class ChargesTokens(Protocol):
    @property
    def charged_tokens(self) -> int: ...


class CountsTokenizedChars(Protocol):
    tokenized_chars: int
    segment_cache: ChargesTokens | None


class _TokenizerCollector:
    """Read at scrape time: the tokenizer counts in worker threads, with no registry of its own."""

    def __init__(self, tokenizer: CountsTokenizedChars) -> None:
        self.tokenizer = tokenizer

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvroute_router_tokenized_chars",
                                  "Characters of prompt text handed to the tokenizer (segment-cache hits included; "
                                  "prompts rejected by their length in characters are not)",
                                  value=self.tokenizer.tokenized_chars)
        cache = self.tokenizer.segment_cache
        # Bounded by --tokenizer-cache-tokens: it grows until full, so a soak reads its RSS next to this.
        yield GaugeMetricFamily("kvroute_router_tokenizer_cache_bytes",
                                "Estimated memory of the tokenizer's segment cache: 4 bytes per token charged "
                                "against --tokenizer-cache-tokens (ids plus each segment's bookkeeping)",
                                value=4 * cache.charged_tokens if cache is not None else 0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # Decisions (HTTP proxy, POST /v1/route and gRPC Route alike).
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds", "Routing decision time: block keys + control-plane query + policy",
            registry=r, buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25))
        self.fail_open = Counter("kvroute_router_fail_open", "Decisions made on load alone, without the index, by why: "
                                 "deadline_exceeded, unavailable (or another gRPC status), index_empty (the control plane "
                                 "lists no worker of the model yet), index_unknown_workers (none this router knows), "
                                 "error", ["reason"], registry=r)
        self.query_deadline_seconds = Gauge("kvroute_router_query_deadline_seconds",
                                            "The control-plane query's current deadline (adaptive: --query-timeout-*)",
                                            registry=r)
        # gRPC application path: Route with `reserve` (data_plane/app_reservations.py).
        self.reservations = Counter("kvroute_router_reservations",
                                    "Reservations of Route(reserve=true) by event: reserved, then completed, failed, "
                                    "cancelled (Release's outcome, unspecified if none) or expired (TTL passed)",
                                    ["event"], registry=r)
        self.reservations_held = Gauge("kvroute_router_reservations_held",
                                       "Reservations of Route(reserve=true) held now", registry=r)
        # Proxied requests, counted on the worker that served them.
        self.requests = Counter("kvroute_router_requests", "Requests proxied to a worker", ["policy", "worker"],
                                registry=r)
        self.backend_errors = Counter("kvroute_router_backend_errors",
                                      "Backend failures before the first byte (connection refused, 5xx...)",
                                      ["worker"], registry=r)
        self.prompt_tokens = Counter("kvroute_router_prompt_tokens", "Prompt tokens of proxied requests",
                                     registry=r)
        self.cached_tokens = Counter("kvroute_router_cached_tokens",
                                     "Prompt tokens of proxied requests the index expected cached on their worker",
                                     registry=r)
        # Traffic capture (--capture-trace): rows written to the trace, rows lost to a full buffer or a failed write.
        self.capture_rows = Counter("kvroute_capture_rows", "Mooncake trace rows written by --capture-trace",
                                    registry=r)
        self.capture_dropped = Counter("kvroute_capture_dropped",
                                       "Trace rows dropped by --capture-trace (buffer full or write failed)",
                                       registry=r)
        self._tokenizer_watched = False

    def watch_tokenizer(self, tokenizer: CountsTokenizedChars) -> None:
        """Export `tokenizer.tokenized_chars` as kvroute_router_tokenized_chars_total (once per registry)."""
        if not self._tokenizer_watched:
            self.registry.register(_TokenizerCollector(tokenizer))
            self._tokenizer_watched = True
