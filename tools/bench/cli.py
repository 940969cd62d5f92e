"""`kvroute bench {ingest,decision,answer,proxy,inflight,burst,live,replicas,follow,saturate,fuzz}`: hot-path micro-benchmarks, the
staleness of shared in-flight state (`bench/inflight.py`), the live-vs-simulator benchmark (`bench/live.py`), control-plane
replicas over Redis (`bench/replicas.py`) and hostile input at live processes (`bench/fuzz.py`); the last stdout line is JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvroute.addresses import http_url_or_none, http_urls
from kvroute.process import int_list, name_list, positive


def validate(args: argparse.Namespace) -> None:
    """Flags valid alone but not together (checked when parsed, by `kvroute config check` too)."""
    if args.bench == "live":
        from kvroute.tools.bench.live import check_args

        check_args(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.data_plane.decision.policies import POLICIES

    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    ingest = sub.add_parser("ingest", help="event decode -> key resolution -> index update (block events/s, bytes/entry)")
    ingest.add_argument("--batches", type=int, default=4000, help="vLLM event batches to ingest")
    ingest.add_argument("--blocks-per-event", type=int, default=16, help="blocks per BlockStored")
    ingest.add_argument("--workers", type=int, default=8, help="workers the batches are spread over")
    ingest.add_argument(
        "--max-index-entries",
        type=int,
        default=0,
        metavar="N",
        help="ingest into the bounded index (control-plane --max-index-entries); below what the "
        "batches leave, the ingest evicts as it stores",
    )
    ingest.add_argument(
        "--memory-entries",
        type=int,
        default=1_000_000,
        metavar="N",
        help="entries of the index whose bytes per entry are measured (tracemalloc, and RSS in a fresh interpreter)",
    )
    decision = sub.add_parser(
        "decision",
        help="tokenize + hash + the index's answer (the router's own view, or a "
        "control-plane query) + score (p50/p99), optionally while the fleet changes",
    )
    decision.add_argument("--prompt-tokens", type=int, default=8192, help="prompt length")
    decision.add_argument("--workers", type=int, default=64, help="registered workers")
    decision.add_argument("--iterations", type=int, default=300, help="timed decisions")
    decision.add_argument("--block-size", type=int, default=16, help="worker block size")
    decision.add_argument(
        "--pin-cores",
        action="store_true",
        help="run the router (this process) and the control plane on different cores, as on "
        "separate hosts; without it they share the machine's cores as the OS schedules them",
    )
    decision.add_argument(
        "--max-index-entries",
        type=int,
        default=0,
        metavar="N",
        help="start the control plane with --max-index-entries N (0: unbounded)",
    )
    decision.add_argument(
        "--index",
        default="local",
        choices=("local", "remote"),
        help="as the router's --index: decide on this router's own view of the fleet, or ask the "
        "control plane (query over the router session)",
    )
    decision.add_argument(
        "--follow-rate",
        type=float,
        nargs="?",
        const=200_000.0,
        default=0.0,
        metavar="N",
        help="meanwhile the agents store and remove N block events/s (alone: 200000) and the index "
        "holds >= 1M entries; decisions are spaced --interval-ms apart",
    )
    decision.add_argument(
        "--other-blocks",
        type=int,
        default=None,
        metavar="N",
        help="unrelated blocks per worker (default: 16384 with --follow-rate, else 2000)",
    )
    decision.add_argument(
        "--interval-ms", type=float, default=None, help="pause between decisions (default: 2 with --follow-rate, else none)"
    )
    decision.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="stop the timed decisions after this long (a host too busy for the view to keep up)",
    )
    answer = sub.add_parser(
        "answer",
        help="the control plane's answer to one query, in-process: back to back, "
        "after an idle pause, after other memory traffic (p50/p99 us)",
    )
    answer.add_argument("--workers", type=int, default=64, help="registered workers")
    answer.add_argument("--iterations", type=int, default=2000, help="timed answers per way")
    answer.add_argument("--pause-ms", type=float, default=1.0, help="idle time before each answer of the pause run")
    answer.add_argument(
        "--max-index-entries",
        type=int,
        default=0,
        metavar="N",
        help="serve from the bounded index (control-plane --max-index-entries), N above the fleet's "
        "entries: walks mark what they match; adds unmarked_* (marks cleared before each answer)",
    )
    for sp in (ingest, answer):
        sp.add_argument(
            "--index-backend",
            choices=("auto", "native", "bitmask"),
            default="auto",
            help="the prefix index measured (control-plane --index-backend)",
        )
    proxy = sub.add_parser(
        "proxy",
        help="what a router adds to a request: per target (kvroute per policy, a pass-through "
        "floor, peers) and per stage inside the router, p50/p99",
    )
    proxy.add_argument("--requests", type=int, default=2000, help="requests per target")
    proxy.add_argument(
        "--policies",
        type=name_list(POLICIES, "policy"),
        default="round_robin,kv_aware",
        help="kvroute routers to measure, comma-separated",
    )
    proxy.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=["smg", "vllm-router"],
        help="also measure this router, installed from the package index into a cached venv "
        "(smg: SGLang's gateway; vllm-router: vLLM's router; each with round_robin and "
        "cache_aware), repeatable",
    )
    proxy.add_argument("--engines", type=int, default=2, help="sim engines behind every router")
    inflight = sub.add_parser(
        "inflight",
        help="RouterSession: how long until one router's reserve/release is visible to another router's queries (p50/p99)",
    )
    inflight.add_argument("--trials", type=int, default=200, help="timed reserve + release pairs")
    inflight.add_argument("--block-keys", type=int, default=64, help="block keys per reservation")
    burst = sub.add_parser(
        "burst",
        help="64 simultaneous requests with one new 4k-token prefix through several routers: "
        "workers used with and without shared in-flight state, next to what the load bound requires",
    )
    burst.add_argument("--workers", type=int, default=8, help="sim engines")
    burst.add_argument("--routers", type=positive(int), default=2, help="router processes the burst is spread over")
    replicas = sub.add_parser(
        "replicas",
        help="control-plane replicas over Redis, real processes: ingest through "
        "Redis vs in-process, freshness, catch-up of a restarted replica, answers/s at p99 <= 5 ms",
    )
    replicas.add_argument(
        "--batches",
        type=int,
        default=20000,
        help="vLLM event batches for the ingest figures (20000: a window of ~1 s through Redis, so "
        "the last batch's propagation and the metric polling are not a large share of it)",
    )
    replicas.add_argument("--trials", type=int, default=200, help="freshness samples")
    replicas.add_argument(
        "--catchup-blocks", type=int_list, default="100000,1000000", metavar="N,N", help="log sizes the catch-up is measured at"
    )
    replicas.add_argument(
        "--chaos-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run the chaos scenario (kill -9, Redis cut, restart under 100 req/s) with phases this long; 0 = skip",
    )
    replicas.add_argument(
        "--answer-step-s", type=float, default=3.0, metavar="SECONDS", help="how long each offered query rate is held"
    )
    replicas.add_argument("--workdir", default="", help="logs and Redis files (empty: a temp dir)")
    follow = sub.add_parser(
        "follow",
        help="a router's own view of the fleet (--index local): agent batch and "
        "reservation -> another router's view (embedded and over Redis), a 1M-entry catch-up, "
        "the view's bytes per entry and block events/s applied",
    )
    add_follow_arguments(follow)
    saturate = sub.add_parser(
        "saturate",
        help="each router pinned to one core, saturated by wrk in front of nginx "
        "engines: requests/s and CPU us per request (kvroute's with its control plane's share)",
    )
    saturate.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=["smg", "vllm-router"],
        help="also measure this router with round_robin and cache_aware (tools/bench/peers.py), repeatable",
    )
    saturate.add_argument("--seconds", type=float, default=10.0, help="wrk run per target and round")
    saturate.add_argument("--rounds", type=int, default=3, help="rounds over every target (medians reported)")
    saturate.add_argument("--connections", type=int, default=32, help="wrk connections")
    saturate.add_argument("--engines", type=int, default=4, help="nginx ports, one worker each")
    saturate.add_argument("--router-core", type=int, default=0, help="the core every router is pinned to")
    saturate.add_argument("--workdir", default="", help="logs and configuration (empty: a temp dir)")
    for sp in (ingest, decision, answer, proxy, inflight, burst, replicas, follow, saturate):
        sp.add_argument("--json", action="store_true", help="print only the JSON result")
    live = sub.add_parser(
        "live",
        help="a simulator workload live over HTTP (routers + sim engines as processes), side by side with the simulator",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_live_arguments(live)
    from kvroute.tools.bench.fuzz import add_arguments as add_fuzz_arguments  # light: targets are imported when run

    kill = sub.add_parser(
        "kill",
        help="kill -9 an engine, an agent, a router and the control plane in turn under "
        "steady load over two routers: failed client requests per fault kind",
    )
    kill.add_argument("--rate", type=float, default=100.0, help="requests per second over both routers")
    kill.add_argument("--phase-s", type=float, default=6.0, help="seconds between faults (the first: a calm baseline)")
    kill.add_argument("--down-s", type=float, default=2.0, help="seconds each killed process stays down")
    kill.add_argument("--json", action="store_true", help="print only the JSON result")
    soak = sub.add_parser(
        "soak",
        help="the whole fleet under a mixed workload with churn for N minutes: RSS and open "
        "fds of every process sampled, growth checked against a documented bound",
    )
    soak.add_argument("--minutes", type=float, default=30.0)
    soak.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    soak.add_argument("--churn-s", type=float, default=20.0, help="seconds between disturbances")
    soak.add_argument("--rate", type=float, default=20.0, help="requests per second over both routers")
    soak.add_argument("--warmup-s", type=float, default=300.0, help="growth is measured from the first sample after this")
    soak.add_argument(
        "--router-cache-tokens",
        type=int,
        default=16384,
        help="the routers' --tokenizer-cache-tokens: small enough to be full before the warm-up ends",
    )
    soak.add_argument("--plots", type=Path, default=None, metavar="PNG", help="also draw RSS and fds over time")
    soak.add_argument("--json", action="store_true", help="print only the JSON result")
    fuzz = sub.add_parser(
        "fuzz",
        help="malformed, random and oversize input at a live process's socket between "
        "valid traffic: alive, answering, every valid message applied, every bad one counted",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_fuzz_arguments(fuzz)


def add_follow_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.prefix_index.backends import BACKENDS

    p.add_argument("--batches", type=int, default=2000, help="agent batches timed for the view's lag (per mode)")
    p.add_argument("--rate", type=float, default=400.0, help="agent batches per second over all workers")
    p.add_argument("--workers", type=int, default=8, help="synthetic agents (one worker each)")
    p.add_argument(
        "--batch-keys", type=int, default=16, help="keys stored per batch (as many old ones removed once a worker holds 4096)"
    )
    p.add_argument("--reserve-interval-s", type=float, default=0.02, help="between router A's timed reservations")
    p.add_argument("--catchup-entries", type=int, default=1 << 20, help="entries the new follower syncs (0 = skip)")
    p.add_argument("--catchup-runs", type=int, default=3, help="new followers timed (the median is reported)")
    p.add_argument(
        "--memory-entries",
        type=int,
        default=1 << 20,
        help="entries of the in-process view for bytes_per_entry and ingest (0 = skip)",
    )
    p.add_argument("--ingest-batches", type=int, default=20000, help="recorded agent batches the view applies")
    p.add_argument("--ingest-batches-per-message", type=int, default=4, help="agent batches per FollowUpdate")
    p.add_argument(
        "--index-backend", default="auto", choices=BACKENDS, help="the prefix index the views hold (FleetView's index_factory)"
    )
    p.add_argument(
        "--modes",
        default="embedded,redis",
        help="comma-separated: embedded (one control plane; the catch-up runs there), redis (two replicas)",
    )
    p.add_argument("--repeat", type=int, default=1, help="run the process measurements this many times (medians)")
    p.add_argument("--taskset-control-plane", default="", metavar="CPUS", help="pin the control plane(s), e.g. 1")
    p.add_argument("--taskset-follower", default="", metavar="CPUS", help="pin the follower process(es), e.g. 0")
    p.add_argument("--taskset-agents", default="", metavar="CPUS", help="pin the synthetic agents, e.g. 1")
    p.add_argument("--workdir", default="", help="logs and reports (empty: a temp dir)")


def add_live_arguments(p: argparse.ArgumentParser) -> None:
    """Defaults: a load where round-robin thrashes 640-block caches (8 x 2048-token prefixes = 1024
    blocks, more than one engine holds, less than the fleet's 2560) and queues; ~35 s on 2 cores."""
    from kvroute.data_plane.decision.policies import POLICIES, kv_aware_param
    from kvroute.tools.simulator.cli import add_generated_workload_knobs
    from kvroute.tools.simulator.workloads import WORKLOAD_NAMES  # light; keeps `kvroute --help` from importing aiohttp

    w = p.add_argument_group("workload (the knobs of `kvroute simulate`)")
    w.add_argument("--workload", choices=WORKLOAD_NAMES, default="shared-prefix", help="generated workload")
    add_generated_workload_knobs(w, requests=600, rate=20.0, output_tokens=16)
    w.add_argument("--seed", type=int, default=0, help="workload and simulator seed")
    f = p.add_argument_group("local fleet (started unless --router-url / --engine-urls are given)")
    f.add_argument(
        "--policies",
        type=name_list(POLICIES, "policy", allow_empty=True),
        default="kv_aware,round_robin",
        help="comma-separated policies, one router each",
    )
    f.add_argument(
        "--kv-aware-param",
        type=kv_aware_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one of kv_aware's weights (kvroute.data_plane.decision.policies.KvAwareParams) for its router and its "
        "simulation, repeatable; with --router-url, pass the router's own",
    )
    f.add_argument("--engines", type=int, default=4, help="sim engines, each with its own agent")
    f.add_argument(
        "--routers",
        default="1",
        metavar="N[,N...]",
        help="routers per policy, taking the requests in turn (each its own process with its own view of "
        "the fleet); several counts (e.g. 1,4) run one after another on the same fleet, named POLICY@N, "
        "and the simulator models each with --routers N",
    )
    f.add_argument("--num-blocks", type=int, default=640, help="KV cache capacity of each engine, in blocks")
    f.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    f.add_argument(
        "--speedup",
        type=float,
        default=2.0,
        help="engines run this many times faster than the cost model (arrivals are divided by it, latencies multiplied back)",
    )
    f.add_argument("--workdir", default="", help="directory for logs and the tiny model (empty: a temp dir)")
    t = p.add_argument_group("an already running fleet (--num-blocks, --block-size, --speedup must describe it)")
    t.add_argument(
        "--router-url", type=http_url_or_none, default="", help="bench this router (its own policy) instead of a local fleet"
    )
    t.add_argument(
        "--engine-urls", type=http_urls, default="", help="comma-separated engine URLs: /metrics hit rate, cache reset, --direct"
    )
    t.add_argument("--model", default="tiny-llama", help="served model name")
    t.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="vocabulary the workload's token ids are folded into (a local fleet uses the tiny model's own)",
    )
    p.add_argument("--direct", action="store_true", help="also run a no-router baseline: round-robin to the engines")
    p.add_argument(
        "--epp",
        action="store_true",
        help="also run each policy through `kvroute epp` (the endpoint picker; needs kvroute[epp]): the "
        "client asks it over ext_proc as Envoy does and sends each request to the engine it picked",
    )
    p.add_argument(
        "--pd",
        default="",
        choices=("vllm", "sglang"),
        help="a prefill/decode fleet instead: --engines prefill and --decode-engines decode sim engines "
        "with that protocol, one `--pd` router per policy choosing the prefill worker; hit rate from "
        "the prefill engines, no simulated column",
    )
    p.add_argument("--decode-engines", type=int, default=2, help="--pd: decode sim engines")
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="closed loop with this many requests in flight (0: open loop at the arrival times)",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result")


def run(args: argparse.Namespace) -> int:
    if args.bench == "live":
        from kvroute.tools.bench.live import run as run_live

        return run_live(args)  # prints its own table and JSON
    if args.bench == "fuzz":
        from kvroute.tools.bench.fuzz import run as run_fuzz

        return run_fuzz(args)  # prints its own table and JSON; exit 1 when the target failed
    if args.bench == "ingest":
        from kvroute.tools.bench.ingest import run_ingest

        result = run_ingest(
            args.batches,
            args.blocks_per_event,
            workers=args.workers,
            max_index_entries=args.max_index_entries,
            index_backend=args.index_backend,
            memory_entries=args.memory_entries,
        )
    elif args.bench == "follow":
        from kvroute.tools.bench.follow import run_follow

        result = run_follow(args)
    elif args.bench == "saturate":
        import sys

        from kvroute.tools.bench.saturate import MissingTool, run_saturate

        try:
            result = run_saturate(
                tuple(args.peer), args.seconds, args.rounds, args.connections, args.engines, args.router_core, args.workdir
            )
        except MissingTool as exc:
            print(exc, file=sys.stderr)
            return 2
    elif args.bench == "burst":
        from kvroute.tools.bench.burst import run_burst

        result = run_burst(args.workers, routers=args.routers)
    elif args.bench == "decision":
        from kvroute.tools.bench.decision import run_decision

        result = run_decision(
            args.prompt_tokens,
            args.workers,
            args.block_size,
            args.iterations,
            other_blocks=args.other_blocks,
            pin_cores=args.pin_cores,
            max_index_entries=args.max_index_entries,
            index=args.index,
            follow_rate=args.follow_rate,
            interval_ms=args.interval_ms,
            max_seconds=args.max_seconds,
        )
    elif args.bench == "answer":
        from kvroute.tools.bench.answer import run_answer

        result = run_answer(
            args.workers,
            iterations=args.iterations,
            pause_ms=args.pause_ms,
            max_index_entries=args.max_index_entries,
            index_backend=args.index_backend,
        )
    elif args.bench == "replicas":
        from kvroute.tools.bench.replicas import run_replicas

        result = run_replicas(
            args.batches,
            args.trials,
            tuple(int(n) for n in args.catchup_blocks.split(",")),
            args.workdir,
            args.chaos_s,
            args.answer_step_s,
        )
    elif args.bench == "kill":
        from kvroute.tools.bench.kill import format_table as kill_table
        from kvroute.tools.bench.kill import run_kill

        result = run_kill(args.rate, args.phase_s, args.down_s)
        if not args.json:
            print(kill_table(result))
        print(json.dumps(result))
        return (
            0
            if all(
                f["failed"] == 0 or (f["kind"] == "router" and f["failed"] <= f["inflight_on_killed"]) for f in result["faults"]
            )
            else 1
        )
    elif args.bench == "soak":
        from kvroute.tools.bench.soak import format_table as soak_table
        from kvroute.tools.bench.soak import run_soak

        result = run_soak(
            args.minutes,
            args.sample_s,
            args.churn_s,
            args.rate,
            args.warmup_s,
            plots=args.plots,
            router_cache_tokens=args.router_cache_tokens,
        )
        if not args.json:
            print(soak_table(result))
        print(json.dumps(result))
        return 1 if result["violations"] else 0
    elif args.bench == "inflight":
        from kvroute.tools.bench.inflight import run_inflight

        result = run_inflight(args.trials, args.block_keys)
    else:
        from kvroute.tools.bench.proxy import format_table, run_proxy

        result = run_proxy(args.requests, tuple(p for p in args.policies.split(",") if p), tuple(args.peer), args.engines)
        if not args.json:
            print(format_table(result))
            print(json.dumps(result))
            return 0
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    print(json.dumps(result))
    return 0
