"""The sim engine's OpenAI-compatible HTTP API (aiohttp), shaped like vLLM's.

POST /v1/completions       prompt (string, token ids, or a one-element list of either), max_tokens, stream
POST /v1/chat/completions  messages (rendered with the model's chat template), max_tokens, stream
  Streaming is OpenAI SSE (`data: {...}` chunks, then `data: [DONE]`); with
  `stream_options.include_usage` a last chunk with empty `choices` carries `usage`. Output is
  always `max_tokens` (default 16) pseudo-random tokens; `min_tokens` / `ignore_eos` / sampling
  parameters are accepted and ignored. `usage.prompt_tokens_details.cached_tokens` = prefix hit.
GET  /v1/models, /health, /version, /metrics (vLLM metric names)
POST /reset_prefix_cache   200 when cleared (AllBlocksCleared goes out), 409 while requests hold blocks
GET  /kvroute/blocks       the true cached block hashes (audits)
Errors are vLLM-like JSON: {"error": {"message", "type", "param", "code"}}.
An incoming W3C `traceparent` parents the server span (tracing on via kvroute.telemetry).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sim_engine.engine import EngineConfig, EngineMetrics, RequestRejected, SimEngine  # noqa: F401 (re-exported)
from sim_engine.scheduler import SimRequest

tracer = trace.get_tracer("kvroute.sim_engine")

try:  # the tokenizer module's own error type, when present
    from data_plane.tokenization import TokenizationError
except ImportError:  # pragma: no cover
    class TokenizationError(ValueError):  # type: ignore[no-redef]
        pass


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.err_type, "param": self.param,
                                            "code": self.status}}, status=self.status)


class SimServer:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/version", self.handle_version)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/reset_prefix_cache", self.handle_reset)
        app.router.add_get("/kvroute/blocks", self.handle_blocks)
        return app

    # ------------------------------------------------------------------ parsing

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise ApiError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        n = body.get("n")
        if n not in (None, 1):
            raise ApiError("the sim engine only supports n=1", param="n")
        return body

    def _max_tokens(self, body: dict, chat: bool) -> int:
        value = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
            else body.get("max_tokens")
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
        except TokenizationError as exc:
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
                prompt = self._prompt(body, chat)
                max_tokens = self._max_tokens(body, chat)
                req, queue = self.engine.submit(prompt, max_tokens)
            except RequestRejected as exc:
                return ApiError(str(exc)).response()
            except ApiError as exc:
                return exc.response()
            span.set_attribute("kvroute.request_id", req.request_id)
            span.set_attribute("kvroute.prompt_tokens", len(prompt))
            try:
                if body.get("stream"):
                    options = body.get("stream_options") or {}
                    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
                    resp = await self._stream(request, req, queue, chat, include_usage)
                else:
                    tokens = []
                    while (token := await queue.get()) is not None:
                        tokens.append(token)
                    resp = web.json_response(self._final_body(req, tokens, chat))
                span.set_attribute("kvroute.cached_tokens", req.hit_tokens)
                return resp
            finally:
                self.engine.finish(req)

    def _response_id(self, chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _usage(self, req: SimRequest) -> dict:
        return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                "total_tokens": len(req.prompt) + len(req.output),
                "prompt_tokens_details": {"cached_tokens": req.hit_tokens}}

    def _final_body(self, req: SimRequest, tokens: list[int], chat: bool) -> dict:
        text = self.engine.tokenizer.decode(tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return {"id": self._response_id(chat), "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.config.model, "choices": [choice],
                "usage": self._usage(req)}

    async def _stream(self, request: web.Request, req: SimRequest, queue, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created, rid = int(time.time()), self._response_id(chat)

        async def send(choices: list[dict], usage: dict | None = None) -> None:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.config.model, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        n = 0
        while (token := await queue.get()) is not None:
            if chat and n == 0:  # like vLLM, the role chunk goes out with the first token, after prefill
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
            n += 1
            text = self.engine.tokenizer.decode([token])
            finish = "length" if n >= req.max_tokens else None
            if chat:
                await send([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}])
            else:
                await send([{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "stop_reason": None}])
        if include_usage:
            await send([], usage=self._usage(req))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ the rest

    async def handle_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
             "root": self.config.model, "parent": None, "max_model_len": self.config.max_model_len}]})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "kvroute-sim-engine"})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        self.engine.sync_metrics()
        return web.Response(body=generate_latest(self.engine.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_reset(self, request: web.Request) -> web.Response:
        if self.engine.reset_prefix_cache():
            return web.Response(status=200)
        return ApiError(f"prefix cache not reset: {self.engine.cache.used_blocks} KV blocks are still in use by "
                        "running requests", 409, "ConflictError").response()

    async def handle_blocks(self, request: web.Request) -> web.Response:
        cache = self.engine.cache
        return web.json_response({"model": self.config.model, "block_size": cache.block_size,
                                  "num_blocks": cache.num_blocks, "used_blocks": cache.used_blocks,
                                  "block_hashes": sorted(cache.true_block_hashes())})


async def start_server(engine: SimEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start the engine loop and the HTTP server; returns the runner (cleanup() stops it) and the bound port."""
    engine.start()
    # handler_cancellation: a client that goes away cancels its handler, which aborts the request.
    runner = web.AppRunner(SimServer(engine).app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addresses = runner.addresses
    return runner, (addresses[0][1] if addresses else port)
