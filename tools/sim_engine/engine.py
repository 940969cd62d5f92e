"""The sim engine's asyncio driver: runs the pure scheduler in (scaled) real time.

The loop calls `Scheduler.step()`, sleeps the step's cost-model time divided by `speedup`
(against a running deadline, so scheduling jitter does not accumulate), then delivers the
step's tokens to per-request streams, updates the engine's metrics (in its dialect's names) and
queues the step's cache events on the event publisher (ZMQ, or TRT-LLM's pull queue; neither
blocks the loop). Requests whose client went away are aborted between steps, releasing their
blocks.

The dialect (`dialects.py`) decides what the engine is: which hash its events carry (the cache's
labeler), which metrics it exports, whether it honours `cache_salt`. Served LoRA adapters are
names a request may use as its `model`; each gets vLLM's int id (1, 2, ... in the order given)
and its own cache namespace.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.dialects import DEFAULT_DIALECT, Dialect, get_dialect
from kvroute.tools.sim_engine.engine_hashes import DialectLabeler
from kvroute.tools.sim_engine.metrics import EngineMetricsFamily, SglangMetrics, TrtllmIterationStats, VllmMetrics
from kvroute.tools.sim_engine.prefix_cache import BASE_NAMESPACE, CacheEvent, CacheFullError, CacheNamespace, PrefixCache
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest

log = logging.getLogger("kvroute.sim_engine")
_LATE_RESET_S = 0.05  # behind the deadline by more than this: restart the deadline instead of catching up


class RequestRejected(ValueError):
    """The request can never run on this engine (too long, bad parameters); maps to HTTP 400."""


class UnknownModel(ValueError):
    """The request names a model that is neither the served model nor one of its adapters; HTTP 404."""


class EventPublisher(Protocol):
    """The ZMQ publisher (`KvEventPublisher`) or TRT-LLM's pull queue (`TrtllmEventQueue`)."""

    def start(self) -> None: ...

    def publish(self, events: list[CacheEvent]) -> None: ...

    def inject_faults(self, drop_next_batches: int = 0, restart: bool = False) -> dict[str, int]: ...

    async def aclose(self) -> None: ...


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
    dialect: str = DEFAULT_DIALECT
    lora_adapters: tuple[str, ...] = ()
    cpu_offload_blocks: int = 0
    event_hash_form: str | None = None  # None = the dialect's default ("int"); "bytes" or "hex" where it has them

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if self.max_model_len <= 0 or self.default_max_tokens <= 0:
            raise ValueError("max_model_len and default_max_tokens must be positive")
        dialect = get_dialect(self.dialect)
        dialect.hash_scheme(self.event_hash_form)  # raises for a form the dialect does not have
        if self.cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must not be negative")
        if self.cpu_offload_blocks and dialect.cpu_medium is None:
            raise ValueError(f"{dialect.name} cannot report a CPU offload tier: its events have no medium for it")
        names = list(self.lora_adapters)
        if len(set(names)) != len(names) or self.model in names or not all(names):
            raise ValueError("LoRA adapter names must be unique, non-empty and differ from the model name")


def make_metrics(dialect: Dialect, model: str, cpu_tier: bool) -> EngineMetricsFamily:
    if dialect.engine == "sglang":
        return SglangMetrics(model)
    if dialect.engine == "trtllm":
        return TrtllmIterationStats()
    return VllmMetrics(model, cpu_tier)


class SimEngine:
    """One simulated engine: pure cache + scheduler + cost model, driven by an asyncio loop."""

    def __init__(
        self, config: EngineConfig, tokenizer, cost: CostModel | None = None, publisher: EventPublisher | None = None
    ) -> None:
        self.config = config
        self.dialect = get_dialect(config.dialect)
        self.tokenizer = tokenizer
        self.cost = cost or CostModel()
        labeler = DialectLabeler(config.model, config.block_size, self.dialect.hash_scheme(config.event_hash_form))
        self.cache = PrefixCache(
            config.num_blocks,
            config.block_size,
            config.hash_seed,
            digest_bits=128 if config.event_hash_form == "bytes" else 64,
            cpu_offload_blocks=config.cpu_offload_blocks,
            labeler=labeler,
        )
        self.vocab_size = int(tokenizer.vocab_size)
        self.scheduler = Scheduler(
            self.cache,
            self.cost,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.vocab_size,
            seed=config.seed,
            min_token_id=_first_plain_token(tokenizer),
        )
        self.publisher = publisher
        self.metrics = make_metrics(self.dialect, config.model, config.cpu_offload_blocks > 0)
        self._wakeup = asyncio.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._arrivals: dict[str, float] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
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
        now = time.monotonic()
        ttft_s = [self._since_arrival(req, now) for req in result.first_tokens if req.request_id in self._arrivals]
        for req, token in result.new_tokens:
            queue = self._streams.get(req.request_id)
            if queue is not None:
                queue.put_nowait(token)
        e2e_s = []
        for req in result.finished:
            queue = self._streams.get(req.request_id)
            if queue is not None:
                queue.put_nowait(None)
            if req.request_id in self._arrivals:
                e2e_s.append(self._since_arrival(req, now))
        self.metrics.on_step(result, self.scheduler, ttft_s, e2e_s)
        self.publish_pending_events()

    def _since_arrival(self, req: SimRequest, now: float) -> float:
        """Model-time seconds since the request arrived (wall time undone by the speedup)."""
        return (now - self._arrivals[req.request_id]) * self.config.speedup

    def render_metrics(self) -> tuple[bytes, str]:
        """Body and content type of GET /metrics, in the dialect's names."""
        return self.metrics.render(self.scheduler)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt: list[int], max_tokens: int) -> None:
        """Raise RequestRejected with vLLM-like wording if this request can never run."""
        n, limit = len(prompt), self.config.max_model_len
        if n == 0:
            raise RequestRejected("The prompt must not be empty.")
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}.")
        if n > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input messages."
            )
        if n + max_tokens > limit:
            raise RequestRejected(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {limit} tokens and your request has {n} input tokens "
                f"({max_tokens} > {limit} - {n})."
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"Token id {bad} is out of vocabulary")
        try:
            self.cache.check_fits(n + max_tokens)
        except CacheFullError as exc:
            raise RequestRejected(f"Request rejected: {exc}.") from exc

    def namespace_for(self, model: str | None, cache_salt: str | None = None) -> CacheNamespace:
        """The cache namespace of a request for `model` (the served model or an adapter; None = the
        served model) with `cache_salt`; the salt is dropped by an engine version that ignores it."""
        if model is None or model == self.config.model:
            lora_name, lora_id = None, None
        elif model in self.config.lora_adapters:
            lora_name, lora_id = model, self.config.lora_adapters.index(model) + 1
        else:
            raise UnknownModel(f"The model `{model}` does not exist.")
        salt = cache_salt if self.dialect.honours_cache_salt else None
        if lora_name is None and not salt:
            return BASE_NAMESPACE
        return CacheNamespace(lora_name, lora_id, salt or None)

    def submit(
        self, prompt: list[int], max_tokens: int, namespace: CacheNamespace = BASE_NAMESPACE, remote_prefilled: bool = False
    ) -> tuple[SimRequest, asyncio.Queue]:
        """Queue a request; its queue yields output token ids, then None when it is done.
        `remote_prefilled`: a P/D decode leg whose prompt KV was transferred (none of it is computed)."""
        self.validate(prompt, max_tokens)
        req = SimRequest(
            f"req-{next(self._ids)}", list(prompt), max_tokens, namespace=namespace, remote_prefilled=remote_prefilled
        )
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

    def inject_faults(self, drop_next_batches: int = 0, restart_publisher: bool = False, drop_cache: bool = False) -> dict:
        """Fault hooks for end-to-end tests (see `server.py`). `drop_cache` empties the cache without
        any event, as a restarted engine has; it raises RuntimeError while requests hold blocks."""
        if self.publisher is None and (drop_next_batches or restart_publisher):
            raise RuntimeError("KV events are off: there is no publisher to inject faults into")
        if drop_cache:
            self.cache.forget_all()
            self.cache.take_events()  # nothing of the old cache may reach the wire any more
        return self.publisher.inject_faults(drop_next_batches, restart_publisher) if self.publisher else {}

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
