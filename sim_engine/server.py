"""The sim engine's OpenAI-compatible HTTP server and its asyncio step loop."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from data_plane.tokenization import PromptTokenizer, TokenizationError
from sim_engine.cost_model import CostModel
from sim_engine.kv_publisher import KvEventPublisher
from sim_engine.prefix_cache import CacheFullError, PrefixCache
from sim_engine.scheduler import Scheduler, SimRequest

log = logging.getLogger("kvroute.sim_engine")
tracer = trace.get_tracer("kvroute.sim_engine")


@dataclass
class EngineConfig:
    model: str = "tiny-llama"
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    speedup: float = 1.0
    hash_seed: str | None = None
    default_max_tokens: int = 16


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        labels = {"model_name": model}
        self.running = Gauge("vllm:num_requests_running", "Running requests", ["model_name"], registry=registry).labels(**labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting requests", ["model_name"], registry=registry).labels(**labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", ["model_name"], registry=registry).labels(**labels)
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", ["model_name"], registry=registry).labels(**labels)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", ["model_name"], registry=registry).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", ["model_name"], registry=registry).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"], registry=registry).labels(**labels)
        self.success = Counter("vllm:request_success", "Finished requests", ["model_name"], registry=registry).labels(**labels)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT (model time)", ["model_name"], registry=registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)).labels(**labels)


class SimEngine:
    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, cost: CostModel,
                 publisher: KvEventPublisher | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.cache = PrefixCache(config.num_blocks, config.block_size, config.hash_seed)
        self.scheduler = Scheduler(self.cache, cost, config.max_num_batched_tokens, config.max_num_seqs,
                                   tokenizer.vocab_size)
        self.publisher = publisher
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, config.model)
        self._wakeup = asyncio.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._arrivals: dict[str, float] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._reported_queries = self._reported_hits = 0

    def start(self) -> None:
        if self.publisher:
            self.publisher.start()
        self._loop_task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            result = self.scheduler.step()
            await asyncio.sleep(result.seconds / self.config.speedup)
            m = self.metrics
            m.prompt_tokens.inc(result.prefill_tokens)
            for req in result.first_tokens:
                m.ttft.observe((time.monotonic() - self._arrivals[req.request_id]) * self.config.speedup)
            for req, token in result.new_tokens:
                self._streams[req.request_id].put_nowait(token)
            m.generation_tokens.inc(len(result.new_tokens))
            for req in result.finished:
                self._streams[req.request_id].put_nowait(None)
                m.success.inc()
            self._sync_gauges()
            if self.publisher:
                await self.publisher.publish(self.cache.take_events())
            else:
                self.cache.take_events()

    def _sync_gauges(self) -> None:
        m = self.metrics
        m.queries.inc(self.cache.queries_tokens - self._reported_queries)
        m.hits.inc(self.cache.hits_tokens - self._reported_hits)
        self._reported_queries, self._reported_hits = self.cache.queries_tokens, self.cache.hits_tokens
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        m.kv_usage.set(self.cache.usage())

    def submit(self, prompt: list[int], max_tokens: int) -> tuple[SimRequest, asyncio.Queue]:
        if len(prompt) + max_tokens > self.config.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.config.max_model_len} tokens. However, "
                             f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                             f"{max_tokens} in the completion).")
        if not prompt:
            raise ValueError("prompt must not be empty")
        if -(-(len(prompt) + max_tokens) // self.config.block_size) > self.config.num_blocks:
            raise ValueError("request does not fit in the KV cache of this engine")
        req = SimRequest(f"req-{next(self._ids)}", prompt, max_tokens)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = queue
        self._arrivals[req.request_id] = time.monotonic()
        self.scheduler.add(req)
        self._wakeup.set()
        return req, queue

    def finish(self, req: SimRequest) -> None:
        self._streams.pop(req.request_id, None)
        self._arrivals.pop(req.request_id, None)

    async def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        if ok and self.publisher:
            await self.publisher.publish(self.cache.take_events())
        return ok

    # ------------------------------------------------------------------ HTTP

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/reset_prefix_cache", self.handle_reset)
        app.router.add_get("/kvroute/blocks", self.handle_blocks)
        return app

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        ctx = propagate.extract(request.headers)
        with tracer.start_as_current_span("sim_engine.generate", context=ctx, kind=trace.SpanKind.SERVER):
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise ValueError("request body must be a JSON object")
                if chat:
                    messages = body.get("messages")
                    if not isinstance(messages, list) or not messages:
                        raise ValueError("'messages' must be a non-empty list")
                    prompt = self.tokenizer.encode_chat(messages)
                else:
                    raw = body.get("prompt")
                    if isinstance(raw, str):
                        prompt = self.tokenizer.encode_prompt(raw)
                    elif isinstance(raw, list) and all(isinstance(t, int) for t in raw):
                        prompt = raw
                    else:
                        raise ValueError("'prompt' must be a string or a list of token ids")
                max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.config.default_max_tokens)
                req, queue = self.submit(prompt, max_tokens)
            except (ValueError, TokenizationError, CacheFullError, json.JSONDecodeError) as exc:
                return web.json_response({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}},
                                         status=400)
            try:
                if body.get("stream"):
                    return await self._stream(request, req, queue, chat)
                tokens = []
                while (token := await queue.get()) is not None:
                    tokens.append(token)
                return web.json_response(self._final_body(req, tokens, chat))
            finally:
                self.finish(req)

    def _usage(self, req: SimRequest) -> dict:
        hit = req.alloc.hit_tokens if req.alloc else 0
        return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                "total_tokens": len(req.prompt) + len(req.output), "prompt_tokens_details": {"cached_tokens": hit}}

    def _final_body(self, req: SimRequest, tokens: list[int], chat: bool) -> dict:
        text = self.tokenizer.decode(tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "finish_reason": "length"})
        return {"id": req.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.config.model, "choices": [choice], "usage": self._usage(req)}

    async def _stream(self, request: web.Request, req: SimRequest, queue: asyncio.Queue, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        async def send(choice: dict, usage: dict | None = None) -> None:
            chunk = {"id": req.request_id, "object": obj, "created": created, "model": self.config.model,
                     "choices": [choice]}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        n = 0
        while (token := await queue.get()) is not None:
            if chat and n == 0:  # like vLLM, the role chunk goes out with the first token, after prefill
                await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            n += 1
            text = self.tokenizer.decode([token])
            finish = "length" if n >= req.max_tokens else None
            await send({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                       else {"index": 0, "text": text, "finish_reason": finish})
        await send({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                   else {"index": 0, "text": "", "finish_reason": "length"}, usage=self._usage(req))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def handle_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "owned_by": "kvroute-sim", "max_model_len": self.config.max_model_len}]})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        self._sync_gauges()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_reset(self, request: web.Request) -> web.Response:
        if await self.reset_prefix_cache():
            return web.Response(text="")
        return web.json_response({"error": {"message": "requests are running; prefix cache not reset"}}, status=409)

    async def handle_blocks(self, request: web.Request) -> web.Response:
        return web.json_response({"block_size": self.config.block_size,
                                  "block_hashes": sorted(self.cache.true_block_hashes())})
