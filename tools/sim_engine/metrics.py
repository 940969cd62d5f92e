"""Each simulated engine's `GET /metrics`, in that engine's own names and shape.

- vLLM: Prometheus text, `vllm:*` names with label `model_name` (the agent and `kvroute demo`
  read `vllm:num_requests_{running,waiting}`, `vllm:kv_cache_usage_perc` and
  `vllm:prefix_cache_{queries,hits}_total`), and the info gauge `vllm:cache_config_info` (value 1;
  labels `block_size`, `num_gpu_blocks`, `enable_prefix_caching`, of vLLM's larger set). With a CPU tier, the tokens the GPU cache did not
  have are queried from it like from vLLM's KV connector: `vllm:external_prefix_cache_{queries,hits}_total`.
- SGLang: Prometheus text, `sglang:*` names: gauges `num_running_reqs`, `num_queue_reqs`,
  `max_total_num_tokens`, `num_used_tokens`, `token_usage` (used / total KV tokens), `cache_hit_rate` (here cumulative:
  cached prompt tokens / prompt tokens), counters `prompt_tokens`, `generation_tokens`,
  `cached_tokens`, `num_requests`, and the TTFT / e2e histograms.
- TensorRT-LLM: trtllm-serve returns a JSON list of per-iteration stats and drains it on every
  call: `iter`, `iterLatencyMS`, `numActiveRequests`, `numQueuedRequests`,
  `numCompletedRequests`, `maxNumActiveRequests`, `kvCacheStats` {maxNumBlocks, freeNumBlocks,
  usedNumBlocks, tokensPerBlock, allocTotalBlocks, allocNewBlocks, reusedBlocks, missedBlocks,
  cacheHitRate} and `inflightBatchingStats` {numScheduledRequests, numContextRequests,
  numGenRequests, numPausedRequests, numCtxTokens}. An idle engine has no iterations: [].
"""

from __future__ import annotations

import json
from collections import deque
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute.tools.sim_engine.scheduler import Scheduler, StepResult

# vLLM's bucket boundaries for vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_STATS_KEPT = 1000


class EngineMetricsFamily(Protocol):
    def on_step(self, result: StepResult, scheduler: Scheduler, ttft_s: list[float], e2e_s: list[float]) -> None: ...

    def render(self, scheduler: Scheduler) -> tuple[bytes, str]:
        """(body, content type) of one GET /metrics."""
        ...


class _PrometheusFamily:
    """Per-step counters and histograms shared by vLLM and SGLang; counters fed from the cache's
    cumulative totals add only their growth since the last render. Subclasses create the
    metrics `prompt_tokens`, `generation_tokens`, `finished_requests`, `ttft` and `e2e`."""

    prompt_tokens: Counter
    generation_tokens: Counter
    finished_requests: Counter
    ttft: Histogram
    e2e: Histogram

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self._reported: dict[int, int] = {}

    def on_step(self, result: StepResult, scheduler: Scheduler, ttft_s: list[float], e2e_s: list[float]) -> None:
        for req in result.first_tokens:
            self.prompt_tokens.inc(len(req.prompt))  # the whole prompt, counted once its prefill is done
        for seconds in ttft_s:
            self.ttft.observe(seconds)
        self.generation_tokens.inc(len(result.new_tokens))
        for seconds in e2e_s:
            self.e2e.observe(seconds)
        self.finished_requests.inc(len(result.finished))

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(self.model)

    def advance(self, counter: Counter, total: int) -> None:
        key = id(counter)
        counter.inc(total - self._reported.get(key, 0))
        self._reported[key] = total

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class VllmMetrics(_PrometheusFamily):
    def __init__(self, model: str, cpu_tier: bool = False) -> None:
        super().__init__(model)
        self.running = self.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=self.registry,
        )
        self.queries = self.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = self.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external = (
            (
                self.counter(
                    "vllm:external_prefix_cache_queries",
                    "External prefix cache queries from KV connector cross-instance cache "
                    "sharing, in terms of number of queried tokens.",
                ),
                self.counter(
                    "vllm:external_prefix_cache_hits",
                    "External prefix cache hits from KV connector cross-instance cache sharing, "
                    "in terms of number of cached tokens.",
                ),
            )
            if cpu_tier
            else None
        )
        self.prompt_tokens = self.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = self.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.finished_requests = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        ).labels(model, "length")
        self.ttft = self.histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = self.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)

    def render(self, scheduler: Scheduler) -> tuple[bytes, str]:
        cache = scheduler.cache
        gpu_hits = cache.hits_tokens - cache.cpu_hits_tokens  # the GPU prefix cache's own hits
        self.advance(self.queries, cache.queries_tokens)
        self.advance(self.hits, gpu_hits)
        if self.external is not None:  # the connector is asked for what the GPU cache did not have
            self.advance(self.external[0], cache.queries_tokens - gpu_hits)
            self.advance(self.external[1], cache.cpu_hits_tokens)
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(cache.usage())
        self.cache_config.labels(str(cache.block_size), str(cache.num_blocks), "True").set(1)
        return self.exposition()


class SglangMetrics(_PrometheusFamily):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.running = self.gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queued = self.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.max_tokens = self.gauge("sglang:max_total_num_tokens", "Maximum total number of tokens")
        self.used_tokens = self.gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = self.gauge("sglang:token_usage", "The token usage.")
        self.hit_rate = self.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.prompt_tokens = self.counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self.counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = self.counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.finished_requests = self.counter("sglang:num_requests", "Number of requests processed.")
        self.ttft = self.histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = self.histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
        )

    def render(self, scheduler: Scheduler) -> tuple[bytes, str]:
        cache = scheduler.cache
        self.advance(self.cached_tokens, cache.hits_tokens)
        self.running.set(len(scheduler.running))
        self.queued.set(len(scheduler.waiting))
        self.max_tokens.set(cache.num_blocks * cache.block_size)
        self.used_tokens.set(cache.used_blocks * cache.block_size)
        self.token_usage.set(cache.usage())
        self.hit_rate.set(cache.hits_tokens / cache.queries_tokens if cache.queries_tokens else 0.0)
        return self.exposition()


class TrtllmIterationStats:
    def __init__(self) -> None:
        self.iterations: deque[dict] = deque(maxlen=ITERATION_STATS_KEPT)
        self.iter = 0
        self.alloc_new = self.reused = self.missed = 0

    def on_step(self, result: StepResult, scheduler: Scheduler, ttft_s: list[float], e2e_s: list[float]) -> None:
        cache = scheduler.cache
        for req in result.admitted:
            reused = req.hit_tokens // cache.block_size
            self.reused += reused
            self.missed += cache.blocks_for(len(req.prompt)) - reused
            self.alloc_new += cache.blocks_for(len(req.prompt) + req.max_tokens) - reused
        prefilling = [r for r in scheduler.running if not r.prefill_done]
        lookups = self.reused + self.missed
        self.iterations.append(
            {
                "iter": self.iter,
                "iterLatencyMS": result.seconds * 1000.0,
                "numActiveRequests": len(scheduler.running),
                "numQueuedRequests": len(scheduler.waiting),
                "numCompletedRequests": len(result.finished),
                "maxNumActiveRequests": scheduler.max_num_seqs,
                "kvCacheStats": {
                    "maxNumBlocks": cache.num_blocks,
                    "freeNumBlocks": cache.num_blocks - cache.used_blocks,
                    "usedNumBlocks": cache.used_blocks,
                    "tokensPerBlock": cache.block_size,
                    "allocTotalBlocks": self.alloc_new + self.reused,
                    "allocNewBlocks": self.alloc_new,
                    "reusedBlocks": self.reused,
                    "missedBlocks": self.missed,
                    "cacheHitRate": self.reused / lookups if lookups else 0.0,
                },
                "inflightBatchingStats": {
                    "numScheduledRequests": result.decode_seqs + len(result.first_tokens) + len(prefilling),
                    "numContextRequests": len(result.first_tokens) + len(prefilling),
                    "numGenRequests": result.decode_seqs,
                    "numPausedRequests": 0,
                    "numCtxTokens": result.prefill_tokens,
                },
            }
        )
        self.iter += 1

    def render(self, scheduler: Scheduler) -> tuple[bytes, str]:
        out = list(self.iterations)
        self.iterations.clear()
        return json.dumps(out).encode(), "application/json"
