"""OpenAI-compatible HTTP front of the router: where a request's path starts.

    POST /v1/chat/completions, /v1/completions
        parse_routing_body (api/body.py): JSON body -> the routing fields (model, prompt or messages, adapter, salt,
                session key)
        RequestPreparer.prepare (prepare/request_prep.py, shared with gRPC): model/adapter check,
                token ids (the model's own tokenizer and chat template), length check
                (one router serves every model its fleet serves: each request is routed among
                the workers of its own model)
        Router.decide (service/routing.py): block keys per block size -> control-plane query -> policy
                (session key for the session policy: `x-session-id` header, else the body's `user`)
        BackendProxy.forward (proxy.py): the original body to the chosen engine, streamed back
        (P/D mode, `--pd`: a prefill worker by the policy, a decode worker by load, both legs
        through pd.py)
    POST /v1/route      the decision alone, as JSON (same body as completions or chat);
                        ?explain=1 adds why: per candidate the policy's cost terms and the index's answer
    GET  /v1/models (every model some worker serves, and their LoRA adapters), /health (liveness),
         /ready (service/readiness.py), /metrics

Every error is OpenAI's error object (`api/errors.py`): bad input 400, unknown model 404, body
over `max_body_bytes` 413 (refused from its Content-Length before it is read, or as soon as a
chunked body passes the cap), no worker known 503. A prompt longer than `max_prompt_tokens` is a
400 `context_length_exceeded`, from its characters alone when it is past the tokenizer's
character bound (`prepare/char_bound.py`), so megabytes of text are never tokenized to find that out.
"""

from __future__ import annotations

import logging
import time

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry import propagate, trace
from prometheus_client import Counter, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

from kvroute.bad_request import BadRequest
from kvroute.data_plane.access.admission import Admission
from kvroute.data_plane.api.body import RoutingFields, parse_routing_body
from kvroute.data_plane.api.errors import error_response, openai_errors
from kvroute.data_plane.http.pd import PdRouting
from kvroute.data_plane.http.proxy import BackendProxy
from kvroute.data_plane.ops.stage_timing import StageSamples
from kvroute.data_plane.ops.traffic_capture import (
    TrafficCapture,
    reported_cached_tokens,
    reported_output_tokens,
    reported_usage,
)
from kvroute.data_plane.prepare.request_prep import PrepareError, RequestPreparer, RouteInput
from kvroute.data_plane.service.readiness import router_readiness, served_models
from kvroute.data_plane.service.routing import NoWorkersError, Router
from kvroute.status import Readiness, ready_handler
from kvroute.telemetry import tracing_active

log = logging.getLogger("kvroute.router.http")
tracer = trace.get_tracer("kvroute.router")

# 131072 tokens of chat as JSON is ~0.5 MB of English, ~1.2 MB of CJK written as \uXXXX escapes
# (Python's json.dumps default): 4 MiB is three times the worst of those. Inline images
# (base64 content parts, not tokenized here) may need more: --max-body-bytes.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# PrepareError.kind -> (HTTP status, OpenAI error code)
_PREPARE_STATUS = {
    "invalid": (400, None),
    "model_not_found": (404, "model_not_found"),
    "too_long": (400, "context_length_exceeded"),
}


def _asks_to_explain(request: web.Request) -> bool:
    return request.query.get("explain", "").lower() in ("1", "true", "yes")


def _body_too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(
        f"the request body ({size} bytes) is larger than this router accepts ({limit} bytes; see --max-body-bytes)",
        413,
        "request_too_large",
    )


class RouterHttpApi:
    def __init__(
        self,
        router: Router,
        proxy: BackendProxy,
        preparer: RequestPreparer,
        capture: TrafficCapture | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        stages: StageSamples | None = None,
        admission: Admission | None = None,
        pd: PdRouting | None = None,
    ) -> None:
        self.router, self.proxy, self.preparer = router, proxy, preparer
        self.pd = pd  # prefill/decode disaggregation (pd.py); None: whole requests to one worker
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
            self.prompt_bound_note = (
                f"no character bound on prompts ({bound.why}): every prompt under --max-body-bytes is tokenized"
            )
        else:
            self.prompt_bound_note = (
                f"prompts over {bound.max_chars(max_prompt_tokens)} characters are rejected "
                f"without tokenizing ({bound.chars_per_token} per token: {bound.why})"
            )

    def app(self) -> web.Application:
        middlewares = [self._count_requests, openai_errors]
        if self.admission is not None:
            middlewares.append(self.admission.middleware)
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=middlewares)
        for path, handler in (
            ("/v1/completions", self.handle_completions),
            ("/v1/chat/completions", self.handle_chat),
            ("/v1/route", self.handle_route),
        ):
            app.router.add_post(path, handler, expect_handler=self._expect_body)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", ready_handler(self.readiness))
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
                counted = self._answers[(route, status)] = (
                    self.metrics.http_requests.labels(route, str(status)),
                    self.metrics.http_request_seconds.labels(route),
                )
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
        with tracer.start_as_current_span(
            f"POST {request.path}", context=propagate.extract(request.headers), kind=trace.SpanKind.SERVER
        ):
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
            explain = forward_to is None and _asks_to_explain(request)
            decode = None
            if self.pd is not None:
                decision = await self.pd.decide_prefill(
                    prepared.model,
                    prepared.token_ids,
                    prepared.lora_name,
                    prepared.cache_salt,
                    prepared.session_key,
                    clock,
                    explain,
                )
                decode = await self.pd.decide_decode(prepared.model, prepared.lora_name)
            else:
                decision = await self.router.decide(
                    prepared.model,
                    prepared.token_ids,
                    prepared.lora_name,
                    prepared.cache_salt,
                    session_key=prepared.session_key,
                    clock=clock,
                    explain=explain,
                )
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
            answer = decision.as_json()
            if decode is not None:  # P/D: the decision above is the prefill leg's
                answer["pd"] = {
                    "protocol": self.pd.protocol,
                    "prefill_worker_id": decision.worker_id,
                    "decode_worker_id": decode.worker_id,
                    "decode_workers": [
                        {
                            "worker_id": c.worker_id,
                            "inflight_requests": c.inflight_requests,
                            "running_requests": c.running_requests,
                            "waiting_requests": c.waiting_requests,
                        }
                        for c in decode.candidates
                    ],
                }
            return web.json_response(answer)
        tail = bytearray()  # the response's end: its usage (cached tokens as the engine reports them)
        if decode is not None:
            response = await self.pd.forward(
                request, forward_to, raw, decision, decode, prepared.prompt_tokens, tail, clock, started
            )
        else:
            response = await self.proxy.forward(request, forward_to, raw, decision, prepared.prompt_tokens, tail, clock, started)
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
            self.capture.record(
                arrived,
                prepared.token_ids,
                fields.requested_output_tokens() if output is None else output,
                prepared.model,
                prepared.lora_name,
                prepared.cache_salt,
            )
        return response

    async def handle_models(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        data = []
        for model in self.served_models():
            data.append({"id": model, "object": "model", "owned_by": "kvroute"})
            data += [{"id": a, "object": "model", "owned_by": "kvroute", "parent": model} for a in sorted(cp.adapters_of(model))]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        cp = self.router.control_plane
        return web.json_response(
            {
                "status": "ok",
                "model": self.model,
                "models": self.served_models(),
                "policy": self.router.policy.name,
                "workers": len(self.known_workers()),
                "control_plane": "reachable" if cp.reachable else "unreachable",
            }
        )

    def readiness(self) -> Readiness:
        return router_readiness(
            self.router.control_plane,
            self.model,
            self.router.health,
            self.served_models(),
            role_of=self.pd.role_of if self.pd is not None else None,
        )

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
