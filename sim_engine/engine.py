"""The sim engine's asyncio driver: runs the pure scheduler in (scaled) real time.

The loop calls `Scheduler.step()`, sleeps the step's cost-model time divided by `speedup`
(against a running deadline, so scheduling jitter does not accumulate), then delivers the
step's tokens to per-request streams, updates vLLM-named metrics and queues the step's cache
events on the KV-event publisher (which never blocks the loop). Requests whose client went
away are aborted between steps, releasing their blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sim_engine.cost_model import CostModel
from sim_engine.kv_publisher import KvEventPublisher
from sim_engine.prefix_cache import CacheFullError, PrefixCache
from sim_engine.scheduler import Scheduler, SimRequest

log = logging.getLogger("kvroute.sim_engine")

# vLLM's bucket boundaries for vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
_LATE_RESET_S = 0.05  # behind the deadline by more than this: restart the deadline instead of catching up


class RequestRejected(ValueError):
    """The request can never run on this engine (too long, bad parameters); maps to HTTP 400."""


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
    seed: int = 0

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if self.max_model_len <= 0 or self.default_max_tokens <= 0:
            raise ValueError("max_model_len and default_max_tokens must be positive")


class EngineMetrics:
    """vLLM's metric names (label `model_name`), in a per-engine registry."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        lbl = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lbl, registry=registry).labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lbl, registry=registry).labels(model)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=registry).labels(model, "length")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lbl, registry=registry, buckets=TTFT_BUCKETS).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             lbl, registry=registry, buckets=E2E_BUCKETS).labels(model)


class SimEngine:
    """One simulated engine: pure cache + scheduler + cost model, driven by an asyncio loop."""

    def __init__(self, config: EngineConfig, tokenizer, cost: CostModel | None = None,
                 publisher: KvEventPublisher | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.cost = cost or CostModel()
        self.cache = PrefixCache(config.num_blocks, config.block_size, config.hash_seed)
        self.vocab_size = int(tokenizer.vocab_size)
        self.scheduler = Scheduler(self.cache, self.cost, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.vocab_size, seed=config.seed, min_token_id=_first_plain_token(tokenizer))
        self.publisher = publisher
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, config.model)
        self._wakeup = asyncio.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._arrivals: dict[str, float] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._reported_queries = self._reported_hits = 0
        self.steps = 0

    # ------------------------------------------------------------------ loop

    def start(self) -> None:
        if self.publisher:
            self.publisher.start()
        self._loop_task = asyncio.create_task(self._run(), name="sim-engine-loop")
        self._loop_task.add_done_callback(self._loop_done)

    @staticmethod
    def _loop_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sim engine loop died", exc_info=task.exception())

    async def stop(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        if self.publisher:
            await self.publisher.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = loop.time()
            result = self.scheduler.step()
            self.steps += 1
            now = loop.time()
            deadline = (deadline if now - deadline < _LATE_RESET_S else now) + result.seconds / self.config.speedup
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self._deliver(result)

    def _deliver(self, result) -> None:
        m = self.metrics
        now = time.monotonic()
        for req in result.first_tokens:
            m.prompt_tokens.inc(len(req.prompt))  # vLLM counts the whole prompt once prefill is done
            if req.request_id in self._arrivals:
                m.ttft.observe((now - self._arrivals[req.request_id]) * self.config.speedup)
        for req, token in result.new_tokens:
            queue = self._streams.get(req.request_id)
            if queue is not None:
                queue.put_nowait(token)
        m.generation_tokens.inc(len(result.new_tokens))
        for req in result.finished:
            queue = self._streams.get(req.request_id)
            if queue is not None:
                queue.put_nowait(None)
            if req.request_id in self._arrivals:
                m.e2e.observe((now - self._arrivals[req.request_id]) * self.config.speedup)
            m.success.inc()
        self.sync_metrics()
        events = self.cache.take_events()
        if self.publisher:
            self.publisher.publish(events)

    def sync_metrics(self) -> None:
        m = self.metrics
        m.queries.inc(self.cache.queries_tokens - self._reported_queries)
        m.hits.inc(self.cache.hits_tokens - self._reported_hits)
        self._reported_queries, self._reported_hits = self.cache.queries_tokens, self.cache.hits_tokens
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        m.kv_usage.set(self.cache.usage())

    # ------------------------------------------------------------------ requests

    def validate(self, prompt: list[int], max_tokens: int) -> None:
        """Raise RequestRejected with vLLM-like wording if this request can never run."""
        n, limit = len(prompt), self.config.max_model_len
        if n == 0:
            raise RequestRejected("The prompt must not be empty.")
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}.")
        if n > limit:
            raise RequestRejected(f"This model's maximum context length is {limit} tokens. However, your request has "
                                  f"{n} input tokens. Please reduce the length of the input messages.")
        if n + max_tokens > limit:
            raise RequestRejected(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                                  f"maximum context length is {limit} tokens and your request has {n} input tokens "
                                  f"({max_tokens} > {limit} - {n}).")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"Token id {bad} is out of vocabulary")
        try:
            self.cache.check_fits(n + max_tokens)
        except CacheFullError as exc:
            raise RequestRejected(f"Request rejected: {exc}.") from exc

    def submit(self, prompt: list[int], max_tokens: int) -> tuple[SimRequest, asyncio.Queue]:
        """Queue a request; its queue yields output token ids, then None when it is done."""
        self.validate(prompt, max_tokens)
        req = SimRequest(f"req-{next(self._ids)}", list(prompt), max_tokens)
        self.scheduler.add(req)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = queue
        self._arrivals[req.request_id] = time.monotonic()
        self._wakeup.set()
        return req, queue

    def finish(self, req: SimRequest) -> None:
        """The caller is done with `req`: forget its stream, aborting it if it is still scheduled."""
        self._streams.pop(req.request_id, None)
        self._arrivals.pop(req.request_id, None)
        if not req.finished and self.scheduler.abort(req.request_id):
            log.info("request %s aborted (client gone)", req.request_id)

    def publish_pending_events(self) -> None:
        events = self.cache.take_events()
        if self.publisher:
            self.publisher.publish(events)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: False while requests hold blocks; else AllBlocksCleared goes out."""
        ok = self.cache.reset()
        if ok:
            self.publish_pending_events()
        return ok

    async def generate(self, prompt: list[int], max_tokens: int):
        """Convenience async iterator of output token ids (aborts the request if the consumer stops)."""
        req, queue = self.submit(prompt, max_tokens)
        try:
            while (token := await queue.get()) is not None:
                yield token
        finally:
            self.finish(req)


def _first_plain_token(tokenizer) -> int:
    """Output tokens start above the special tokens, so decoded text is never empty."""
    inner = getattr(tokenizer, "tokenizer", None)
    try:
        special = list(inner.get_added_tokens_decoder()) if inner is not None else []
    except AttributeError:
        special = []
    first = max(special) + 1 if special else 3
    return first if first < int(tokenizer.vocab_size) else 0
