"""The router's Prometheus metrics, one CollectorRegistry per router instance (GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # Decisions (HTTP proxy, POST /v1/route and gRPC Route alike).
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds", "Routing decision time: block keys + control-plane query + policy",
            registry=r, buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25))
        self.fail_open = Counter("kvroute_router_fail_open", "Decisions made on load alone, without the index",
                                 registry=r)
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
