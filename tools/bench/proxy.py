"""What a router adds to a request, stage by stage, next to a pass-through floor and other routers.

One fleet (a control plane, sim engines with their agents; the engines answer at once: 1e6x
speed-up), and in front of it, each its own process:
- a kvroute router per policy asked for, with `--stage-timing` (GET /debug/stages);
- `passthrough`: the router's HTTP server and proxy with no decision (`passthrough.py`), the floor
  of the stack;
- with `--peer smg`: SGLang's gateway with round_robin and with cache_aware (`peers.py`).

The same tiny completion (`max_tokens` 1) is sent sequentially over keep-alive connections, in
every round once directly to an engine and once through each target, in the same order, so load
on the machine lands on all of them alike. A target's added latency is its p50 (p99) minus the
direct requests' p50 (p99). The routers' own stage samples give the per-stage p50/p99; the time
outside them (accepting, HTTP parsing, writing the response) is what the pass-through floor shows.
`decides_on_own_view` says per kvroute router whether its decisions read its own view of the fleet
(`--index local`, the router's default for kv_aware) rather than a control-plane query.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from kvroute.prom_text import sample_sums
from kvroute.tools.bench.peers import PEERS, start_peer
from kvroute.tools.local_cluster import (
    LocalCluster,
    ManagedProcess,
    free_port,
    http_get,
    http_ok,
    http_post_json,
    wait_until,
)
from kvroute.tools.stats import percentile
from kvroute.tools.tiny_model import build_model_dir

PROMPT = "the cache router worker model request latency"
WARMUP = 20


async def measure(direct_url: str, targets: dict[str, str], model: str, requests: int) -> dict[str, list[float]]:
    """Latency samples (ms) per target and for "direct", interleaved round by round."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    order = [("direct", direct_url), *targets.items()]
    samples: dict[str, list[float]] = {name: [] for name, _ in order}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for i in range(requests + WARMUP):
            for name, url in order:
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{name} answered {resp.status}")
                if i >= WARMUP:
                    samples[name].append((time.perf_counter() - started) * 1000)
    return samples


def decides_on_own_view(router_url: str) -> bool:
    """Does the router decide on its own view of the fleet (`--index local`)? Such a router exports
    kvroute_router_view_synced, 1 once its view synced; one that asks the control plane, or whose
    policy reads no index, holds no view."""
    status, body = http_get(router_url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{router_url}/metrics answered {status}")
    return bool(sample_sums(body.decode(), {"kvroute_router_view_synced"}).get("kvroute_router_view_synced"))


def _stats(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 50), 3), "p99": round(percentile(values, 99), 3)}


def _stage_samples(url: str) -> dict[str, list[float]]:
    with urllib.request.urlopen(url + "/debug/stages?reset=1", timeout=10) as resp:
        return json.loads(resp.read())


def run_proxy(
    requests: int = 2000, policies: tuple[str, ...] = ("round_robin", "kv_aware"), peers: tuple[str, ...] = (), engines: int = 2
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / "tiny-llama"))
    extra: list[ManagedProcess] = []
    try:
        fleet = cluster.start_sim_fleet(engines, "--speedup", "1000000")
        engine_urls = [e.url for e in fleet]
        targets: dict[str, str] = {}
        port = free_port()
        passthrough = ManagedProcess(
            "passthrough",
            [sys.executable, "-m", "kvroute.tools.bench.passthrough", "--engine", engine_urls[0], "--port", str(port)],
            workdir / "passthrough.log",
        )
        passthrough.start()
        extra.append(passthrough)
        targets["passthrough"] = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(targets["passthrough"] + "/health"), 30, "passthrough", [passthrough])
        probe = {"model": cluster.model, "prompt": "probe"}
        for policy in policies:
            url = cluster.start_router(policy, policy, "--stage-timing")
            wait_until(
                lambda u=url: json.loads(http_post_json(u + "/v1/route", probe)[1]).get("fail_open") is False,
                30,
                f"router {policy} sees the control plane",
            )
            targets[f"kvroute:{policy}"] = url
        for name in peers:
            peer = PEERS[name]
            for policy in peer.policies:
                proc, url = start_peer(peer, policy, engine_urls, workdir)
                extra.append(proc)
                targets[f"{name}:{policy}"] = url
        for name in [n for n in targets if n.startswith("kvroute:")]:  # warm-up and probes are not measured
            _stage_samples(targets[name])
        own_view = {name: decides_on_own_view(url) for name, url in targets.items() if name.startswith("kvroute:")}
        samples = asyncio.run(measure(engine_urls[0], targets, cluster.model, requests))
        stages = {
            name: {stage: _stats(values) for stage, values in _stage_samples(targets[name]).items() if values}
            for name in targets
            if name.startswith("kvroute:")
        }
    finally:
        for proc in extra:
            proc.stop()
        cluster.stop()
    direct = _stats(samples.pop("direct"))
    result: dict = {"requests": requests, "engines": engines, "direct_p50_ms": direct["p50"], "direct_p99_ms": direct["p99"]}
    by_target = {name: _stats(values) for name, values in samples.items()}
    result["latency_ms"] = by_target
    result["stages_ms"] = stages
    result["decides_on_own_view"] = own_view
    result["added_p50_ms"] = {name: round(s["p50"] - direct["p50"], 3) for name, s in by_target.items()}
    result["added_p99_ms"] = {name: round(s["p99"] - direct["p99"], 3) for name, s in by_target.items()}
    return result


def format_table(result: dict) -> str:
    """The human-readable report: added latency per target, then each kvroute router's stages."""
    lines = [
        (
            f"direct to an engine: p50 {result['direct_p50_ms']:.3f} ms, p99 {result['direct_p99_ms']:.3f} ms "
            f"({result['requests']} requests per target, interleaved)"
        ),
        "",
        f"{'target':<22} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}",
    ]
    for name, s in result["latency_ms"].items():
        lines.append(
            f"{name:<22} {s['p50']:>8.3f} {s['p99']:>8.3f} {result['added_p50_ms'][name]:>+10.3f} "
            f"{result['added_p99_ms'][name]:>+10.3f}"
        )
    for name, stages in result["stages_ms"].items():
        lines += ["", f"{name} stages (inside the handler)   p50 ms   p99 ms"]
        lines += [f"  {stage:<33} {s['p50']:>7.3f} {s['p99']:>8.3f}" for stage, s in stages.items()]
    return "\n".join(lines)
