"""`kvroute bench live`: a simulator workload driven live over HTTP, next to the simulator's answer.

The same generated workload (kvroute.tools.simulator.workloads) goes, once per policy, through a real router to
real sim-engine processes (or to an already running fleet), and through `simulate_policy` with a
FleetConfig that matches those engines. Live hit rate comes from the engines' own prefix-cache
counters; live TTFT is client-side, scaled back to cost-model time (x speedup) so both columns are
in the same units. `ordering_agrees` says whether live and simulated rank the policies the same
way by hit rate and by TTFT p50. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO

import aiohttp

from kvroute.data_plane.decision.policies import parse_kv_aware_params
from kvroute.tools.local_cluster import (
    LocalCluster,
    ManagedProcess,
    engine_prefix_counters,
    grpc_health_serving,
    http_get,
    http_post_json,
    wait_until,
)
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.engine import EngineConfig
from kvroute.tools.simulator.cli import generated_workload
from kvroute.tools.simulator.fleet import FleetConfig, simulate_policy
from kvroute.tools.simulator.workloads import SimWorkloadRequest
from kvroute.tools.stats import percentile
from kvroute.tools.tiny_model import SPECIAL_TOKENS, build_model_dir

DIRECT = "direct"  # the no-router baseline: round-robin straight to the engines
EPP_PREFIX = "epp:"  # --epp: the run of `kvroute epp` with a policy, next to that policy's router
FIRST_PLAIN_TOKEN = len(SPECIAL_TOKENS)  # the tiny model's special tokens come first; prompts avoid them
REQUEST_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------- workload


def map_token_ids(tokens: list[int], vocab_size: int, first: int = FIRST_PLAIN_TOKEN) -> list[int]:
    """Fold workload ids (up to 2e9) into [first, vocab_size). Deterministic, so equal prefixes stay
    equal; two different blocks could only collide if their ids were a multiple of
    (vocab_size - first) apart position by position, and block keys are chained, so the collision
    would also need the same parent chain (the tests check the sharing structure survives)."""
    span = vocab_size - first
    if span <= 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above {first}")
    return [first + t % span for t in tokens]


def request_bodies(workload: list[SimWorkloadRequest], model: str, vocab_size: int) -> list[bytes]:
    """Encoded up front so JSON encoding is not inside the timed window. A request's session (the
    multi-turn conversation) goes in OpenAI's `user` field, which the router's session policy reads,
    as the simulator's session policy reads `SimWorkloadRequest.session`."""

    def body(r: SimWorkloadRequest) -> dict:
        out = {"model": model, "prompt": map_token_ids(r.tokens, vocab_size), "max_tokens": r.output_tokens, "stream": True}
        if r.session:
            out["user"] = r.session
        return out

    return [json.dumps(body(r)).encode() for r in workload]


# ---------------------------------------------------------------------------- live side


@dataclass
class LiveRun:
    policy: str
    speedup: float
    requests: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)  # wall seconds, client side
    e2e_s: list[float] = field(default_factory=list)
    per_worker: dict[str, int] = field(default_factory=dict)
    per_prefill_worker: dict[str, int] = field(default_factory=dict)  # P/D fleets: x-kvroute-prefill-worker
    hits: float = 0.0
    queries: float = 0.0
    wall_s: float = 0.0
    first_errors: list[str] = field(default_factory=list)
    sent_s: dict[int, float] = field(default_factory=dict)  # request index -> wall offset it was sent at

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def summary(self) -> dict:
        """Latencies in cost-model milliseconds (wall x speedup), comparable with the simulator's."""

        def ms(values: list[float], q: float) -> float:
            return round(percentile(values, q) * 1000 * self.speedup, 2)

        return {
            "requests": self.requests,
            "errors": self.errors,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "ttft_p50_ms": ms(self.ttft_s, 50),
            "ttft_p99_ms": ms(self.ttft_s, 99),
            "e2e_p50_ms": ms(self.e2e_s, 50),
            "e2e_p99_ms": ms(self.e2e_s, 99),
            "wall_s": round(self.wall_s, 2),
            "per_worker": dict(sorted(self.per_worker.items())),
        } | ({"per_prefill_worker": dict(sorted(self.per_prefill_worker.items()))} if self.per_prefill_worker else {})


def _chunk_has_text(line: bytes) -> bool:
    try:
        choices = json.loads(line[5:]).get("choices") or []
    except ValueError:
        return False
    return bool(choices) and bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    run: LiveRun,
    worker_hint: str,
    started: float | None = None,
    on_response: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """One streamed completion; TTFT = first SSE data chunk that carries text. `started`: when the
    request left the client (before an endpoint picker was asked); `on_response`: called once the
    response headers are in (what Envoy reports to the picker then)."""
    started = time.perf_counter() if started is None else started
    first_at: float | None = None
    try:
        async with session.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            if on_response is not None:
                await on_response()
            worker = resp.headers.get("x-kvroute-worker", worker_hint)
            prefill = resp.headers.get("x-kvroute-prefill-worker")
            async for raw in resp.content:
                line = raw.strip()
                if first_at is None and line.startswith(b"data:") and line != b"data: [DONE]" and _chunk_has_text(line):
                    first_at = time.perf_counter()
        finished = time.perf_counter()
        if first_at is None:
            raise RuntimeError("stream ended without a text chunk")
    except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
        run.errors += 1  # counted and reported, the run goes on
        if len(run.first_errors) < 5:
            run.first_errors.append(f"{url}: {exc!r}")
        return
    run.requests += 1
    run.ttft_s.append(first_at - started)
    run.e2e_s.append(finished - started)
    run.per_worker[worker] = run.per_worker.get(worker, 0) + 1
    if prefill is not None:
        run.per_prefill_worker[prefill] = run.per_prefill_worker.get(prefill, 0) + 1


Sender = Callable[[aiohttp.ClientSession, str, bytes, LiveRun, str], Awaitable[None]]


def epp_sender(stub, engine_names: dict[str, str]) -> Sender:
    """Requests as Envoy sends them with an endpoint picker in front: the picker is asked over
    ext_proc (streamed request body mode, GAIE's; response_body_mode NONE, said in protocol_config),
    then the request goes to the endpoint it picked, the served endpoint is reported with the
    response headers, and the stream ends with the response."""
    from kvroute.tools.ext_proc_client import EnvoyExtProcStream

    async def send(session: aiohttp.ClientSession, _url: str, body: bytes, run: LiveRun, _hint: str) -> None:
        started = time.perf_counter()
        stream = EnvoyExtProcStream(stub, "streamed", send_protocol_config=True)  # response bodies not sent
        try:
            picked = await stream.request("/v1/completions", body)
            endpoint = picked.endpoint.split(",")[0]
            if picked.status or not endpoint:
                run.errors += 1
                if len(run.first_errors) < 5:
                    run.first_errors.append(f"epp answered {picked.status}: {picked.error_body[:200]!r}")
                return
            await send_one(
                session,
                f"http://{endpoint}",
                body,
                run,
                engine_names.get(endpoint, endpoint),
                started,
                lambda: stream.response(served=endpoint),
            )
        finally:
            await stream.close()

    return send


async def open_loop(
    session: aiohttp.ClientSession,
    targets: Iterator[tuple[str, str]],
    bodies: list[bytes],
    arrivals_s: list[float],
    speedup: float,
    run: LiveRun,
    send: Sender = send_one,
) -> None:
    """Each request leaves at its arrival time / speedup, whether or not earlier ones are done."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def at(i: int, offset_s: float, url: str, hint: str, body: bytes) -> None:
        await asyncio.sleep(max(0.0, t0 + offset_s / speedup - loop.time()))
        run.sent_s[i] = loop.time() - t0
        await send(session, url, body, run, hint)

    await asyncio.gather(*(at(i, a, *next(targets), b) for i, (a, b) in enumerate(zip(arrivals_s, bodies))))


async def closed_loop(
    session: aiohttp.ClientSession,
    targets: Iterator[tuple[str, str]],
    bodies: list[bytes],
    concurrency: int,
    run: LiveRun,
    send: Sender = send_one,
) -> None:
    """`concurrency` clients, each sending its next request when the previous one is done."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    queue = [(i, *next(targets), b) for i, b in enumerate(bodies)]
    queue.reverse()

    async def client() -> None:
        while queue:
            i, url, hint, body = queue.pop()
            run.sent_s[i] = loop.time() - t0
            await send(session, url, body, run, hint)

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def drive(
    targets: Iterator[tuple[str, str]],
    bodies: list[bytes],
    workload: list[SimWorkloadRequest],
    speedup: float,
    concurrency: int,
    run: LiveRun,
    epp: str | None = None,
    engine_names: dict[str, str] | None = None,
) -> None:
    """`epp`: ask this endpoint picker (gRPC HOST:PORT) for every request and send it to the engine
    it picks (`engine_names`: endpoint -> engine name, for the per-worker counts)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    channel = None
    send: Sender = send_one
    if epp is not None:
        import grpc
        from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

        channel = grpc.aio.insecure_channel(epp)
        send = epp_sender(ExternalProcessorStub(channel), engine_names or {})
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            started = time.monotonic()
            if concurrency > 0:
                await closed_loop(session, targets, bodies, concurrency, run, send)
            else:
                await open_loop(session, targets, bodies, [r.arrival_s for r in workload], speedup, run, send)
            run.wall_s = time.monotonic() - started
    finally:
        if channel is not None:
            await channel.close()


def router_targets(*urls: str) -> Iterator[tuple[str, str]]:
    """The routers in turn, request by request (a burst of one prefix spreads over them)."""
    i = 0
    while True:
        yield urls[i % len(urls)], "?"
        i += 1


def direct_targets(engine_urls: list[str]) -> Iterator[tuple[str, str]]:
    i = 0
    while True:
        yield engine_urls[i % len(engine_urls)], f"engine-{i % len(engine_urls)}"
        i += 1


def reset_engines(engine_urls: list[str], timeout_s: float = 30.0) -> None:
    """Fresh caches for every policy; 409 means blocks are still held, so retry until they are not."""
    for url in engine_urls:
        wait_until(
            lambda url=url: http_post_json(url + "/reset_prefix_cache")[0] == 200,
            timeout_s,
            f"{url} reset_prefix_cache",
            interval=0.2,
        )


def engines_counters(engine_urls: list[str]) -> list[tuple[float, float]]:
    return [engine_prefix_counters(u) for u in engine_urls]


def fleet_idle(cluster: LocalCluster) -> bool:
    """Every worker's load, as its agent last reported it to the control plane, is idle."""
    workers = cluster.list_workers()
    return bool(workers) and all(not (w.load.running_requests or w.load.waiting_requests) for w in workers)


def wait_router_ready(
    router_url: str,
    model: str,
    workers: int,
    probes: list[list[int]],
    timeout_s: float = 30.0,
    procs: tuple[ManagedProcess, ...] = (),
    fleet_idle: Callable[[], bool] | None = None,
) -> None:
    """The router knows every worker over a live control plane, no probe prompt is cached anywhere
    (the reset's AllBlocksCleared events have reached the index) and, with `fleet_idle`, the engines'
    reported load is idle again: the agents poll it, so right after a run the control plane still
    holds its last requests as running, and a run that starts then begins from a skewed load (seen:
    the endpoint picker's run, started at once after the router's, piled on one engine)."""

    def ready() -> bool:
        if fleet_idle is not None and not fleet_idle():
            return False
        status, raw = http_get(router_url + "/health")
        if status != 200 or json.loads(raw).get("workers", 0) < workers:
            return False
        for prompt in probes:
            status, raw = http_post_json(router_url + "/v1/route", {"model": model, "prompt": prompt})
            decision = json.loads(raw) if status == 200 else {}
            if status != 200 or decision.get("fail_open") or any(w["cached_tokens"] for w in decision["workers"]):
                return False
        return True

    wait_until(ready, timeout_s, f"router {router_url} ready with {workers} workers and clean caches", list(procs), interval=0.2)


def run_live(
    name: str,
    url: str | list[str] | None,
    engine_urls: list[str],
    bodies: list[bytes],
    workload: list[SimWorkloadRequest],
    args: argparse.Namespace,
    ready: Callable[[], None] | None = None,
    epp: str | None = None,
) -> LiveRun:
    """One policy (url None: direct to the engines; several: its routers in turn; `epp`: through that
    endpoint picker, the client sending to the engines as Envoy would): reset caches, wait until
    `ready`, replay, read the engines' counter deltas."""
    if engine_urls:
        reset_engines(engine_urls)
    if ready:
        ready()
    before = engines_counters(engine_urls)
    run = LiveRun(name, args.speedup)
    urls = [url] if isinstance(url, str) else url or []
    targets = router_targets(*(urls or [epp or ""])) if urls or epp else direct_targets(engine_urls)
    names = {u.split("//", 1)[-1]: f"engine-{i}" for i, u in enumerate(engine_urls)}
    asyncio.run(drive(targets, bodies, workload, args.speedup, args.concurrency, run, epp, names))
    after = engines_counters(engine_urls)
    run.queries = sum(a[0] - b[0] for a, b in zip(after, before))
    run.hits = sum(a[1] - b[1] for a, b in zip(after, before))
    for err in run.first_errors:
        print(f"  {name}: request failed: {err}", file=sys.stderr)
    return run


# ---------------------------------------------------------------------------- simulated side


def fleet_config(args: argparse.Namespace, engines: int) -> FleetConfig:
    """The FleetConfig of the live fleet: same engines, cache, batching limits and cost model (the
    sim engines run CostModel's defaults, since no cost flag is passed to them)."""
    engine = EngineConfig()
    return FleetConfig(
        workers=engines,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        cost=CostModel(),
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        seed=args.seed,
        kv_aware_params=parse_kv_aware_params(args.kv_aware_param),
    )


def sim_engine_args(args: argparse.Namespace) -> list[str]:
    """Engine flags that pin what fleet_config() assumes (batching limits from the same defaults)."""
    engine = EngineConfig()
    return [
        "--num-blocks",
        str(args.num_blocks),
        "--speedup",
        str(args.speedup),
        "--max-num-batched-tokens",
        str(engine.max_num_batched_tokens),
        "--max-num-seqs",
        str(engine.max_num_seqs),
    ]


def simulate(policy: str, workload: list[SimWorkloadRequest], config: FleetConfig) -> dict:
    run = simulate_policy(policy, workload, config)

    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1000, 2)

    return {
        "policy": policy,
        "hit_rate": round(run.hit_rate, 4),
        "ttft_p50_ms": ms(run.ttft_s, 50),
        "ttft_p99_ms": ms(run.ttft_s, 99),
        "e2e_p50_ms": ms(run.e2e_s, 50),
        "rejected": run.rejected,
    }


def sim_policy_for(name: str) -> str:
    """direct is round-robin without a router; an endpoint picker's run (epp:POLICY) is its policy's,
    and so is a run with several routers (POLICY@N)."""
    return "round_robin" if name == DIRECT else name.removeprefix(EPP_PREFIX).partition("@")[0]


def routers_of(name: str) -> int:
    """How many routers a run's name says it had (POLICY@N), 1 otherwise."""
    return int(name.partition("@")[2] or 1)


def router_counts(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in split_csv(args.routers)]


def router_name(policy: str, i: int) -> str:
    """The i-th router of a policy: POLICY for the first (its log is router-POLICY.log), POLICY#i after."""
    return policy if i == 0 else f"{policy}#{i}"


def run_name(policy: str, routers: int, counts: list[int]) -> str:
    """POLICY, or POLICY@N when several router counts run (POLICY alone is its one-router run)."""
    return policy if routers == 1 else f"{policy}@{routers}"


def sim_workload(workload: list[SimWorkloadRequest], run: LiveRun, closed: bool) -> list[SimWorkloadRequest]:
    """Open loop: the workload as generated. Closed loop: the simulator has no clients waiting on
    replies, so it replays the times the live clients actually sent at, in cost-model seconds."""
    if not closed:
        return workload
    return [dataclasses.replace(r, arrival_s=run.sent_s[i] * run.speedup) for i, r in enumerate(workload) if i in run.sent_s]


# ---------------------------------------------------------------------------- comparison and output


def pairwise_agree(live: dict[str, float | None], sim: dict[str, float]) -> bool:
    """Every pair of policies is ordered the same way live and simulated. A simulated tie (e.g.
    direct and round_robin) or a missing live value constrains nothing."""
    names = [n for n in live if live[n] is not None]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if sim[a] != sim[b] and (live[a] > live[b]) != (sim[a] > sim[b]):  # type: ignore[operator]
                return False
    return True


def compare(policies: dict[str, dict]) -> dict[str, bool]:
    def metric(side: str, key: str) -> dict:
        return {n: p[side][key] for n, p in policies.items()}

    return {
        "hit_rate": pairwise_agree(metric("live", "hit_rate"), metric("sim", "hit_rate")),
        "ttft_p50": pairwise_agree(metric("live", "ttft_p50_ms"), metric("sim", "ttft_p50_ms")),
    }


def print_table(policies: dict[str, dict], ordering: dict[str, bool], file: TextIO = sys.stdout) -> None:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    header = (
        f"{'policy':<17}{'reqs':>6}{'errs':>6}{'hit live':>10}{'hit sim':>9}{'TTFT p50 live':>15}"
        f"{'sim':>9}{'TTFT p99 live':>15}{'sim':>9}{'e2e p50 live':>14}{'sim':>9}{'wall s':>8}"
    )
    print(header, file=file)
    print("-" * len(header), file=file)
    for name, p in policies.items():
        lv, sm = p["live"], p["sim"]
        print(
            f"{name:<17}{lv['requests']:>6}{lv['errors']:>6}{pct(lv['hit_rate']):>10}{pct(sm['hit_rate']):>9}"
            f"{lv['ttft_p50_ms']:>13.1f}ms{sm['ttft_p50_ms']:>7.1f}ms{lv['ttft_p99_ms']:>13.1f}ms"
            f"{sm['ttft_p99_ms']:>7.1f}ms{lv['e2e_p50_ms']:>12.1f}ms{sm['e2e_p50_ms']:>7.1f}ms{lv['wall_s']:>8.1f}",
            file=file,
        )
    yes = {True: "yes", False: "NO"}
    print(
        f"latencies in cost-model ms (live wall time x speedup); ordering agrees: hit rate {yes[ordering['hit_rate']]}, "
        f"TTFT p50 {yes[ordering['ttft_p50']]}",
        file=file,
    )


# ---------------------------------------------------------------------------- entry


def split_csv(csv: str) -> list[str]:
    return [s.strip().rstrip("/") for s in csv.split(",") if s.strip()]


def local_cluster(
    args: argparse.Namespace, workload: list[SimWorkloadRequest], prefix: str
) -> tuple[LocalCluster, list[bytes], list[list[int]]]:
    """A local cluster (nothing started yet) in --workdir or a temp dir, with the workload's request
    bodies and readiness probes in the tiny model's vocabulary."""
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = build_model_dir(workdir / "tiny-llama")
    vocab_size = int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=tokenizer_dir, block_size=args.block_size)
    return cluster, request_bodies(workload, cluster.model, vocab_size), probe_prompts(workload, vocab_size)


def run_local(args: argparse.Namespace, workload: list[SimWorkloadRequest], log: Callable[..., None]) -> dict[str, LiveRun]:
    """Start control plane, engines with agents and one router per policy; run every policy."""
    cluster, bodies, probes = local_cluster(args, workload, "kvroute-bench-live-")
    log(
        f"starting {args.engines} sim engines x {args.num_blocks} blocks of {args.block_size}, speedup "
        f"{args.speedup}; logs in {cluster.workdir}"
    )
    runs: dict[str, LiveRun] = {}
    try:
        cluster.start_sim_fleet(args.engines, *sim_engine_args(args))
        weights = [a for item in args.kv_aware_param for a in ("--kv-aware-param", item)]
        epps = {}
        counts = router_counts(args)
        for policy in split_csv(args.policies):
            for i in range(max(counts)):
                cluster.start_router(router_name(policy, i), policy, *(weights if policy == "kv_aware" else ()))
            if args.epp:
                epps[policy] = cluster.start_epp(policy, policy, *(weights if policy == "kv_aware" else ()))
        engine_urls = [e.url for e in cluster.engines]
        for policy in split_csv(args.policies):
            for n in counts:
                name = run_name(policy, n, counts)
                log(f"live: {name} ...")
                urls = [cluster.router_urls[router_name(policy, i)] for i in range(n)]

                def ready(urls=urls) -> None:
                    for url in urls:
                        wait_router_ready(
                            url,
                            cluster.model,
                            args.engines,
                            probes,
                            procs=tuple(cluster.all_processes()),
                            fleet_idle=partial(fleet_idle, cluster),
                        )

                runs[name] = run_live(name, urls, engine_urls, bodies, workload, args, ready)
            if args.epp:  # the same caches' state checked through the router, then the picker's own readiness
                log(f"live: {EPP_PREFIX}{policy} ...")

                def epp_ready(ready=ready, address=epps[policy]) -> None:
                    ready()
                    wait_until(
                        lambda: grpc_health_serving(address, "readiness"),
                        30,
                        f"epp {address} ready",
                        list(cluster.all_processes()),
                    )

                runs[EPP_PREFIX + policy] = run_live(
                    EPP_PREFIX + policy, None, engine_urls, bodies, workload, args, epp_ready, epp=epps[policy]
                )
        if args.direct:
            log("live: direct ...")
            runs[DIRECT] = run_live(DIRECT, None, engine_urls, bodies, workload, args)
    finally:
        cluster.stop()
    return runs


def run_remote(
    args: argparse.Namespace, workload: list[SimWorkloadRequest], log: Callable[..., None]
) -> tuple[dict[str, LiveRun], int]:
    """Bench an already running router (its own policy) and/or its engines directly."""
    engine_urls = split_csv(args.engine_urls)
    if not engine_urls:
        log("no --engine-urls: engine caches are not reset between runs and there is no live hit rate")
    bodies = request_bodies(workload, args.model, args.vocab_size)
    runs: dict[str, LiveRun] = {}
    engines = len(engine_urls)
    if args.router_url:
        url = args.router_url.rstrip("/")
        status, raw = http_get(url + "/health")
        if status != 200:
            raise SystemExit(f"kvroute bench live: {url}/health answered {status}")
        health = json.loads(raw)
        policy, engines = health["policy"], engines or int(health["workers"])
        probes = probe_prompts(workload, args.vocab_size) if engine_urls else []
        log(f"live: {policy} via {url} ...")
        runs[policy] = run_live(
            policy, url, engine_urls, bodies, workload, args, partial(wait_router_ready, url, args.model, engines, probes)
        )
    if args.direct:
        log("live: direct ...")
        runs[DIRECT] = run_live(DIRECT, None, engine_urls, bodies, workload, args)
    return runs, engines


def probe_prompts(workload: list[SimWorkloadRequest], vocab_size: int, n: int = 8) -> list[list[int]]:
    return [map_token_ids(r.tokens, vocab_size) for r in workload[:n]]


def check_args(args: argparse.Namespace) -> None:
    """Arguments that would only fail after the fleet is up: ValueError naming the flags (`kvroute bench`'s
    validate hook runs it when the command line is parsed)."""
    if args.requests < 1 or args.engines < 1 or args.num_blocks < 1 or args.block_size < 1:
        raise ValueError("--requests, --engines, --num-blocks and --block-size must be >= 1")
    if args.speedup <= 0 or args.rate <= 0 or args.concurrency < 0:
        raise ValueError("--speedup and --rate must be > 0, --concurrency >= 0")
    if args.pd and (args.router_url or args.engine_urls or args.epp or args.direct or args.routers != "1"):
        raise ValueError("--pd starts its own P/D fleet: no --router-url, --engine-urls, --epp, --direct or --routers")
    if args.pd and args.decode_engines < 1:
        raise ValueError("--decode-engines must be >= 1")
    if args.epp and (args.router_url or args.engine_urls):
        raise ValueError("--epp starts its endpoint pickers on a local fleet (no --router-url / --engine-urls)")
    if args.direct and args.router_url and not args.engine_urls:
        raise ValueError("--direct needs --engine-urls")
    if not args.router_url and args.engine_urls and not args.direct:
        raise ValueError("--engine-urls without --router-url needs --direct")
    if not args.router_url and not args.engine_urls and not split_csv(args.policies) and not args.direct:
        raise ValueError("no policy to run")
    try:
        counts = router_counts(args)
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--routers takes counts >= 1 separated by commas, got {args.routers!r}")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.pd:
        from kvroute.tools.bench.pd import run as run_pd

        return run_pd(args)
    workload = generated_workload(args)
    if args.router_url or args.engine_urls:
        runs, engines = run_remote(args, workload, log)
    else:
        runs, engines = run_local(args, workload, log), args.engines
    config = fleet_config(args, engines)
    closed = args.concurrency > 0
    sims: dict[str, dict] = {}

    def sim_key(name: str) -> str:  # open loop: direct and round_robin simulate alike
        return name if closed else f"{sim_policy_for(name)}@{routers_of(name)}"

    for name, live in runs.items():
        if sim_key(name) not in sims:
            log(f"simulating {sim_policy_for(name)} with {routers_of(name)} router(s) ...")
            sims[sim_key(name)] = simulate(
                sim_policy_for(name), sim_workload(workload, live, closed), dataclasses.replace(config, routers=routers_of(name))
            )
    policies = {name: {"live": r.summary(), "sim": sims[sim_key(name)]} for name, r in runs.items()}
    ordering = compare(policies)
    result = {
        "workload": {
            "name": args.workload,
            "requests": len(workload),
            "rate_rps": args.rate,
            "groups": args.groups,
            "system_prompt_tokens": args.system_prompt_tokens,
            "output_tokens": args.output_tokens,
            "seed": args.seed,
        },
        "fleet": {
            "engines": engines,
            "routers": args.routers,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "speedup": args.speedup,
            "loop": f"closed x{args.concurrency}" if closed else "open",
            "sim_arrivals": "live send times" if closed else "workload",
            "kv_aware_params": config.kv_aware_params,
        },
        "policies": policies,
        "ordering": ordering,
        "ordering_agrees": all(ordering.values()),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if not args.json:
        print_table(policies, ordering)
        print(f"{len(workload)} {args.workload} requests, {engines} engines x {args.num_blocks} blocks; {result['wall_s']}s")
    print(json.dumps(result))
    return 0 if all(r.errors == 0 for r in runs.values()) else 1
