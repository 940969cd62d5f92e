"""Engine load from its own Prometheus `/metrics` (vLLM metric names), shipped with heartbeats.

- running / waiting: `vllm:num_requests_running`, `vllm:num_requests_waiting`, summed over
  label sets (one per engine core / model name);
- KV usage: `vllm:kv_cache_usage_perc` (older name `vllm:gpu_cache_usage_perc`), 0..1, averaged
  over label sets (a sum of per-engine fractions would exceed 1).
The parser is a tolerant line scan: lines it does not understand are skipped. When the engine is
unreachable (or answers without any of these metrics) the load stays last-known (its
`observed_unix_ms` ages) and `failures` rises.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp

from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.agent.engine_metrics")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
_WANTED = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)


def _samples(text: str):
    """(name, value) of every `vllm:` sample line; malformed lines are skipped."""
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                continue
            rest = line[close + 1:].split()
        else:
            if space == -1:
                continue
            name = line[:space]
            rest = line[space + 1:].split()
        if name not in _WANTED or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value):
            yield name, value


def parse_load(text: str, now_ms: int | None = None) -> pb.WorkerLoad:
    """WorkerLoad from a Prometheus text exposition. Raises ValueError if it holds no vLLM load metric."""
    sums = {name: 0.0 for name in _WANTED}
    counts = {name: 0 for name in _WANTED}
    for name, value in _samples(text):
        sums[name] += value
        counts[name] += 1
    if not any(counts.values()):
        raise ValueError("no vllm:num_requests_* / vllm:kv_cache_usage_perc metrics in the response")
    usage_name = KV_USAGE if counts[KV_USAGE] else KV_USAGE_OLD
    usage = sums[usage_name] / counts[usage_name] if counts[usage_name] else 0.0
    return pb.WorkerLoad(running_requests=max(0, int(sums[RUNNING])), waiting_requests=max(0, int(sums[WAITING])),
                         kv_usage=min(1.0, max(0.0, usage)),
                         observed_unix_ms=int(time.time() * 1000) if now_ms is None else now_ms)


class EngineLoadPoller:
    def __init__(self, engine_url: str, interval_s: float = 0.5, timeout_s: float = 2.0) -> None:
        self.url = engine_url.rstrip("/") + "/metrics"
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.latest = pb.WorkerLoad()
        self.polls = 0
        self.failures = 0
        self._failing_since: int | None = None

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        self.polls += 1
        try:
            async with session.get(self.url) as resp:
                resp.raise_for_status()
                self.latest = parse_load(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
            self.failures += 1
            if self._failing_since is None:
                self._failing_since = self.failures
                log.warning("engine metrics %s unavailable, keeping the last known load: %s", self.url, exc or type(exc).__name__)
            elif (self.failures - self._failing_since) % 120 == 0:
                log.warning("engine metrics %s still unavailable (%d failures): %s", self.url, self.failures, exc)
            return False
        if self._failing_since is not None:
            log.info("engine metrics %s available again", self.url)
            self._failing_since = None
        return True

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self.interval_s)
