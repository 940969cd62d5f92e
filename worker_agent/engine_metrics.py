"""Engine load from its own Prometheus /metrics (vLLM names), shipped with heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.agent.metrics")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newer, older name


def parse_load(text: str) -> pb.WorkerLoad:
    running = waiting = 0.0
    usage = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RUNNING:
                running += sample.value
            elif sample.name == WAITING:
                waiting += sample.value
            elif sample.name in KV_USAGE:
                usage = max(usage or 0.0, sample.value)
    return pb.WorkerLoad(running_requests=int(running), waiting_requests=int(waiting), kv_usage=usage or 0.0,
                         observed_unix_ms=int(time.time() * 1000))


class EngineLoadPoller:
    def __init__(self, engine_url: str, interval_s: float = 0.5) -> None:
        self.url = engine_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.latest = pb.WorkerLoad()
        self.failures = 0

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                try:
                    async with session.get(self.url) as resp:
                        resp.raise_for_status()
                        self.latest = parse_load(await resp.text())
                except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                    self.failures += 1
                    if self.failures in (1, 10) or self.failures % 100 == 0:
                        log.warning("engine metrics %s unavailable (%d failures): %s", self.url, self.failures, exc)
                await asyncio.sleep(self.interval_s)
