"""What every process answers about itself: GET /metrics, /health (liveness) and /ready (readiness),
from one readiness type.

    readiness = Readiness(fatal=["engine not answering"], warnings=[], details={"workers": 2})
    readiness.ready, readiness.status          # False, "not_ready"
    routes = status_routes(registry, health=lambda: {...}, readiness=lambda: readiness)
    runner, port = await start_status_site("--metrics-port", host, port, routes)   # kvroute/listeners.py

/ready answers 200 when nothing fatal is wrong ("ready", or "degraded" with warnings) and 503 when
something is ("not_ready"); its JSON is `Readiness.body()`: the status, the process's details, and
every problem, fatal ones first. /health is liveness: 200 with what the process says of itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry


@dataclass(frozen=True, slots=True)
class Readiness:
    fatal: list[str] = field(default_factory=list)  # each one makes the process not ready
    warnings: list[str] = field(default_factory=list)  # ready, but degraded
    details: dict = field(default_factory=dict)  # the process's own fields of the /ready JSON

    @property
    def ready(self) -> bool:
        return not self.fatal

    @property
    def status(self) -> str:
        return "not_ready" if self.fatal else "degraded" if self.warnings else "ready"

    @property
    def problems(self) -> list[str]:
        return self.fatal + self.warnings

    def body(self) -> dict:
        """The JSON of GET /ready."""
        return {"status": self.status, **self.details, "problems": self.problems}


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def ready_handler(readiness: Callable[[], Readiness]) -> Handler:
    from aiohttp import web

    async def ready(_request: web.Request) -> web.Response:
        now = readiness()
        return web.json_response(now.body(), status=200 if now.ready else 503)

    return ready


def health_handler(health: Callable[[], dict]) -> Handler:
    from aiohttp import web

    async def alive(_request: web.Request) -> web.Response:
        return web.json_response(health())

    return alive


def status_routes(
    registry: CollectorRegistry, *, health: Callable[[], dict], readiness: Callable[[], Readiness]
) -> dict[str, Handler]:
    """GET /metrics (the registry, in Prometheus' text format or OpenMetrics as asked), /health, /ready."""
    from prometheus_client.aiohttp import make_aiohttp_handler

    return {"/metrics": make_aiohttp_handler(registry), "/health": health_handler(health), "/ready": ready_handler(readiness)}
