"""OpenAI-compatible HTTP front of the router: where a request's path starts.

    POST /v1/chat/completions, /v1/completions
        _parse: JSON body -> validate -> token ids (tokenization.py: the model's own tokenizer
                and chat template)
        Router.decide (routing.py): block keys per block size -> control-plane query -> policy
                (session key for the session policy: `x-session-id` header, else the body's `user`)
        BackendProxy.forward (proxy.py): the original body to the chosen engine, streamed back
    POST /v1/route      the decision alone, as JSON (same body as completions or chat)
    GET  /v1/models, /health (liveness), /ready (readiness.py), /metrics

Bad input is a 400 with an OpenAI-style error (unknown model: 404); no worker known: 503.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from data_plane.proxy import BackendProxy, error_response
from data_plane.readiness import RouterReadiness, router_readiness
from data_plane.routing import NoWorkersError, Router
from data_plane.tokenization import THREAD_TOKENIZE_CHARS, PromptTokenizer, TokenizationError
from data_plane.traffic_capture import TrafficCapture, reported_output_tokens, requested_output_tokens

log = logging.getLogger("kvroute.router.http")
tracer = trace.get_tracer("kvroute.router")

SESSION_HEADER = "x-session-id"
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | int | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.error_type = status, code, error_type


def _is_token_ids(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value))


def _session_key(request: web.Request, body: dict) -> str:
    """The session policy's key: the `x-session-id` header, else OpenAI's end-user id (`user`), else ""."""
    header = request.headers.get(SESSION_HEADER, "").strip()
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) else ""


class RouterHttpApi:
    def __init__(self, router: Router, tokenizer: PromptTokenizer, model: str, max_prompt_tokens: int = 131072,
                 proxy: BackendProxy | None = None, capture: TrafficCapture | None = None) -> None:
        self.router, self.tokenizer, self.model = router, tokenizer, model
        self.capture = capture  # --capture-trace: proxied requests only (/v1/route is also a probe)
        self.max_prompt_tokens = max_prompt_tokens
        self.metrics = router.metrics
        self.proxy = proxy or BackendProxy(router.load, router.metrics)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/route", self.handle_route)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        app.on_startup.append(lambda _app: self.proxy.open())
        app.on_cleanup.append(lambda _app: self.proxy.close())
        return app

    # ------------------------------------------------------------ handlers

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", forward_to="/v1/chat/completions")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", forward_to="/v1/completions")

    async def handle_route(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "either", forward_to=None)

    async def _handle(self, request: web.Request, kind: str, forward_to: str | None) -> web.StreamResponse:
        """parse -> decide -> proxy (or, for /v1/route, the decision as JSON), in a server span
        joined to the caller's trace (W3C traceparent)."""
        with tracer.start_as_current_span(f"POST {request.path}", context=propagate.extract(request.headers),
                                          kind=trace.SpanKind.SERVER):
            arrived = self.capture.sample_arrival() if self.capture and forward_to else None
            try:
                raw, body, tokens = await self._parse(request, kind)
                lora_name, cache_salt = self._lora_name(body), str(body.get("cache_salt") or "")
                decision = await self.router.decide(self.model, tokens, lora_name, cache_salt,
                                                    avoid=self.proxy.avoided(), session_key=_session_key(request, body))
            except BadRequest as exc:
                return error_response(str(exc), exc.status, exc.error_type, exc.code)
            except NoWorkersError as exc:
                return error_response(str(exc), 503, "service_unavailable", "no_workers")
            if forward_to is None:
                return web.json_response(decision.as_json())
            tail = bytearray() if arrived is not None else None  # only a captured response keeps its end
            response = await self.proxy.forward(request, forward_to, raw, decision, len(tokens), tail)
            if tail is not None and response.status < 400:  # the engine did the work; errors are not worth replaying
                output = reported_output_tokens(tail)
                self.capture.record(arrived, tokens, requested_output_tokens(body) if output is None else output,
                                    self.model, lora_name, cache_salt)
            return response

    async def handle_models(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        data = []
        if cp.workers_for(self.model):
            data.append({"id": self.model, "object": "model", "owned_by": "kvroute"})
            data += [{"id": a, "object": "model", "owned_by": "kvroute", "parent": self.model}
                     for a in sorted(cp.adapters_of(self.model))]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        return web.json_response({"status": "ok", "model": self.model, "policy": self.router.policy.name,
                                  "workers": len(cp.workers_for(self.model)),
                                  "control_plane": "reachable" if cp.reachable else "unreachable"})

    def readiness(self) -> RouterReadiness:
        return router_readiness(self.router.control_plane, self.model, self.proxy.avoided(), self.proxy.cooldown_s)

    async def handle_ready(self, request: web.Request) -> web.Response:
        readiness = self.readiness()
        return web.json_response(readiness.body, status=200 if readiness.ready else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------ parsing

    def _lora_name(self, body: dict) -> str:
        """vLLM's way: the adapter is named as the request's `model`; a `lora_name` field also works."""
        if body["model"] != self.model:
            return body["model"]
        return str(body.get("lora_name") or "")

    async def _parse(self, request: web.Request, kind: str) -> tuple[bytes, dict, list[int]]:
        """(original body bytes, parsed body, prompt token ids); kind is chat, completions or either."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required (a string)")
        if model != self.model and model not in self.router.control_plane.adapters_of(self.model):
            raise BadRequest(f"The model `{model}` does not exist.", 404, "model_not_found")
        if kind == "chat" or (kind == "either" and "messages" in body):
            tokens = await self._chat_tokens(body)
        elif "prompt" in body:
            tokens = await self._completion_tokens(body["prompt"])
        elif kind == "completions":
            raise BadRequest("'prompt' is required (a string, a list of token ids, or a list of those)")
        else:
            raise BadRequest("either 'prompt' or 'messages' is required")
        return raw, body, tokens

    async def _chat_tokens(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required (a non-empty list of messages)")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        extra = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
        extra = {k: v for k, v in extra.items() if k not in _RESERVED_TEMPLATE_VARS}
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        size = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
        return self._check_length(await self._tokenize(
            size, self.tokenizer.encode_chat, messages, add_generation_prompt, tools, **extra))

    async def _completion_tokens(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self._check_length(await self._tokenize(len(prompt), self.tokenizer.encode_prompt, prompt))
        if _is_token_ids(prompt):
            return self._check_length(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
            # A batch goes to one worker: route on its first prompt; every prompt must fit.
            batch = [await self._completion_tokens(p) for p in prompt]
            return batch[0]
        raise BadRequest("'prompt' must be a string, a non-empty list of token ids, or a list of those")

    async def _tokenize(self, size: int, fn, *args, **kwargs) -> list[int]:
        try:
            if size > THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(fn, *args, **kwargs)
            return fn(*args, **kwargs)
        except TokenizationError as exc:
            raise BadRequest(str(exc)) from exc

    def _check_length(self, tokens: list[int]) -> list[int]:
        if len(tokens) > self.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(tokens)} tokens, more than this router accepts "
                             f"({self.max_prompt_tokens}; see --max-prompt-tokens)", code="context_length_exceeded")
        return tokens
