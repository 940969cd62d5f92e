"""OpenAI-compatible HTTP front of the router.

A request's path: parse + validate -> tokenize (model's own tokenizer / chat template) ->
Router.decide -> proxy the original body to the chosen engine, SSE streamed through
unbuffered, with W3C trace context and `x-kvroute-worker` on the response. A backend that
refuses or fails before its first byte is retried on the next-best worker.
"""

from __future__ import annotations

import json
import logging
import time

import aiohttp
from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from data_plane.load_tracker import LoadTracker
from data_plane.routing import NoWorkersError, RouteDecision, Router
from data_plane.tokenization import PromptTokenizer, TokenizationError

log = logging.getLogger("kvroute.router.http")
tracer = trace.get_tracer("kvroute.router")
WORKER_HEADER = "x-kvroute-worker"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(message: str, status: int, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("kvroute_router_requests", "Requests routed", ["policy", "worker"], registry=registry)
        self.decision_seconds = Histogram("kvroute_router_decision_seconds", "Tokenize+hash+query+score time",
                                          registry=registry, buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
        self.fail_open = Counter("kvroute_router_fail_open", "Decisions made without the index", registry=registry)
        self.backend_errors = Counter("kvroute_router_backend_errors", "Backend failures before the first byte",
                                      ["worker"], registry=registry)
        self.cached_tokens = Counter("kvroute_router_cached_tokens", "Prompt tokens expected cached", registry=registry)
        self.prompt_tokens = Counter("kvroute_router_prompt_tokens", "Prompt tokens routed", registry=registry)


class RouterHttpApi:
    def __init__(self, router: Router, tokenizer: PromptTokenizer, model: str, load: LoadTracker,
                 max_prompt_tokens: int = 131072, backend_timeout_s: float = 600.0) -> None:
        self.router, self.tokenizer, self.model, self.load = router, tokenizer, model, load
        self.max_prompt_tokens = max_prompt_tokens
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self._backend_timeout = aiohttp.ClientTimeout(total=backend_timeout_s, sock_connect=2.0)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/route", self.handle_route)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get("/metrics", self.handle_metrics)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._backend_timeout,
                                              auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session:
            await self._session.close()

    # ------------------------------------------------------------ parsing

    async def _parse(self, request: web.Request) -> tuple[dict, list[int]]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required")
        if model != self.model:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "model_not_found")
        try:
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list) or not messages:
                    raise BadRequest("'messages' must be a non-empty list")
                tokens = self.tokenizer.encode_chat(messages)
            elif "prompt" in body:
                prompt = body["prompt"]
                if isinstance(prompt, str):
                    tokens = self.tokenizer.encode_prompt(prompt)
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
                    tokens = prompt
                else:
                    raise BadRequest("'prompt' must be a string or a non-empty list of token ids")
            else:
                raise BadRequest("either 'prompt' or 'messages' is required")
        except TokenizationError as exc:
            raise BadRequest(str(exc)) from exc
        if len(tokens) > self.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(tokens)} tokens, more than this router accepts "
                             f"({self.max_prompt_tokens}; see --max-prompt-tokens)")
        return body, tokens

    async def _decide(self, body: dict, tokens: list[int], exclude: frozenset[str] = frozenset()) -> RouteDecision:
        started = time.perf_counter()
        decision = await self.router.decide(self.model, tokens, str(body.get("lora_name") or ""),
                                            str(body.get("cache_salt") or ""), exclude)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if decision.fail_open:
            self.metrics.fail_open.inc()
        return decision

    # ------------------------------------------------------------ handlers

    async def _parse_and_decide(self, request: web.Request) -> tuple[dict, list[int], RouteDecision] | web.Response:
        """The decision for a request, or the error response the client gets instead."""
        try:
            body, tokens = await self._parse(request)
            return body, tokens, await self._decide(body, tokens)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.code)
        except NoWorkersError as exc:
            return error_response(str(exc), 503, "no_workers")

    async def handle_route(self, request: web.Request) -> web.Response:
        outcome = await self._parse_and_decide(request)
        if isinstance(outcome, web.Response):
            return outcome
        return web.json_response(outcome[2].as_json())

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions")

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions")

    async def _proxy(self, request: web.Request, path: str) -> web.StreamResponse:
        outcome = await self._parse_and_decide(request)
        if isinstance(outcome, web.Response):
            return outcome
        _, tokens, decision = outcome
        raw = await request.read()  # the client's own bytes, not a re-serialisation (aiohttp caches the body)
        for attempt, candidate in enumerate(decision.ranked()):
            result = await self._forward(request, path, raw, decision, candidate, tokens)
            if result is not None:
                return result
            log.warning("backend %s failed before the first byte; retrying on the next-best worker",
                        candidate.worker_id)
            if attempt >= 2:
                break
        return error_response("no backend could serve the request", 502, "backend_unavailable")

    async def _forward(self, request: web.Request, path: str, raw: bytes, decision: RouteDecision, candidate,
                       tokens: list[int]) -> web.StreamResponse | None:
        """Proxy to one backend; None if it failed before sending anything (safe to retry)."""
        assert self._session is not None
        worker = candidate.worker_id
        ticket = self.load.start(worker, max(0, len(tokens) - candidate.cached_tokens))
        self.metrics.requests.labels(decision.policy, worker).inc()
        self.metrics.prompt_tokens.inc(len(tokens))
        self.metrics.cached_tokens.inc(candidate.cached_tokens)
        headers = {"Content-Type": "application/json"}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        with tracer.start_as_current_span("kvroute.proxy", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvroute.worker_id", worker)
            propagate.inject(headers)
            try:
                upstream = await self._session.post(candidate.endpoint + path, data=raw, headers=headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self.metrics.backend_errors.labels(worker).inc()
                span.record_exception(exc)
                self.load.finish(ticket)
                return None
            response: web.StreamResponse | None = None
            try:
                if upstream.status >= 500:
                    self.metrics.backend_errors.labels(worker).inc()
                    return None
                response = web.StreamResponse(status=upstream.status)
                for name, value in upstream.headers.items():
                    if name.lower() not in _HOP_HEADERS:
                        response.headers[name] = value
                response.headers[WORKER_HEADER] = worker
                first = True
                async for chunk in upstream.content.iter_any():
                    if first:
                        self.load.first_token(ticket)
                        await response.prepare(request)
                        first = False
                    await response.write(chunk)
                if first:
                    await response.prepare(request)
                await response.write_eof()
                return response
            except (aiohttp.ClientError, OSError) as exc:
                span.record_exception(exc)
                if response is None or not response.prepared:
                    self.metrics.backend_errors.labels(worker).inc()
                    return None
                raise  # mid-stream: the client already has bytes, so its connection is aborted
            finally:
                upstream.release()
                self.load.finish(ticket)

    async def handle_models(self, request: web.Request) -> web.Response:
        models = self.router.control_plane.models() or {self.model}
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvroute"}
                                                             for m in sorted(models) if m == self.model]})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
