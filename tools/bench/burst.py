"""`kvroute bench burst`: one new prefix arriving all at once, through several routers (`--routers`, 2).

64 requests share a new 4096-token prefix (each with its own 64-token tail) and are sent at
the same instant, in turn to each router process. No engine event about the prefix
exists yet, so where the burst lands is decided by the routers' in-flight state alone. Three
numbers, side by side:

- `reference_workers`: how many workers kv_aware picks when ONE decision sequence sees every
  earlier decision (what the load bound requires: the bound, not affinity, decides when to add
  a worker);
- `shared`: workers used by the routers sharing in-flight state through the control plane
  (RouterSession reservations, reaching each other's views; the default);
- `unshared`: the same with `--no-router-session` (each router sees only its own requests).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.cp_link.control_plane_client import KnownWorker
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.candidates import build_candidates
from kvroute.data_plane.decision.policies import RoutingInput, RoutingPolicy, make_policy
from kvroute.v1 import kvroute_pb2 as pb

BURST_REQUESTS = 64
PREFIX_TOKENS = 4096
TAIL_TOKENS = 64
VOCAB = 2000  # the tiny sim model's vocabulary is 2048


def burst_prompts(seed: int, requests: int = BURST_REQUESTS) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(TAIL_TOKENS)] for _ in range(requests)]


def burst_decisions(
    policy: RoutingPolicy, prompts: list[list[int]], workers: int = 8, block_size: int = 16, speculative: bool = True
) -> list[str]:
    """Where `prompts` arriving at once go on an empty fleet when each decision sees all earlier ones
    through a router's tracker (in-flight load, and speculative holders unless `speculative` is off)."""
    tracker = RouterInflight()
    known = [KnownWorker(f"w{i}", "m", "", block_size, pb.WorkerLoad()) for i in range(workers)]
    chosen = []
    for tokens in prompts:
        keys = prompt_block_keys(tokens, block_size, "m")
        # No index yet (a new prefix): the router's fail-open candidates, from its own in-flight state.
        candidates = build_candidates(known, tracker, {block_size: keys} if speculative else {}, len(tokens))
        choice = policy.choose(RoutingInput("m", len(tokens), token_ids=tokens, chains={block_size: keys}), candidates)
        tracker.start(choice.worker.worker_id, len(tokens) - choice.worker.cached_tokens, keys)
        chosen.append(choice.worker.worker_id)
    return chosen


def reference_workers(workers: int, prompts: list[list[int]], block_size: int = 16, **params) -> int:
    """Workers kv_aware uses for `prompts` arriving at once when each decision sees all earlier ones
    (in-flight load and speculative holders), on an empty fleet: what its load bound requires."""
    return len(set(burst_decisions(make_policy("kv_aware", seed=0, **params), prompts, workers, block_size)))


def send_burst(router_urls: list[str], model: str, prompts: list[list[int]], max_tokens: int = 8) -> list[str]:
    """POST every prompt at once (round-robin over the routers); the worker that served each one."""

    async def main() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def one(i: int, tokens: list[int]) -> str:
                body = {"model": model, "prompt": tokens, "max_tokens": max_tokens}
                async with session.post(router_urls[i % len(router_urls)] + "/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.headers.get("x-kvroute-worker", "") if resp.status == 200 else ""

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def run_burst(workers: int = 8, seed: int = 11, routers: int = 2) -> dict:
    from kvroute.tools.local_cluster import LocalCluster, http_get, wait_until
    from kvroute.tools.tiny_model import build_model_dir

    workdir = Path(tempfile.mkdtemp(prefix="kvroute-burst-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / "tiny-llama"))
    result: dict = {"workers": workers, "routers": routers, "requests": BURST_REQUESTS, "prefix_tokens": PREFIX_TOKENS}
    try:
        cluster.start_sim_fleet(workers, "--num-blocks", "4096", "--speedup", "2")
        shared = [f"r{i}" for i in range(routers)]
        unshared = [f"r{i}-unshared" for i in range(routers)]
        cluster.wait_workers_registered(workers)
        for name in shared:
            cluster.start_router(name, "kv_aware")
        for name in unshared:
            cluster.start_router(name, "kv_aware", "--no-router-session")
        for name in (*shared, *unshared):  # every worker known: a router still syncing decides on load alone
            url = cluster.router_urls[name]
            wait_until(
                lambda url=url: json.loads(http_get(url + "/ready")[1]).get("workers") == workers,
                30,
                f"router {name} with all {workers} workers",
                cluster.all_processes(),
            )
        for label, names, seed_offset in (("shared", shared, 0), ("unshared", unshared, 1)):
            prompts = burst_prompts(seed + seed_offset)  # a new prefix for each run
            started = time.perf_counter()
            served = send_burst([cluster.router_urls[n] for n in names], cluster.model, prompts)
            used = Counter(served)
            result[label] = {
                "workers_used": len(used),
                "per_worker": dict(sorted(used.items())),
                "failed": served.count(""),
                "wall_s": round(time.perf_counter() - started, 2),
            }
            time.sleep(1.0)  # let the engines finish before the next burst
        result["reference_workers"] = reference_workers(workers, burst_prompts(seed))
    finally:
        cluster.stop()
    return result
