"""Engine load from the engine's own metrics endpoint, shipped with heartbeats.

- vLLM, Prometheus `/metrics`: running / waiting = `vllm:num_requests_running`,
  `vllm:num_requests_waiting`; KV usage = `vllm:kv_cache_usage_perc` (older `vllm:gpu_cache_usage_perc`).
- SGLang, Prometheus `/metrics` (server started with `--enable-metrics`): `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage` (fraction of KV tokens in use).
- KV capacity in tokens, beside the usage (0 when the engine does not say): vLLM's info gauge
  `vllm:cache_config_info`, labels `num_gpu_blocks` x `block_size` (vLLM's CacheConfig.metrics_info);
  SGLang's gauge `sglang:max_total_num_tokens`; TensorRT-LLM's `kvCacheStats.maxNumBlocks` x
  `tokensPerBlock`. Summed over label sets, as the counts are.
- TensorRT-LLM, `GET /metrics` on trtllm-serve: a JSON list of iteration stats since the last call;
  the newest entry's `numActiveRequests`, `numQueuedRequests` and `kvCacheStats`
  (`usedNumBlocks / maxNumBlocks`). Missing fields count as unknown (usage kept as last known); an
  empty list means the executor did not step since the last poll, i.e. nothing ran.
Prometheus counts are summed over label sets (one per engine core / DP rank / model name), usage is
averaged (a sum of per-engine fractions would exceed 1).

Work (`EngineWork`, cumulative; `worker_agent/event_silence.py` compares it with the KV events that
arrived): the prompt tokens the engine computed rather than served from its prefix cache, and the
requests they belong to, from the same poll:
- vLLM: `vllm:prefix_cache_queries_total - vllm:prefix_cache_hits_total` (before vLLM 0.10:
  `vllm:gpu_prefix_cache_*`), counted when a request is scheduled; requests =
  `vllm:time_to_first_token_seconds_count`, one per request right after its prefill;
- SGLang: `sglang:prompt_tokens_total - sglang:cached_tokens_total` (every `cache_source`), requests
  = `sglang:num_requests_total`, all three counted when a request finishes;
- TensorRT-LLM: each drained iteration's `inflightBatchingStats.numCtxTokens` (context tokens run,
  reused ones not included) and `numContextRequests` (a chunked context counts once per chunk:
  more requests, so less proven work), summed by the poller.
An engine that exports none of these (SGLang without `--enable-metrics`, an older vLLM) has no work. The text is read by prometheus_client's
parser (`kvroute.prom_text`); a malformed line naming a load metric is skipped, the others still count. When the engine is unreachable (or answers without any
of these metrics) the load stays last-known (its `observed_unix_ms` ages) and `failures` rises.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import msgspec

from kvroute.poller import poll_forever
from kvroute.prom_text import samples
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.agent.engine_metrics")


@dataclass(frozen=True)
class EngineWork:
    """Prompt work an engine did since it started: tokens computed (not served from its prefix cache)
    and the requests they belong to. Cumulative, so two samples' difference is the work in between."""

    computed_tokens: float
    requests: float

    def __add__(self, other: EngineWork) -> EngineWork:
        return EngineWork(self.computed_tokens + other.computed_tokens, self.requests + other.requests)


@dataclass(frozen=True)
class PrometheusLoadNames:
    """The metric names an engine reports its load and its work under."""

    running: str
    waiting: str
    usage: tuple[str, ...]  # KV usage 0..1, newest name first
    capacity: str = ""  # KV capacity: the sample's num_gpu_blocks x block_size labels, else its value, in tokens
    # (prompt tokens looked up, of those served from the cache), newest names first; and the requests counter
    prompt_cached: tuple[tuple[str, str], ...] = ()
    requests: str = ""

    @property
    def load_names(self) -> tuple[str, ...]:
        return (self.running, self.waiting, *self.usage)

    @property
    def wanted(self) -> tuple[str, ...]:
        work = [name for pair in self.prompt_cached for name in pair] + ([self.requests] if self.requests else [])
        return (*self.load_names, *work, *([self.capacity] if self.capacity else []))


VLLM_METRICS = PrometheusLoadNames(
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "vllm:cache_config_info",
    (
        ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
        ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
    ),
    "vllm:time_to_first_token_seconds_count",
)
SGLANG_METRICS = PrometheusLoadNames(
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    ("sglang:token_usage",),
    "sglang:max_total_num_tokens",
    (("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),),
    "sglang:num_requests_total",
)
PROMETHEUS_ENGINES = {"vllm": VLLM_METRICS, "sglang": SGLANG_METRICS}


def _samples(text: str, names: PrometheusLoadNames) -> Iterator[tuple[str, float]]:
    """(name, value) of every finite sample of a wanted name. If a line naming one is malformed, each line
    is parsed on its own and the malformed ones are skipped: one bad line does not hide the engine's load."""
    try:
        found = list(samples(text, names.wanted))
    except ValueError:
        found = []
        for line in text.splitlines():
            try:
                found += samples(line, names.wanted)
            except ValueError:
                continue
    for sample in found:
        if math.isfinite(sample.value):
            if sample.name == names.capacity:
                yield sample.name, _capacity_tokens(sample.labels, sample.value)
            else:
                yield sample.name, sample.value


def _capacity_tokens(labels: dict[str, str], value: float) -> float:
    """An info gauge's num_gpu_blocks x block_size labels (vLLM), else the sample's value (tokens)."""
    if "num_gpu_blocks" in labels:
        try:
            return max(0.0, float(labels["num_gpu_blocks"]) * float(labels.get("block_size", "0")))
        except ValueError:  # "None" before the engine has profiled its memory
            return 0.0
    return max(0.0, value)


def _now_ms(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else now_ms


def parse_metrics(
    text: str, names: PrometheusLoadNames = VLLM_METRICS, now_ms: int | None = None
) -> tuple[pb.WorkerLoad, EngineWork | None]:
    """(WorkerLoad, EngineWork or None when the engine exports no work counters) from a Prometheus text
    exposition. Raises ValueError if it holds none of the engine's load metrics."""
    sums = {name: 0.0 for name in names.wanted}
    counts = {name: 0 for name in names.wanted}
    for name, value in _samples(text, names):
        sums[name] += value
        counts[name] += 1
    if not any(counts[name] for name in names.load_names):
        raise ValueError(f"no {names.running} / {names.waiting} / {names.usage[0]} metrics in the response")
    usage_name = next((n for n in names.usage if counts[n]), None)
    usage = sums[usage_name] / counts[usage_name] if usage_name else 0.0
    load = pb.WorkerLoad(
        running_requests=max(0, int(sums[names.running])),
        waiting_requests=max(0, int(sums[names.waiting])),
        kv_usage=min(1.0, max(0.0, usage)),
        observed_unix_ms=_now_ms(now_ms),
        kv_capacity_tokens=int(sums[names.capacity]) if names.capacity and math.isfinite(sums[names.capacity]) else 0,
    )
    pair = next((p for p in names.prompt_cached if counts[p[0]]), None)
    if pair is None or not counts[names.requests]:
        return load, None
    return load, EngineWork(max(0.0, sums[pair[0]] - sums[pair[1]]), sums[names.requests])


def parse_load(text: str, names: PrometheusLoadNames = VLLM_METRICS, now_ms: int | None = None) -> pb.WorkerLoad:
    """WorkerLoad from a Prometheus text exposition. Raises ValueError if it holds none of the engine's load metrics."""
    return parse_metrics(text, names, now_ms)[0]


class _KvCacheStats(msgspec.Struct):
    max_blocks: int | None = msgspec.field(default=None, name="maxNumBlocks")
    used_blocks: int | None = msgspec.field(default=None, name="usedNumBlocks")
    tokens_per_block: int | None = msgspec.field(default=None, name="tokensPerBlock")


class _InflightBatchingStats(msgspec.Struct):
    context_requests: int | None = msgspec.field(default=None, name="numContextRequests")
    context_tokens: int | None = msgspec.field(default=None, name="numCtxTokens")


class _IterationStats(msgspec.Struct):
    active: int | None = msgspec.field(default=None, name="numActiveRequests")
    queued: int | None = msgspec.field(default=None, name="numQueuedRequests")
    kv_cache: _KvCacheStats | None = msgspec.field(default=None, name="kvCacheStats")
    batching: _InflightBatchingStats | None = msgspec.field(default=None, name="inflightBatchingStats")


_dec_trtllm_stats = msgspec.json.Decoder(list[_IterationStats])


def parse_trtllm_metrics(body: bytes, last: pb.WorkerLoad, now_ms: int | None = None) -> tuple[pb.WorkerLoad, EngineWork | None]:
    """(WorkerLoad, the work of these iterations or None when they carry no batching stats) from
    trtllm-serve's `GET /metrics` JSON (iteration stats, drained by each call). Raises ValueError if
    it is not that."""
    try:
        stats = _dec_trtllm_stats.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a JSON list of TensorRT-LLM iteration stats: {exc}") from None
    batching = [s.batching for s in stats if s.batching is not None]
    work = (
        EngineWork(
            float(sum(max(0, b.context_tokens or 0) for b in batching)),
            float(sum(max(0, b.context_requests or 0) for b in batching)),
        )
        if batching or not stats
        else None
    )
    return _trtllm_load(stats, last, now_ms), work


def parse_trtllm_stats(body: bytes, last: pb.WorkerLoad, now_ms: int | None = None) -> pb.WorkerLoad:
    """WorkerLoad from trtllm-serve's `GET /metrics` JSON (iteration stats). Raises ValueError if it is not that."""
    return parse_trtllm_metrics(body, last, now_ms)[0]


def _trtllm_load(stats: list[_IterationStats], last: pb.WorkerLoad, now_ms: int | None) -> pb.WorkerLoad:
    if not stats:
        return pb.WorkerLoad(
            running_requests=0,
            waiting_requests=0,
            kv_usage=last.kv_usage,
            observed_unix_ms=_now_ms(now_ms),
            kv_capacity_tokens=last.kv_capacity_tokens,
        )
    newest = stats[-1]
    usage, capacity = last.kv_usage, last.kv_capacity_tokens
    kv = newest.kv_cache
    if kv is not None and kv.max_blocks and kv.used_blocks is not None:
        usage = min(1.0, max(0.0, kv.used_blocks / kv.max_blocks))
    if kv is not None and kv.max_blocks and kv.tokens_per_block:
        capacity = max(0, kv.max_blocks * kv.tokens_per_block)
    return pb.WorkerLoad(
        running_requests=max(0, newest.active or 0),
        waiting_requests=max(0, newest.queued or 0),
        kv_usage=usage,
        observed_unix_ms=_now_ms(now_ms),
        kv_capacity_tokens=capacity,
    )


class EngineLoadPoller:
    def __init__(self, engine_url: str, engine: str = "vllm", interval_s: float = 0.5, timeout_s: float = 2.0) -> None:
        if engine != "trtllm" and engine not in PROMETHEUS_ENGINES:
            raise ValueError(f"no load metrics known for engine {engine!r}")
        self.engine = engine
        self.url = engine_url.rstrip("/") + "/metrics"
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.latest = pb.WorkerLoad()
        self.work: EngineWork | None = None  # cumulative; None while the engine exported no work counters
        self.work_at: float | None = None  # monotonic time of the poll that read `work`
        self.polls = 0
        self.failures = 0
        self._problems = RateLimitedLog(log, period_s=60.0)

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        self.polls += 1
        try:
            async with session.get(self.url) as resp:
                resp.raise_for_status()
                if self.engine == "trtllm":  # the iterations since the last call: their work adds up here
                    self.latest, work = parse_trtllm_metrics(await resp.read(), self.latest)
                    if work is not None:
                        work = work if self.work is None else self.work + work
                else:
                    self.latest, work = parse_metrics(await resp.text(), PROMETHEUS_ENGINES[self.engine])
        except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
            self.failures += 1
            self._problems.warning(
                "unavailable",
                "engine metrics %s unavailable (%d failures), keeping the last known load: %s",
                self.url,
                self.failures,
                exc or type(exc).__name__,
            )
            return False
        self._problems.recovered("unavailable", "engine metrics %s available again", self.url)
        if work is not None:
            self.work, self.work_at = work, time.monotonic()
        return True

    async def run(self) -> None:
        await poll_forever(self.poll_once, self.interval_s, self.timeout_s)
