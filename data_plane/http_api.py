"""OpenAI-compatible HTTP front of the router: where a request's path starts.

    POST /v1/chat/completions, /v1/completions
        _parse: JSON body -> the routing fields (model, prompt or messages, adapter, salt,
                session key)
        RequestPreparer.prepare (request_prep.py, shared with gRPC): model/adapter check,
                token ids (the model's own tokenizer and chat template), length check
                (one router serves every model its fleet serves: each request is routed among
                the workers of its own model)
        Router.decide (routing.py): block keys per block size -> control-plane query -> policy
                (session key for the session policy: `x-session-id` header, else the body's `user`)
        BackendProxy.forward (proxy.py): the original body to the chosen engine, streamed back
    POST /v1/route      the decision alone, as JSON (same body as completions or chat);
                        ?explain=1 adds why: per candidate the policy's cost terms and the index's answer
    GET  /v1/models (every model some worker serves, and their LoRA adapters), /health (liveness),
         /ready (readiness.py), /metrics

Every error is OpenAI's error object (`http_errors.py`): bad input 400, unknown model 404, body
over `max_body_bytes` 413 (refused from its Content-Length before it is read, or as soon as a
chunked body passes the cap), no worker known 503. A prompt longer than `max_prompt_tokens` is a
400 `context_length_exceeded`, from its characters alone when it is past the tokenizer's
character bound (`char_bound.py`), so megabytes of text are never tokenized to find that out.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry import propagate, trace
from prometheus_client import Counter, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

from kvroute.data_plane.admission import Admission
from kvroute.data_plane.http_errors import error_response, openai_errors
from kvroute.data_plane.proxy import BackendProxy
from kvroute.data_plane.readiness import RouterReadiness, router_readiness, served_models
from kvroute.data_plane.request_prep import PrepareError, RequestPreparer, RouteInput
from kvroute.data_plane.routing import NoWorkersError, Router
from kvroute.data_plane.stage_timing import StageSamples
from kvroute.data_plane.tokenization import lone_surrogate
from kvroute.data_plane.traffic_capture import (
    TrafficCapture,
    reported_cached_tokens,
    reported_output_tokens,
    reported_usage,
    requested_output_tokens,
)
from kvroute.telemetry import tracing_active

log = logging.getLogger("kvroute.router.http")
tracer = trace.get_tracer("kvroute.router")

SESSION_HEADER = "x-session-id"
# 131072 tokens of chat as JSON is ~0.5 MB of English, ~1.2 MB of CJK written as \uXXXX escapes
# (Python's json.dumps default): 4 MiB is three times the worst of those. Inline images
# (base64 content parts, not tokenized here) may need more: --max-body-bytes.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_ROUTING_FIELDS = ("model", "lora_name", "cache_salt", "user")  # strings the router hashes or compares
# PrepareError.kind -> (HTTP status, OpenAI error code)
_PREPARE_STATUS = {"invalid": (400, None), "model_not_found": (404, "model_not_found"),
                   "too_long": (400, "context_length_exceeded")}


class RoutingFields(msgspec.Struct):
    """The body fields the router reads; everything else goes to the engine untouched."""
    model: Any = None
    messages: Any = msgspec.UNSET  # UNSET: absent (for /v1/route, which takes either kind)
    prompt: Any = None
    lora_name: Any = None
    cache_salt: Any = None
    user: Any = None
    tools: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = True
    max_tokens: Any = None
    max_completion_tokens: Any = None

    def requested_output_tokens(self) -> int:
        return requested_output_tokens({"max_tokens": self.max_tokens,
                                        "max_completion_tokens": self.max_completion_tokens})


_FIELDS_DECODER = msgspec.json.Decoder(RoutingFields)
_FIELD_NAMES = RoutingFields.__struct_fields__


def _fields_from_json(raw: bytes) -> RoutingFields:
    """The slow path: Python's json (it keeps lone surrogates, so they can be named) and its errors."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # also an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name in _ROUTING_FIELDS:
        if (found := lone_surrogate(body.get(name), name)) is not None:
            raise BadRequest(f"{found} contains a lone UTF-16 surrogate: text must be valid Unicode", param=name)
    return RoutingFields(**{name: body[name] for name in _FIELD_NAMES if name in body})


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _asks_to_explain(request: web.Request) -> bool:
    return request.query.get("explain", "").lower() in ("1", "true", "yes")


def _body_too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"the request body ({size} bytes) is larger than this router accepts ({limit} bytes; "
                      "see --max-body-bytes)", 413, "request_too_large")


def _session_key(request: web.Request, body: dict) -> str:
    return session_key_of(request.headers, body)


def session_key_of(headers: Mapping[str, str], body: dict) -> str:
    """The session policy's key: the `x-session-id` header, else OpenAI's end-user id (`user`), else ""."""
    header = headers.get(SESSION_HEADER, "").strip()
    if header:
        # aiohttp keeps undecodable header bytes as lone surrogates (surrogateescape); the key is hashed as UTF-8.
        if lone_surrogate(header, SESSION_HEADER) is not None:
            raise BadRequest(f"the {SESSION_HEADER} header is not valid UTF-8")
        return header
    user = body.get("user")
    return user if isinstance(user, str) else ""


class RouterHttpApi:
    def __init__(self, router: Router, proxy: BackendProxy, preparer: RequestPreparer,
                 capture: TrafficCapture | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 stages: StageSamples | None = None, admission: Admission | None = None) -> None:
        self.router, self.proxy, self.preparer = router, proxy, preparer
        self.admission = admission  # API keys and the concurrency limit (admission.py); None: everyone, unbounded
        self.stages = stages  # --stage-timing: per-stage samples at GET /debug/stages
        self._policy_reads_tokens = router.policy.needs.tokens
        self.model, max_prompt_tokens = preparer.tokenizers.default_model, preparer.max_prompt_tokens
        self.capture = capture  # --capture-trace: proxied requests only (/v1/route is also a probe)
        self.max_body_bytes = max_body_bytes
        self.metrics = router.metrics
        self.metrics.watch_tokenizers(preparer.tokenizers)
        self.metrics.watch_workers(self)
        self._answers: dict[tuple[str, int], tuple[Counter, Histogram]] = {}  # (route, status) -> its children
        default_tokenizer = preparer.tokenizers.loaded_now(self.model)
        bound = default_tokenizer.char_bound if default_tokenizer is not None else None
        # Logged by the caller once the listeners are up (a port in use must be the only line printed).
        if bound is None:
            self.prompt_bound_note = f"model {self.model}: its tokenizer loads with its first request"
        elif bound.chars_per_token is None:
            self.prompt_bound_note = (f"no character bound on prompts ({bound.why}): every prompt under "
                                      "--max-body-bytes is tokenized")
        else:
            self.prompt_bound_note = (f"prompts over {bound.max_chars(max_prompt_tokens)} characters are rejected "
                                      f"without tokenizing ({bound.chars_per_token} per token: {bound.why})")

    def app(self) -> web.Application:
        middlewares = [self._count_requests, openai_errors]
        if self.admission is not None:
            middlewares.append(self.admission.middleware)
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=middlewares)
        for path, handler in (("/v1/completions", self.handle_completions), ("/v1/chat/completions", self.handle_chat),
                              ("/v1/route", self.handle_route)):
            app.router.add_post(path, handler, expect_handler=self._expect_body)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", make_aiohttp_handler(self.metrics.registry))
        if self.stages is not None:
            app.router.add_get("/debug/stages", self.handle_stages)
        app.on_startup.append(lambda _app: self.proxy.open())
        app.on_cleanup.append(lambda _app: self.proxy.close())
        return app

    # ------------------------------------------------------------ metrics

    @web.middleware
    async def _count_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer by route template and status, its duration, and how many are being answered."""
        started = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        status = 500  # an exception that escapes openai_errors (a stream that broke after its first byte)
        self.metrics.http_in_flight.inc()
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.metrics.http_in_flight.dec()
            counted = self._answers.get((route, status))
            if counted is None:  # labels() costs a few us per call: keep the children per (route, status)
                counted = self._answers[(route, status)] = (self.metrics.http_requests.labels(route, str(status)),
                                                            self.metrics.http_request_seconds.labels(route))
            counted[0].inc()
            counted[1].observe(time.perf_counter() - started)

    def served_models(self) -> list[str]:
        """Every model some known worker serves, the default one first."""
        return served_models(self.router.control_plane, self.model)

    def known_workers(self) -> list[str]:
        """Worker ids the router may route requests to (RouterMetrics' worker-state collector)."""
        cp = self.router.control_plane
        return list(dict.fromkeys(w.worker_id for m in self.served_models() for w in cp.workers_for(m)))

    def sitting_out(self) -> frozenset[str]:
        return self.router.health.cooling_down()

    def failing_health_checks(self) -> frozenset[str]:
        return self.router.health.down()

    # ------------------------------------------------------------ handlers

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", forward_to="/v1/chat/completions")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", forward_to="/v1/completions")

    async def handle_route(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "either", forward_to=None)

    async def _handle(self, request: web.Request, kind: str, forward_to: str | None) -> web.StreamResponse:
        """parse -> prepare -> decide -> proxy (or, for /v1/route, the decision as JSON), in a server
        span joined to the caller's trace (W3C traceparent) while tracing is active."""
        if not tracing_active():
            return await self._serve(request, kind, forward_to)
        with tracer.start_as_current_span(f"POST {request.path}", context=propagate.extract(request.headers),
                                          kind=trace.SpanKind.SERVER):
            return await self._serve(request, kind, forward_to)

    async def _serve(self, request: web.Request, kind: str, forward_to: str | None) -> web.StreamResponse:
        started = time.perf_counter()
        clock = self.stages.start() if self.stages is not None else None
        arrived = self.capture.sample_arrival() if self.capture and forward_to else None
        try:
            raw, fields, parsed = await self._parse(request, kind)
            if clock is not None:
                clock.mark("parse")
            # A proxied request is tokenized only for a policy that reads tokens (or a trace that records
            # them); /v1/route always is: its answer reports the prompt's length.
            tokenize = forward_to is None or self._policy_reads_tokens or arrived is not None
            prepared = await self.preparer.prepare(parsed, tokenize=tokenize)
            if clock is not None:
                clock.mark("prepare")
            decision = await self.router.decide(prepared.model, prepared.token_ids, prepared.lora_name,
                                                prepared.cache_salt, session_key=prepared.session_key, clock=clock,
                                                explain=forward_to is None and _asks_to_explain(request))
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.code, exc.param)
        except PrepareError as exc:
            status, code = _PREPARE_STATUS[exc.kind]
            return error_response(str(exc), status, code, exc.param)
        except NoWorkersError as exc:
            return error_response(str(exc), 503, "no_workers")
        except RecursionError:  # msgspec, json and the checks that walk the body recurse: it nests too deeply
            return error_response("the request body nests arrays and objects too deeply", 400)
        if forward_to is None:
            return web.json_response(decision.as_json())
        tail = bytearray()  # the response's end: its usage (cached tokens as the engine reports them)
        response = await self.proxy.forward(request, forward_to, raw, decision, prepared.prompt_tokens, tail, clock,
                                            started)
        if clock is not None:
            self.stages.record(clock)
        if response.status >= 400:  # the engine did no work worth counting or replaying
            return response
        usage = reported_usage(tail)
        if (cached := reported_cached_tokens(usage)) is not None:
            tokens = self.metrics.tokens_of(prepared.model)
            tokens.engine_prompt.inc(cached[0])
            tokens.engine_cached.inc(cached[1])
        if arrived is not None:
            output = reported_output_tokens(tail)
            self.capture.record(arrived, prepared.token_ids,
                                fields.requested_output_tokens() if output is None else output,
                                prepared.model, prepared.lora_name, prepared.cache_salt)
        return response

    async def handle_models(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        data = []
        for model in self.served_models():
            data.append({"id": model, "object": "model", "owned_by": "kvroute"})
            data += [{"id": a, "object": "model", "owned_by": "kvroute", "parent": model}
                     for a in sorted(cp.adapters_of(model))]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        return web.json_response({"status": "ok", "model": self.model, "models": self.served_models(),
                                  "policy": self.router.policy.name, "workers": len(self.known_workers()),
                                  "control_plane": "reachable" if cp.reachable else "unreachable"})

    def readiness(self) -> RouterReadiness:
        return router_readiness(self.router.control_plane, self.model, self.router.health, self.served_models())

    async def handle_ready(self, request: web.Request) -> web.Response:
        readiness = self.readiness()
        return web.json_response(readiness.body, status=200 if readiness.ready else 503)

    async def handle_stages(self, request: web.Request) -> web.Response:
        """Per-stage samples in ms (`?reset=1`: and start over)."""
        return web.json_response(self.stages.as_json(reset=request.query.get("reset") == "1"))

    # ------------------------------------------------------------ parsing

    async def _expect_body(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl sends it for large bodies): a body over the cap is refused
        before the client sends it; otherwise the client is told to go on."""
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            exc = _body_too_large(size, self.max_body_bytes)
            response = error_response(str(exc), exc.status, exc.code)
            response.force_close()  # the body was never sent, so nothing is left to read on this connection
            return response
        if request.version != aiohttp.HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":  # runs outside the middlewares: answer here
            return error_response(f"Unknown Expect: {request.headers.get('Expect')}", 417)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim line is not the response: errors can still be answered
        return None

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, refused with 413 from its Content-Length before reading, or as soon as what has
        arrived (decompressed, for a compressed body) passes the cap."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _body_too_large(request.content_length, limit)
        body = bytearray()
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > limit:
                raise _body_too_large(len(body), limit)
        return bytes(body)

    async def _parse(self, request: web.Request, kind: str) -> tuple[bytes, RoutingFields, RouteInput]:
        """(original body bytes, the fields routing reads, what request preparation takes); kind is
        chat, completions or either. Only those fields are decoded (msgspec skips the rest); a body
        msgspec refuses (malformed, or text with a lone UTF-16 surrogate, which Python's json
        accepts) is parsed again by json, for the precise error."""
        raw = await self._read_body(request)
        return raw, *parse_routing_body(raw, kind, request.headers)


def parse_routing_body(raw: bytes, kind: str, headers: Mapping[str, str]) -> tuple[RoutingFields, RouteInput]:
    """A request body -> (the fields routing reads, what request preparation takes); `headers` give the
    session key. Shared with the endpoint picker (epp.py), which gets the same body from Envoy."""
    try:  # msgspec does not look at the text of the fields it skips, and the engine gets these bytes as they are
        raw.decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: it is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        fields = _FIELDS_DECODER.decode(raw)
    except msgspec.ValidationError as exc:  # not an object, or a number out of range
        message = "must be a JSON object" if str(exc).startswith("Expected `object`") else f"is not valid: {exc}"
        raise BadRequest(f"request body {message}") from None
    except msgspec.DecodeError:
        fields = _fields_from_json(raw)
    for name in ("lora_name", "cache_salt", "user"):  # hashed or compared as text: another type is no name
        value = getattr(fields, name)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string, got {type(value).__name__}", param=name)
    if kind == "either" and fields.messages is not msgspec.UNSET:
        kind = "chat"
    session_key = session_key_of(headers, {"user": fields.user})
    return fields, RouteInput(
        fields.model, kind, None if fields.messages is msgspec.UNSET else fields.messages, fields.prompt,
        lora_name=str(fields.lora_name or ""), cache_salt=str(fields.cache_salt or ""), session_key=session_key,
        tools=fields.tools, template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=fields.add_generation_prompt is not False)
