"""`kvroute demo`: local fleets on the embedded default (no GPU, no Redis, simulated engines).

Starts, per routing policy, an identical fleet: a control plane, N sim engines each with its own
agent, and a router, as separate processes on loopback. Replays the same shared-prefix multi-turn
chat workload through every policy's router at the same time, so whatever else runs on the
machine meanwhile (other processes, a noisy neighbour's CPU steal) hits every policy alike; a
`DisturbanceMonitor` measures how much that was and the demo says so. Prints a table and, as the
last stdout line, one JSON object with per-policy requests, fail-open decisions (the router's own
metric), engine-measured token hit rate, client-measured TTFT P50/P99, and the disturbance figures.

`--models N`: each fleet serves N models behind its one router (`tiny-llama`, `tiny-llama-2`, ...,
the same tiny tokenizer under other names; engine i serves model i mod N) and conversation i asks
for model i mod N. Then each policy also reports its hit rate per model (from that model's engines)
and `misrouted`: requests answered by an engine of another model (0, or the router is wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.process import name_list
from kvroute.prom_text import sample_sums
from kvroute.tools.disturbance import Disturbance, DisturbanceMonitor
from kvroute.tools.local_cluster import LocalCluster, engine_prefix_counters, http_get, http_post_json, wait_until
from kvroute.tools.stats import percentile

FAIL_OPEN_METRIC = "kvroute_router_fail_open_total"
_WORDS = [
    "cache",
    "token",
    "prefix",
    "router",
    "worker",
    "model",
    "request",
    "latency",
    "block",
    "memory",
    "engine",
    "query",
    "index",
    "policy",
    "load",
    "queue",
    "system",
    "user",
    "assistant",
    "document",
    "answer",
    "question",
    "tool",
    "schema",
    "function",
    "value",
    "result",
    "error",
    "time",
    "first",
    "compute",
    "prefill",
    "decode",
    "batch",
    "stream",
    "event",
    "key",
    "hash",
    "store",
    "remove",
    "update",
    "graph",
    "kernel",
    "tensor",
    "layer",
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "this",
    "are",
    "or",
    "from",
    "at",
    "which",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4, help="sim engines (each with its own agent) in each policy's fleet")
    from kvroute.data_plane.decision.policies import POLICIES

    p.add_argument(
        "--policies",
        type=name_list(POLICIES, "policy"),
        default="kv_aware,round_robin",
        help="comma-separated routing policies to compare",
    )
    p.add_argument("--system-prompts", type=int, default=16, help="distinct shared system prompts")
    p.add_argument("--system-prompt-words", type=int, default=1000, help="words per system prompt")
    p.add_argument("--conversations", type=int, default=96, help="conversations per policy run")
    p.add_argument("--turns", type=int, default=4, help="user turns per conversation (history grows per turn)")
    p.add_argument("--user-words", type=int, default=40, help="words per user message")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--arrival-rate", type=float, default=8.0, help="conversation starts per second (Poisson)")
    p.add_argument("--think-time", type=float, default=0.3, help="seconds between a reply and the next turn")
    p.add_argument("--num-blocks", type=int, default=320, help="KV cache capacity of each engine, in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--speedup", type=float, default=2.0, help="sim engines run this many times faster than the cost model")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument(
        "--models",
        type=int,
        default=1,
        help="models each fleet serves behind its one router (engine i serves model i mod N, "
        "conversation i asks for model i mod N; at most --engines)",
    )
    p.add_argument(
        "--workdir",
        default="",
        help="directory for the tiny model and each policy's logs (in a subdirectory "
        "named after it), kept (default: a temporary "
        "directory, removed at the end unless something failed)",
    )


def validate(args: argparse.Namespace) -> None:
    """Flags valid alone but not together (checked when parsed, by `kvroute config check` too)."""
    if not 1 <= args.models <= args.engines:
        raise ValueError(f"--models {args.models}: each model needs an engine of its own (1 to --engines {args.engines})")


@dataclass
class Conversation:
    system: str
    user_turns: list[str]
    start_offset_s: float
    model: str = "tiny-llama"


def model_names(count: int) -> list[str]:
    """The demo's models: the tiny model under its own name, then under others (its tokenizer each time)."""
    return ["tiny-llama"] + [f"tiny-llama-{i}" for i in range(2, count + 1)]


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    queries: float = 0.0
    hits: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)
    per_model_worker: dict[tuple[str, str], int] = field(default_factory=dict)  # (model asked, worker) -> answers
    hits_by_model: dict[str, tuple[float, float]] = field(default_factory=dict)  # model -> (queried, hit) tokens
    misrouted: int = 0  # answers from an engine of another model than the request's
    wall_s: float = 0.0
    fail_open: float = 0.0  # decisions the router made on load alone during the replay (its own metric)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def hit_rate_by_model(self) -> dict[str, float]:
        return {model: hit / queried if queried else 0.0 for model, (queried, hit) in sorted(self.hits_by_model.items())}


def build_workload(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)

    def text(n_words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n_words)) + "."

    systems = [f"You are assistant number {i}. " + text(args.system_prompt_words) for i in range(args.system_prompts)]
    models = model_names(args.models)
    conversations, t = [], 0.0
    for i in range(args.conversations):
        t += rng.expovariate(args.arrival_rate)
        conversations.append(
            Conversation(rng.choice(systems), [text(args.user_words) for _ in range(args.turns)], t, models[i % len(models)])
        )
    return conversations


async def run_conversation(
    session: aiohttp.ClientSession, router_url: str, conv: Conversation, args: argparse.Namespace, result: PolicyResult, t0: float
) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_offset_s - time.monotonic()))
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": user})
        body = {"model": conv.model, "messages": messages, "max_tokens": args.max_tokens, "stream": True}
        started = time.perf_counter()
        first_token_at = None
        try:
            async with session.post(router_url + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                worker = resp.headers.get("x-kvroute-worker", "?")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if first_token_at is None:
                        chunk = json.loads(line[5:])
                        choices = chunk.get("choices") or [{}]
                        if choices[0].get("delta", {}).get("content") or choices[0].get("text"):
                            first_token_at = time.perf_counter()
            finished = time.perf_counter()
        except (aiohttp.ClientError, RuntimeError, TimeoutError, ValueError) as exc:  # counted, not fatal
            result.errors += 1
            print(f"request failed: {exc}", file=sys.stderr)
            return
        result.requests += 1
        result.per_worker[worker] = result.per_worker.get(worker, 0) + 1
        result.per_model_worker[(conv.model, worker)] = result.per_model_worker.get((conv.model, worker), 0) + 1
        result.ttft_ms.append(((first_token_at or finished) - started) * 1000)
        result.e2e_ms.append((finished - started) * 1000)
        # A canned assistant reply keeps the next turn's prompt a strict extension of this one.
        messages.append({"role": "assistant", "content": f"Noted, turn {turn} handled."})
        await asyncio.sleep(args.think_time)


async def replay(
    router_url: str, workload: list[Conversation], args: argparse.Namespace, result: PolicyResult, t0: float
) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(run_conversation(session, router_url, c, args, result, t0) for c in workload))
        result.wall_s = time.monotonic() - t0


async def replay_all(
    fleets: list[PolicyFleet], workload: list[Conversation], args: argparse.Namespace, results: list[PolicyResult]
) -> None:
    """Every policy's replay of the same workload, on the same clock: request i of each policy is
    sent at the same instant, so a burst of outside load lands on all of them."""
    t0 = time.monotonic() + 0.2  # all sessions are open before the first request is due
    await asyncio.gather(*(replay(f.router_url, workload, args, r, t0) for f, r in zip(fleets, results, strict=True)))


@dataclass
class PolicyFleet:
    """One policy's own fleet: control plane, sim engines with agents, and its router."""

    policy: str
    cluster: LocalCluster
    router_url: str = ""
    model_of: dict[str, str] = field(default_factory=dict)  # worker id -> the model its engine serves

    def start(self, args: argparse.Namespace) -> None:
        models = model_names(args.models)
        engine_args = ("--num-blocks", str(args.num_blocks), "--speedup", str(args.speedup))
        if len(models) == 1:
            self.cluster.start_sim_fleet(args.engines, *engine_args)
        else:  # engine i serves model i mod N, its agent registers that model
            self.cluster.start_control_plane()
            for i in range(args.engines):
                model = models[i % len(models)]
                self.cluster.add_sim_engine(f"engine-{i}", *engine_args, "--model", model, agent_args=("--model", model))
            self.cluster.wait_engines_healthy()
            self.cluster.wait_workers_registered()
        self.model_of = {e.worker_id: models[i % len(models)] for i, e in enumerate(self.cluster.engines)}
        # One router for every model: the others' tokenizers by --model-tokenizer (the same tiny one).
        extra = [arg for model in models[1:] for arg in ("--model-tokenizer", f"{model}={self.cluster.tokenizer_dir}")]
        self.router_url = self.cluster.start_router(self.policy, self.policy, *extra)
        for model in models:
            probe = {"model": model, "messages": [{"role": "user", "content": "probe"}]}
            wait_until(
                lambda probe=probe: http_post_json(self.router_url + "/v1/route", probe)[0] == 200,
                30,
                f"{self.policy} router knows its fleet of {model}",
                self.cluster.all_processes(),
            )

    def request_path_pids(self) -> list[int]:
        """Processes whose event loop every request waits on: router, control plane, engines."""
        c = self.cluster
        procs = [c.routers[self.policy], c.control_plane, *(e.engine for e in c.engines)]
        return [p.popen.pid for p in procs if p is not None and p.popen is not None]

    def all_pids(self) -> list[int]:
        return [p.popen.pid for p in self.cluster.all_processes() if p.popen is not None]


def measure(
    fleets: list[PolicyFleet], workload: list[Conversation], args: argparse.Namespace
) -> tuple[list[PolicyResult], Disturbance]:
    """Replays the workload through every fleet at once; hit rates from each fleet's own engines."""
    before = [[engine_prefix_counters(e.url) for e in f.cluster.engines] for f in fleets]
    fail_open_before = [router_fail_opens(f.router_url) for f in fleets]
    results = [PolicyResult(f.policy) for f in fleets]
    monitor = DisturbanceMonitor(
        own_pids=[os.getpid(), *(pid for f in fleets for pid in f.all_pids())],
        loop_pids=[pid for f in fleets for pid in f.request_path_pids()],
    )
    monitor.start()
    try:
        asyncio.run(replay_all(fleets, workload, args, results))
    finally:
        disturbance = monitor.stop()
    for fleet, result, counters in zip(fleets, results, before, strict=True):
        after = [engine_prefix_counters(e.url) for e in fleet.cluster.engines]
        result.queries = sum(a[0] - b[0] for a, b in zip(after, counters, strict=True))
        result.hits = sum(a[1] - b[1] for a, b in zip(after, counters, strict=True))
        for engine, a, b in zip(fleet.cluster.engines, after, counters, strict=True):
            queried, hit = result.hits_by_model.get(fleet.model_of[engine.worker_id], (0.0, 0.0))
            result.hits_by_model[fleet.model_of[engine.worker_id]] = (queried + a[0] - b[0], hit + a[1] - b[1])
        result.misrouted = sum(n for (model, worker), n in result.per_model_worker.items() if fleet.model_of.get(worker) != model)
    for fleet, result, fail_opens in zip(fleets, results, fail_open_before, strict=True):
        result.fail_open = router_fail_opens(fleet.router_url) - fail_opens
    return results, disturbance


def router_fail_opens(router_url: str) -> float:
    """Decisions a router made on load alone so far (kvroute_router_fail_open_total, every reason)."""
    status, body = http_get(router_url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{router_url}/metrics answered {status}")
    return sample_sums(body.decode(), {FAIL_OPEN_METRIC}).get(FAIL_OPEN_METRIC, 0.0)


def print_table(results: list[PolicyResult], file=sys.stdout) -> None:
    header = (
        f"{'policy':<14}{'requests':>9}{'errors':>8}{'fail-open':>10}{'hit rate':>10}{'TTFT p50':>11}"
        f"{'TTFT p99':>11}{'e2e p50':>10}{'wall s':>8}  requests per worker"
    )
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in results:
        spread = " ".join(f"{w}={n}" for w, n in sorted(r.per_worker.items()))
        print(
            f"{r.policy:<14}{r.requests:>9}{r.errors:>8}{r.fail_open:>10.0f}{r.hit_rate:>9.1%}{percentile(r.ttft_ms, 50):>9.1f}ms"
            f"{percentile(r.ttft_ms, 99):>9.1f}ms{percentile(r.e2e_ms, 50):>8.0f}ms{r.wall_s:>8.1f}  {spread}",
            file=file,
        )
    for r in results:
        if len(r.hits_by_model) > 1:
            rates = ", ".join(f"{model} {rate:.1%}" for model, rate in r.hit_rate_by_model().items())
            print(f"{r.policy}: hit rate by model {rates}; requests answered by another model's engine: {r.misrouted}", file=file)


def run(args: argparse.Namespace) -> int:
    from kvroute.tools.tiny_model import build_model_dir

    # A directory of our own is removed at the end unless something failed (its logs say what).
    own_workdir = not args.workdir
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvroute-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = build_model_dir(workdir / "tiny-llama")
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    workload = build_workload(args)
    served = f" serving {args.models} models behind one router" if args.models > 1 else ""
    print(
        f"kvroute demo: per policy ({', '.join(policies)}) a fleet of {args.engines} sim engines{served} x "
        f"{args.num_blocks} blocks of {args.block_size} tokens; {len(workload)} conversations x {args.turns} turns "
        f"over {args.system_prompts} system prompts, replayed through every policy at once; logs in {workdir}"
        f"{' (removed at the end unless something fails)' if own_workdir else ''}",
        file=sys.stderr,
    )
    fleets: list[PolicyFleet] = []
    results: list[PolicyResult] = []
    finished = False
    try:
        for policy in policies:
            fleets.append(
                PolicyFleet(
                    policy, LocalCluster(workdir=workdir / policy, tokenizer_dir=tokenizer_dir, block_size=args.block_size)
                )
            )
            print(f"starting the {policy} fleet ...", file=sys.stderr)
            fleets[-1].start(args)
        print("replaying the workload through every policy at once ...", file=sys.stderr)
        results, disturbance = measure(fleets, workload, args)
        finished = True
    finally:
        for fleet in fleets:
            fleet.cluster.stop()
        if own_workdir and finished and all(r.errors == 0 for r in results):
            shutil.rmtree(workdir, ignore_errors=True)
        elif own_workdir:
            print(f"kvroute demo: logs kept in {workdir}", file=sys.stderr)
    print()
    print_table(results)
    print()
    print(machine_line(disturbance))
    warning = disturbance.warning("the event loops of routers, control planes and engines")
    if warning:
        print(f"warning: {warning}")
    print()
    print(
        json.dumps(
            {
                "policies": {
                    r.policy: {
                        "requests": r.requests,
                        "fail_open": int(r.fail_open),
                        "hit_rate": round(r.hit_rate, 4),
                        "ttft_p50_ms": round(percentile(r.ttft_ms, 50), 2),
                        "ttft_p99_ms": round(percentile(r.ttft_ms, 99), 2),
                        **(
                            {
                                "hit_rate_by_model": {m: round(rate, 4) for m, rate in r.hit_rate_by_model().items()},
                                "misrouted": r.misrouted,
                            }
                            if args.models > 1
                            else {}
                        ),
                    }
                    for r in results
                },
                "disturbance": disturbance.to_json(),
            }
        )
    )
    return 0 if all(r.errors == 0 and r.misrouted == 0 for r in results) else 1


def machine_line(d: Disturbance) -> str:
    """What else ran on the machine while the policies were measured (the same for all of them)."""
    if not d.measured:
        return "machine load during the run: not measured (no /proc)"
    return (
        f"machine load during the run ({d.seconds:.1f} s, all policies at once): other processes "
        f"{d.outside_cores_mean:.2f} of {d.cores} cores on average, {d.outside_cores_peak:.2f} at peak; "
        f"event loops of routers, control planes and engines waited {d.loop_wait_ms_per_s_mean:.0f} ms/s for a CPU"
    )
