"""The sim engine's OpenAI-compatible HTTP API (aiohttp), shaped like vLLM's.

POST /v1/completions       prompt (string, token ids, or a one-element list of either), max_tokens, stream
POST /v1/chat/completions  messages (rendered with the model's chat template), max_tokens, stream
  Streaming is OpenAI SSE (`data: {...}` chunks, then `data: [DONE]`); with
  `stream_options.include_usage` a last chunk with empty `choices` carries `usage`. Output is
  always `max_tokens` (default 16) pseudo-random tokens; `min_tokens` / `ignore_eos` / sampling
  parameters are accepted and ignored. `usage.prompt_tokens_details.cached_tokens` = prefix hit.
  `model` may name a served LoRA adapter: the request runs in that adapter's cache namespace
  (any other unknown name is a 404). `cache_salt` (vLLM's field, a non-empty string) namespaces
  the request's blocks too, unless the dialect's engine version ignores it (SGLang < 0.5.20).
GET  /v1/models            the model, then each adapter as vLLM lists it (`parent` = the model)
GET  /health
GET  /version              {"version": the imitated engine version (null for TRT-LLM), "engine", "dialect", "server"}
GET  /metrics              the dialect's own metrics: vLLM or SGLang Prometheus names, or
                           TRT-LLM's JSON list of iteration stats (drained by each call)
POST /reset_prefix_cache   200 when cleared (AllBlocksCleared goes out), 409 while requests hold blocks;
                           SGLang dialects also answer it as POST or GET /flush_cache
POST /kv_cache_events      trtllm-pull only: returns and drains the JSON array of KV-cache events

kvroute endpoints (not part of any engine's API):
GET  /kvroute/blocks       the engine's true cached block set as kvroute block keys, by tier:
                           {"model", "block_size", "tiers": {"gpu": [...], "cpu": [...]},
                            "counts": {"gpu": n, "cpu": m}, "num_blocks", "cpu_offload_blocks",
                            "used_blocks"}; keys are decimal integers in ascending order, computed
                           once when each block was cached (model = the served model, LoRA name
                           and cache salt = the request's, as kvroute.block_keys namespaces them).
GET  /kvroute/pd           with a P/D role (--role / --pd-protocol): its legs so far (pd.py); 404 without
POST /kvroute/faults       fault hooks for end-to-end tests; a JSON object with any of
                           {"drop_next_batches": N}   the publisher withholds its next N batches
                                 from the PUB socket; their seqs are used up and they stay in the
                                 replay buffer (a real gap, to be filled by replay). trtllm-pull:
                                 the events of the next N steps are lost, their event_ids used up.
                           {"restart_publisher": true} seq restarts at 0 and the replay buffer and
                                 send queue are emptied, as when an engine restarts (the HTTP
                                 server and the sockets stay up). trtllm-pull: event ids restart
                                 at 0 with a new `created` event.
                           {"drop_cache": true}       the cache is emptied without any event, as
                                 a restarted engine's is (409 while requests hold blocks).
                           Answers 200 with the publisher's state
                           ({"next_seq" | "next_event_id", "drop_next_batches", "dropped_by_fault",
                           "restarts"}); 400 on a bad body; 409 when KV events are off.
Prefill/decode disaggregation (--role prefill|decode, --pd-protocol vllm|sglang): vLLM's
`kv_transfer_params` or SGLang's bootstrap fields, as `pd.py` describes; a decode leg's answer
names what it received in `x-sim-kv-transfer`.
Errors are vLLM-like JSON: {"error": {"message", "type", "param", "code"}}.
An incoming W3C `traceparent` parents the server span (tracing on via kvroute.telemetry).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from opentelemetry import propagate, trace

from kvroute.listeners import ListenError, start_http_site
from kvroute.tools.sim_engine.engine import EngineConfig, RequestRejected, SimEngine, UnknownModel
from kvroute.tools.sim_engine.pd import DEFAULT_TRANSFER_MS_PER_BLOCK, TRANSFER_HEADER, PdEngineSide, PdFieldError, PdLeg
from kvroute.tools.sim_engine.prefix_cache import CPU, GPU, CacheNamespace
from kvroute.tools.sim_engine.scheduler import SimRequest
from kvroute.tools.sim_engine.tokenizer import PromptError
from kvroute.tools.sim_engine.trtllm_events import TrtllmEventQueue

tracer = trace.get_tracer("kvroute.sim_engine")


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def response(self) -> web.Response:
        return web.json_response(
            {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}},
            status=self.status,
        )


class SimServer:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.pd: PdEngineSide | None = None  # set once the port is bound (start_server)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/version", self.handle_version)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/reset_prefix_cache", self.handle_reset)
        if self.engine.dialect.engine == "sglang":
            app.router.add_route("*", "/flush_cache", self.handle_reset)
        if isinstance(self.engine.publisher, TrtllmEventQueue):
            app.router.add_post("/kv_cache_events", self.handle_kv_cache_events)
        app.router.add_get("/kvroute/blocks", self.handle_blocks)
        app.router.add_post("/kvroute/faults", self.handle_faults)
        app.router.add_get("/kvroute/pd", self.handle_pd)
        return app

    # ------------------------------------------------------------------ parsing

    async def _json_object(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError as exc:  # JSON, UTF-8, or an integer past Python's digit limit
            raise ApiError(f"request body is not valid JSON: {exc}") from exc
        except RecursionError:  # nested past Python's limit (the router's msgspec takes a few levels more)
            raise ApiError("request body nests arrays and objects too deeply") from None
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        return body

    async def _body(self, request: web.Request) -> dict:
        body = await self._json_object(request)
        n = body.get("n")
        if n not in (None, 1):
            raise ApiError("the sim engine only supports n=1", param="n")
        return body

    def _namespace(self, body: dict) -> CacheNamespace:
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        try:
            return self.engine.namespace_for(body.get("model"), salt)
        except UnknownModel as exc:
            raise ApiError(str(exc), 404, "NotFoundError", "model") from exc

    def _max_tokens(self, body: dict, chat: bool) -> int:
        value = (
            body.get("max_completion_tokens")
            if chat and body.get("max_completion_tokens") is not None
            else body.get("max_tokens")
        )
        if value is None:
            return self.config.default_max_tokens
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError("max_tokens must be an integer", param="max_tokens")
        if value < 1:
            raise ApiError(f"max_tokens must be at least 1, got {value}.", param="max_tokens")
        return value

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        tok = self.engine.tokenizer
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ApiError("'messages' must be a non-empty list", param="messages")
                return tok.encode_chat(messages)
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
                raw = raw[0]  # a batch of one
            if isinstance(raw, str):
                return tok.encode_prompt(raw)
            if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
                return raw
            if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
                raise ApiError("the sim engine serves one prompt per request", param="prompt")
            raise ApiError("'prompt' must be a string or a non-empty list of token ids", param="prompt")
        except PromptError as exc:
            raise ApiError(str(exc)) from exc

    # ------------------------------------------------------------------ generation

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        ctx = propagate.extract(request.headers)
        route = "chat.completions" if chat else "completions"
        with tracer.start_as_current_span(f"sim_engine.{route}", context=ctx, kind=trace.SpanKind.SERVER) as span:
            try:
                body = await self._body(request)
                namespace = self._namespace(body)
                prompt = self._prompt(body, chat)
                max_tokens = self._max_tokens(body, chat)
                leg = self._pd_leg(body, len(prompt))
                if leg is not None and leg.kind == "prefill" and self.pd.protocol == "sglang":
                    max_tokens = 1  # SGLang's prefill server answers once the prompt is done
                if leg is not None and leg.kind == "decode":
                    await self.pd.receive(leg)
                req, queue = self.engine.submit(
                    prompt, max_tokens, namespace, remote_prefilled=leg is not None and leg.kind == "decode"
                )
            except RequestRejected as exc:
                return ApiError(str(exc)).response()
            except ApiError as exc:
                return exc.response()
            span.set_attribute("kvroute.request_id", req.request_id)
            span.set_attribute("kvroute.prompt_tokens", len(prompt))
            headers = {}
            if leg is not None and leg.kind == "decode":
                headers[TRANSFER_HEADER] = self.pd.transfer_header(leg)
            try:
                if body.get("stream"):
                    options = body.get("stream_options") or {}
                    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
                    resp = await self._stream(request, req, queue, chat, include_usage, headers)
                else:
                    tokens = []
                    while (token := await queue.get()) is not None:
                        tokens.append(token)
                    answer = self._final_body(req, tokens, chat)
                    if leg is not None and leg.kind == "prefill" and self.pd.protocol == "vllm":
                        answer["kv_transfer_params"] = self.pd.transfer_params(
                            req.request_id, len(prompt) // self.config.block_size
                        )
                    resp = web.json_response(answer, headers=headers)
                span.set_attribute("kvroute.cached_tokens", req.hit_tokens)
                return resp
            finally:
                self.engine.finish(req)

    def _pd_leg(self, body: dict, prompt_tokens: int) -> PdLeg | None:
        if self.pd is None:
            return None
        try:
            leg = self.pd.leg_of(body, prompt_tokens // self.config.block_size)
        except PdFieldError as exc:
            raise ApiError(str(exc), param=exc.param) from exc
        if leg is not None and leg.kind == "prefill":
            self.pd.prefill_legs += 1
        return leg

    def _response_id(self, chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _served_name(self, req: SimRequest) -> str:
        """The model a response names: the adapter the request asked for, else the served model."""
        return req.namespace.lora_name or self.config.model

    def _usage(self, req: SimRequest) -> dict:
        return {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output),
            "prompt_tokens_details": {"cached_tokens": req.hit_tokens},
        }

    def _final_body(self, req: SimRequest, tokens: list[int], chat: bool) -> dict:
        text = self.engine.tokenizer.decode(tokens)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return {
            "id": self._response_id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self._served_name(req),
            "choices": [choice],
            "usage": self._usage(req),
        }

    async def _stream(
        self, request: web.Request, req: SimRequest, queue, chat: bool, include_usage: bool, headers: dict[str, str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created, rid = int(time.time()), self._response_id(chat)

        async def send(choices: list[dict], usage: dict | None = None) -> None:
            chunk = {"id": rid, "object": obj, "created": created, "model": self._served_name(req), "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        n = 0
        while (token := await queue.get()) is not None:
            if chat and n == 0:  # like vLLM, the role chunk goes out with the first token, after prefill
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            n += 1
            text = self.engine.tokenizer.decode([token])
            finish = "length" if n >= req.max_tokens else None
            if chat:
                await send([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}])
            else:
                await send([{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}])
        if include_usage:
            await send([], usage=self._usage(req))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ the rest

    async def handle_models(self, request: web.Request) -> web.Response:
        created, model = int(time.time()), self.config.model
        data = [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": model,
                "max_model_len": None,
            }
            for name in self.config.lora_adapters
        ]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_version(self, request: web.Request) -> web.Response:
        dialect = self.engine.dialect
        return web.json_response(
            {"version": dialect.version, "engine": dialect.engine, "dialect": dialect.name, "server": "kvroute-sim-engine"}
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.engine.render_metrics()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def handle_reset(self, request: web.Request) -> web.Response:
        if self.engine.reset_prefix_cache():
            return web.Response(status=200)
        return ApiError(
            f"prefix cache not reset: {self.engine.cache.used_blocks} KV blocks are still in use by running requests",
            409,
            "ConflictError",
        ).response()

    async def handle_kv_cache_events(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.publisher.drain())

    async def handle_blocks(self, request: web.Request) -> web.Response:
        cache = self.engine.cache
        keys = cache.block_keys()
        tiers = {"gpu": sorted(keys[GPU]), "cpu": sorted(keys[CPU])}
        return web.json_response(
            {
                "model": self.config.model,
                "block_size": cache.block_size,
                "tiers": tiers,
                "counts": {tier: len(k) for tier, k in tiers.items()},
                "num_blocks": cache.num_blocks,
                "cpu_offload_blocks": cache.cpu_offload_blocks,
                "used_blocks": cache.used_blocks,
            }
        )

    async def handle_pd(self, request: web.Request) -> web.Response:
        if self.pd is None:
            return ApiError("this engine has no P/D role (--role, --pd-protocol)", 404, "NotFoundError").response()
        return web.json_response(self.pd.state())

    async def handle_faults(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_object(request)
            unknown = sorted(set(body) - {"drop_next_batches", "restart_publisher", "drop_cache"})
            if unknown:
                raise ApiError(f"unknown fault fields: {', '.join(unknown)}")
            drops = body.get("drop_next_batches", 0)
            if isinstance(drops, bool) or not isinstance(drops, int) or drops < 0:
                raise ApiError("drop_next_batches must be a non-negative integer", param="drop_next_batches")
            flags = {name: body.get(name, False) for name in ("restart_publisher", "drop_cache")}
            if not all(isinstance(v, bool) for v in flags.values()):
                raise ApiError("restart_publisher and drop_cache must be true or false")
        except ApiError as exc:
            return exc.response()
        try:
            state = self.engine.inject_faults(drops, **flags)
        except RuntimeError as exc:
            return ApiError(str(exc), 409, "ConflictError").response()
        return web.json_response(state)


async def start_server(
    engine: SimEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    pd_role: str | None = None,
    pd_protocol: str | None = None,
    transfer_ms_per_block: float = DEFAULT_TRANSFER_MS_PER_BLOCK,
) -> tuple[web.AppRunner, int]:
    """Start the engine loop and the HTTP server; returns the runner (cleanup() stops it) and the bound port.
    `pd_role` / `pd_protocol` (either set): take part in prefill/decode disaggregation (pd.py); the
    protocol defaults to the dialect's engine (sglang for SGLang dialects, else vllm), the role to both."""
    server = SimServer(engine)
    if pd_role is not None or pd_protocol is not None:  # checked before anything starts
        protocol = pd_protocol or ("sglang" if engine.dialect.engine == "sglang" else "vllm")
        server.pd = PdEngineSide(pd_role or "both", protocol, "", host, port, engine.config.speedup, transfer_ms_per_block / 1000)
    engine.start()
    # handler_cancellation: a client that goes away cancels its handler, which aborts the request.
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        bound = await start_http_site(runner, "--port", host, port)
    except ListenError:
        await runner.cleanup()
        raise
    if server.pd is not None:  # the KV's address is the engine's own: known once bound
        server.pd.port, server.pd.engine_id = bound, f"sim-{host}:{bound}"
    return runner, bound
