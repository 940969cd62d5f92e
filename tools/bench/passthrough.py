"""The floor of the router's HTTP stack: the router's own server set-up and `BackendProxy`,
forwarding every request to one engine with no decision at all (no parsing, tokenizing, query or
policy). `kvroute bench proxy` runs it next to the routers; what a router adds over it is the
decision and its bookkeeping, what it adds over a direct request is the stack itself.

    python -m kvroute.tools.bench.passthrough --engine http://127.0.0.1:8000 --port 8090
"""

from __future__ import annotations

import argparse

from aiohttp import web

from kvroute import aio
from kvroute.addresses import http_url, listen_host, port
from kvroute.data_plane.api.errors import openai_errors
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import Candidate
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.http.proxy import BackendProxy
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.service.routing import RouteDecision
from kvroute.process import wait_for_stop_signal

WORKER_ID = "passthrough-0"


def passthrough_app(engine_url: str) -> web.Application:
    proxy = BackendProxy(RouterInflight(), BackendHealth(), RouterMetrics())
    decision = RouteDecision(WORKER_ID, engine_url, 0, 0, "passthrough", False, [Candidate(WORKER_ID, engine_url, 16)])

    async def forward(request: web.Request) -> web.StreamResponse:
        return await proxy.forward(request, request.path, await request.read(), decision, 0)

    app = web.Application(middlewares=[openai_errors])  # as the router's
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", lambda _request: web.json_response({"status": "ok"}))
    app.on_startup.append(lambda _app: proxy.open())
    app.on_cleanup.append(lambda _app: proxy.close())
    return app


async def serve(engine_url: str, host: str, port: int) -> int:
    runner = web.AppRunner(passthrough_app(engine_url.rstrip("/")), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        await wait_for_stop_signal()
    finally:
        await runner.cleanup()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=http_url, required=True, help="engine base URL")
    p.add_argument("--host", type=listen_host, default="127.0.0.1")
    p.add_argument("--port", type=port, required=True)
    args = p.parse_args()
    return aio.run(serve(args.engine, args.host, args.port))


if __name__ == "__main__":
    raise SystemExit(main())
