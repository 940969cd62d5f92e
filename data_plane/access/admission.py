"""Who gets in and how many at once: the router's API keys and its concurrency limit, in front of the
HTTP handlers (an aiohttp middleware) and the gRPC Router API (a server interceptor).

HTTP, in this order (each an OpenAI error object, `api/errors.py`):
    401 invalid_api_key     no `Authorization: Bearer`, or a key that is not configured
                            (with `WWW-Authenticate: Bearer`)
    403 permission_denied   a `scope=route` key asking for a proxied request
    429 too_many_requests   `--max-concurrent-requests` requests already in progress (with
                            `Retry-After`): refused at once, never queued, so a burst costs the
                            router no memory and the client learns at once that it should back off
GET /health, /ready and /metrics are always open (probes and scrapers carry no keys).
gRPC `kvroute.v1.Router/*`: UNAUTHENTICATED / PERMISSION_DENIED for the same cases (metadata
`authorization: Bearer <key>`); grpc.health.v1 and reflection stay open.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvroute.data_plane.access.api_keys import ApiKeys, Verdict
from kvroute.data_plane.api.errors import error_response
from kvroute.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvroute.router.auth")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
ROUTE_ONLY_PATHS = frozenset({"/v1/route", "/v1/models"})  # answered by the router itself, nothing proxied
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
RETRY_AFTER_S = 1
ROUTER_SERVICE_PREFIX = "/kvroute.v1.Router/"

_MESSAGES = {
    Verdict.MISSING: "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
    Verdict.INVALID: "Incorrect API key provided.",
    Verdict.FORBIDDEN: "This API key may only ask for routing decisions (scope=route), not proxied requests.",
}


class Admission:
    """API keys (optional) and the concurrency limit; counts what it refuses."""

    def __init__(self, keys: ApiKeys, max_concurrent: int, registry: CollectorRegistry) -> None:
        self.keys = keys
        self.max_concurrent = max_concurrent
        self.active = 0
        self.refused = Counter(
            "kvroute_router_refused_requests_total",
            "Requests refused before routing: unauthenticated (401), forbidden (403), over_capacity (429)",
            ["reason"],
            registry=registry,
        )
        Gauge(
            "kvroute_router_requests_in_progress",
            "HTTP requests in progress (limit: --max-concurrent-requests)",
            registry=registry,
        ).set_function(lambda: self.active)
        self._log = RateLimitedLog(log, period_s=30.0)

    def _refuse(self, reason: str, peer: str | None, why: str) -> None:
        self.refused.labels(reason).inc()
        self._log.warning(f"{reason}:{peer}", "refused a request from %s: %s", peer or "unknown peer", why)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        verdict, _key = self.keys.check(request.headers.get("Authorization"), proxied=request.path not in ROUTE_ONLY_PATHS)
        if verdict in (Verdict.MISSING, Verdict.INVALID):
            self._refuse("unauthenticated", request.remote, verdict.value)
            return error_response(
                _MESSAGES[verdict], 401, "invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="kvroute"'}
            )
        if verdict is Verdict.FORBIDDEN:
            self._refuse("forbidden", request.remote, f"key {_key.name if _key else '?'} has scope=route")
            return error_response(_MESSAGES[verdict], 403, "permission_denied")
        if self.active >= self.max_concurrent:
            self.refused.labels("over_capacity").inc()
            return error_response(
                f"The router is serving its limit of {self.max_concurrent} concurrent requests "
                "(--max-concurrent-requests); retry shortly.",
                429,
                "too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """API keys on the gRPC Router API (metadata `authorization: Bearer <key>`)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        if not handler_call_details.method.startswith(ROUTER_SERVICE_PREFIX) or not self.admission.keys.enabled:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        verdict, _ = self.admission.keys.check(metadata.get("authorization"), proxied=False)
        if verdict in (Verdict.OPEN, Verdict.ALLOWED):
            return await continuation(handler_call_details)
        code = grpc.StatusCode.PERMISSION_DENIED if verdict is Verdict.FORBIDDEN else grpc.StatusCode.UNAUTHENTICATED
        reason = "forbidden" if verdict is Verdict.FORBIDDEN else "unauthenticated"
        self.admission._refuse(reason, None, f"gRPC {handler_call_details.method}: {verdict.value}")
        message = _MESSAGES[verdict].replace("`Authorization: Bearer <key>`", "metadata `authorization: Bearer <key>`")

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(deny)
