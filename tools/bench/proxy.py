"""Router proxy overhead: the same small completion sent directly to an engine and through the
router (control plane, agent and router as separate processes), interleaved, side by side."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from kvroute.tools.local_cluster import LocalCluster, http_post_json, wait_until
from kvroute.tools.stats import percentile
from kvroute.tools.tiny_model import build_model_dir


async def measure(direct_url: str, router_url: str, model: str, requests: int) -> dict:
    body = {"model": model, "prompt": "the cache router worker model request latency", "max_tokens": 1}
    direct, routed = [], []
    async with aiohttp.ClientSession() as session:
        for i in range(requests + 20):
            for url, sink in ((direct_url, direct), (router_url, routed)):
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                if i >= 20:
                    sink.append((time.perf_counter() - started) * 1000)
    return {"direct_p50_ms": round(percentile(direct, 50), 3), "direct_p99_ms": round(percentile(direct, 99), 3),
            "router_p50_ms": round(percentile(routed, 50), 3), "router_p99_ms": round(percentile(routed, 99), 3),
            "requests": requests}


def run_proxy(requests: int = 300) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / "tiny-llama"))
    try:
        engine, = cluster.start_sim_fleet(1, "--speedup", "1000000")
        router = cluster.start_router("bench", "kv_aware")
        probe = {"model": cluster.model, "prompt": "probe"}
        wait_until(lambda: json.loads(http_post_json(router + "/v1/route", probe)[1]).get("fail_open") is False, 30,
                   "router sees the control plane")
        return asyncio.run(measure(engine.url, router, cluster.model, requests))
    finally:
        cluster.stop()
