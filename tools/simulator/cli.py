"""`kvroute simulate`: replay a trace or a generated workload against a simulated fleet under
several policies, side by side, next to the pooled-cache ceiling; or, with `--grid`, every workload
and the shipped trace x cache sizes x arrival rates x router counts (kvroute.tools.simulator.grid).
Last stdout line: JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from kvroute.process import int_list, name_list, non_negative, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.data_plane.decision.policies import POLICIES, kv_aware_param
    from kvroute.tools.simulator.fleet import TTFT_ORACLE
    from kvroute.tools.simulator.grid import CACHE_FACTORS, GRID_POLICIES, RATE_FACTORS, SOURCES, factors
    from kvroute.tools.simulator.workloads import WORKLOAD_NAMES

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--workload", choices=WORKLOAD_NAMES, help="generated workload")
    src.add_argument(
        "--grid",
        action="store_true",
        help="every --grid-sources x --grid-caches x --grid-rates point, once per seed of --seeds "
        "(default 3,4,5) and per router count of --grid-routers, with one set of policy "
        "parameters; prints per point each policy's TTFT p50 / p99 and hit rate (means over "
        "the seeds) and kv_aware's ratio to the best other policy, flagged past 1.02x (p50) "
        "or 1.1x (p99). A source's default point is the rate and blocks per engine of the "
        "simulator suite (agent 3 req/s 4096 blocks, rag 6 / 2048, multi-turn 12 / 1024, "
        "hot-prefix 24 / 2048, one-shot 8 / 1024, shared-prefix 12 / 1024; 16-token blocks, "
        "32 groups) or, for mooncake, the trace's own arrival times and 2048 blocks of 512 "
        f"tokens; cache sizes scale the blocks ({factors(CACHE_FACTORS)}), rates the arrival "
        f"rate ({factors(RATE_FACTORS)}). --workers, --requests, --limit (the trace's), "
        "--policies, --jobs (points in parallel, default 1), --kv-aware-param, "
        "--event-delay-ms and --prefill-tokens-per-s apply to every point; the other "
        "workload knobs do not",
    )
    p.add_argument(
        "--policies",
        type=name_list([*POLICIES, TTFT_ORACLE], "policy"),
        default=None,
        help="comma-separated policies (default round_robin,random,least_loaded,kv_aware; with --grid "
        f"{','.join(GRID_POLICIES)}); ttft_oracle (simulator only) is a reference that reads the "
        "engines' exact state",
    )
    p.add_argument("--workers", type=int, default=8, help="simulated engines")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV capacity per engine in blocks (default: 1M tokens' worth, about what a 70B model leaves free on 8x80 GB)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="engine block size (default for a trace: the block size its hash ids stand for, its rows' "
        "block_size, 512 in Mooncake's traces which name none, since sharing is known at that "
        "granularity only; 16 for generated workloads)",
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N trace requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide trace inter-arrival times by this")
    add_generated_workload_knobs(p.add_argument_group("generated workload"))
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, help="cost model: prefill rate")
    p.add_argument("--event-delay-ms", type=float, default=0.0, help="KV event propagation delay to the index")
    p.add_argument(
        "--routers",
        type=positive(int),
        default=1,
        help="routers taking the requests in turn, each deciding on its own view of the fleet and sharing "
        "its in-flight requests through the control plane",
    )
    p.add_argument(
        "--view-delay-ms",
        type=non_negative(float),
        default=None,
        help="how late every change (engine events and load, other routers' reservations) reaches a "
        "router's view; with --routers 1 and 0 the router reads the control plane's state itself "
        "(default 0; with --grid 10, the view-lag target, for its points with several routers)",
    )
    grid = p.add_argument_group("grid")
    grid.add_argument(
        "--grid-sources",
        type=name_list(list(SOURCES), "source"),
        default=",".join(SOURCES),
        help="the grid's workloads and trace",
    )
    grid.add_argument(
        "--grid-caches",
        type=name_list(list(CACHE_FACTORS), "cache size"),
        default=",".join(CACHE_FACTORS),
        help="the grid's cache sizes",
    )
    grid.add_argument(
        "--grid-rates",
        type=name_list(list(RATE_FACTORS), "rate"),
        default=",".join(RATE_FACTORS),
        help="the grid's arrival rates",
    )
    grid.add_argument("--grid-routers", type=int_list, default="1,4", help="the grid's router counts")
    grid.add_argument(
        "--grid-trace", default=None, help="the grid's Mooncake trace (default: the slice the repository ships in traces/)"
    )
    p.add_argument(
        "--kv-aware-param",
        type=kv_aware_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one of kv_aware's weights (kvroute.data_plane.decision.policies.KvAwareParams), repeatable",
    )
    p.add_argument(
        "--prefill-workers",
        type=non_negative(int),
        default=0,
        metavar="N",
        help="also simulate each policy on P/D pools of the same --workers: N prefill workers (the policy "
        "chooses among them), the rest decode (fewest requests), KV moved per --pd-transfer-ms-per-block; "
        "its rows are named POLICY P/D N+M and its hit rate is the prefill pool's",
    )
    p.add_argument(
        "--pd-transfer-ms-per-block",
        type=non_negative(float),
        default=0.1,
        metavar="MS",
        help="P/D: time a prefill's KV takes to reach its decode worker, per block",
    )
    p.add_argument("--seed", type=int, default=0, help="makes a run reproducible bit for bit")
    p.add_argument(
        "--seeds",
        type=int_list,
        default=None,
        metavar="S1,S2,...",
        help="run the comparison once per seed and summarise it per policy (mean, min, max; on how "
        "many seeds each had the lowest p50 and p99): tells a win from a tie (replaces --seed)",
    )
    p.add_argument(
        "--jobs",
        type=positive(int),
        default=None,
        help="policies simulated in parallel (default: one per core); with --grid, seeds of points (default 1)",
    )
    p.add_argument("--report", default=None, help="also write a Markdown report to this file")
    p.add_argument(
        "--plots",
        default=None,
        metavar="DIR",
        help="also write PNG plots (ttft_cdf.png, hit_rate.png) to DIR; the report links them",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result")


def add_generated_workload_knobs(g, requests: int = 2000, rate: float = 20.0, output_tokens: int = 128) -> None:
    """The generated suite's knobs, shared with `kvroute bench live` so both build the same workload."""
    g.add_argument("--requests", type=int, default=requests, help="number of requests")
    g.add_argument("--rate", type=float, default=rate, help="mean arrival rate (req/s of cost-model time)")
    g.add_argument("--arrival", choices=["poisson", "bursty"], default="poisson", help="arrival process")
    g.add_argument("--groups", type=int, default=8, help="distinct shared prompts / documents / agents")
    g.add_argument("--system-prompt-tokens", type=int, default=2048, help="shared prefix length")
    g.add_argument("--output-tokens", type=int, default=output_tokens, help="output tokens per request")
    g.add_argument("--burst-size", type=int, default=4, help="bursts: requests per burst (one prefix)")
    g.add_argument("--burst-gap-ms", type=float, default=1.5, help="bursts: time between a burst's requests")


def generated_workload(args: argparse.Namespace) -> list:
    """The generated workload those knobs (and --workload, --seed) describe."""
    from kvroute.tools.simulator.workloads import GeneratedWorkload, generate

    return generate(
        GeneratedWorkload(
            args.workload,
            requests=args.requests,
            rate_rps=args.rate,
            arrival=args.arrival,
            seed=args.seed,
            groups=args.groups,
            system_prompt_tokens=args.system_prompt_tokens,
            output_tokens=args.output_tokens,
            burst_size=args.burst_size,
            burst_gap_ms=args.burst_gap_ms,
        )
    )


def _pct(values: list[float], q: float) -> float:
    from kvroute.tools.stats import percentile

    return percentile(values, q)


def validate(args: argparse.Namespace) -> None:
    """Flags valid alone but not together (checked when parsed, by `kvroute config check` too)."""
    if args.seeds and args.plots:
        raise ValueError("--plots draws one seed's runs; use it with --seed, not --seeds")
    if args.grid and args.plots:
        raise ValueError("--plots draws one comparison's runs, not a grid's")
    if args.grid and (args.requests <= 0 or args.workers <= 0):
        raise ValueError("--grid needs --requests and --workers > 0")
    if args.grid and any(int(r) <= 0 for r in args.grid_routers.split(",")):
        raise ValueError(f"--grid-routers {args.grid_routers}: a router count is at least 1")
    if args.grid and args.policies and "kv_aware" not in args.policies.split(","):
        raise ValueError("--grid compares kv_aware with the other --policies: name it")
    if args.workload and args.requests <= 0:
        raise ValueError(f"--requests {args.requests}: nothing to simulate")
    if args.prefill_workers and args.prefill_workers >= args.workers:
        raise ValueError(f"--prefill-workers {args.prefill_workers} leaves no decode worker of --workers {args.workers}")


def run(args: argparse.Namespace) -> int:
    from kvroute.data_plane.decision.policies import parse_kv_aware_params

    kv_aware_params = parse_kv_aware_params(args.kv_aware_param)
    if args.grid:
        return _run_grid(args, kv_aware_params)
    args.policies = args.policies or "round_robin,random,least_loaded,kv_aware"
    args.view_delay_ms = args.view_delay_ms or 0.0
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    try:
        trace = _load_trace(args) if args.trace else None
    except (ValueError, OSError) as exc:
        print(f"kvroute simulate: error: {exc}", file=sys.stderr)
        return 2
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    warnings = _trace_warnings(trace) if trace else []
    for warning in warnings:  # printed even with --json: they say why the numbers may mislead
        print(f"kvroute simulate: warning: {warning}", file=sys.stderr)
    if seeds is None:
        return _run_one_seed(args, trace, kv_aware_params, warnings, log)
    return _run_seeds(args, trace, kv_aware_params, seeds, warnings, log)


def _run_grid(args: argparse.Namespace, kv_aware_params: dict) -> int:
    from kvroute.tools.simulator.grid import GRID_POLICIES, SHIPPED_TRACE, GridSpec, markdown, run_grid

    spec = GridSpec(
        sources=args.grid_sources.split(","),
        caches=args.grid_caches.split(","),
        rates=args.grid_rates.split(","),
        seeds=[int(s) for s in (args.seeds or "3,4,5").split(",")],
        routers=[int(r) for r in args.grid_routers.split(",")],
        view_delay_ms=10.0 if args.view_delay_ms is None else args.view_delay_ms,
        policies=args.policies.split(",") if args.policies else GRID_POLICIES,
        requests=args.requests,
        trace_limit=args.limit,
        workers=args.workers,
        trace_path=args.grid_trace or str(SHIPPED_TRACE),
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        event_delay_ms=args.event_delay_ms,
        kv_aware_params=kv_aware_params,
    )
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"  grid: {done}/{total} point-seeds simulated ({time.monotonic() - started:.0f}s)", file=sys.stderr)

    try:
        document = run_grid(spec, jobs=args.jobs or 1, progress=progress)
    except ValueError as exc:
        print(f"kvroute simulate: error: {exc}", file=sys.stderr)
        return 2
    head = (
        f"grid: {len(spec.sources)} sources x {len(spec.caches)} caches x {len(spec.rates)} rates x routers "
        f"{', '.join(map(str, spec.routers))} (view delay {spec.view_delay_ms:g} ms); seeds "
        f"{', '.join(map(str, spec.seeds))}; {spec.workers} workers; {time.monotonic() - started:.0f}s"
    )
    lines = markdown(document)
    if not args.json:
        print(head)
        print("\n".join(lines))
    if args.report:
        with open(args.report, "w") as f:
            f.write(f"# kvroute simulate --grid\n\n{head}\n\n" + "\n".join(lines) + "\n")
    print(json.dumps(document))
    return 0


def _load_trace(args: argparse.Namespace):
    """The trace, time-scaled; ValueError (one line) when it is malformed or has no request."""
    from kvroute.tools.simulator.workloads import load_mooncake_trace

    trace = load_mooncake_trace(args.trace, args.limit)
    if not trace.requests:
        raise ValueError(f"{args.trace} holds no request: nothing to simulate")
    if args.time_scale != 1.0:
        for r in trace.requests:
            r.arrival_s /= args.time_scale
    return trace


# Above this share of prompt tokens in partial last blocks, the trace's granularity hides most sharing.
TAIL_SHARE_WARNING = 0.25


def _trace_warnings(trace) -> list[str]:
    """Why this trace's numbers may mislead: sharing its block size cannot show."""
    if trace.tail_token_share <= TAIL_SHARE_WARNING:
        return []
    return [
        (
            f"{trace.tail_token_share:.0%} of the trace's prompt tokens lie in partial {trace.block_size}-token "
            "blocks, which it can only show as shared when a whole prompt repeats: hit rates are understated and "
            "kv_aware's advantage with them (a prefix-aware policy can even trail round_robin); capture with a "
            "smaller `kvroute router --capture-block-tokens` for prompts this short"
        )
    ]


def _run_seeds(args: argparse.Namespace, trace, kv_aware_params: dict, seeds: list[int], warnings: list[str], log) -> int:
    from kvroute.tools.simulator.seeds import markdown, summarize

    started = time.monotonic()
    per_seed: dict[int, dict] = {}
    for seed in seeds:
        args.seed = seed
        log(f"seed {seed}:")
        outcome = _simulate(args, trace, kv_aware_params, log)
        log("  " + outcome["summary"])
        per_seed[seed] = outcome["policies"]
    summary = summarize(per_seed)
    head = f"{outcome['source']}; seeds {', '.join(map(str, seeds))}; {time.monotonic() - started:.1f}s"
    lines = markdown(per_seed, summary)
    if not args.json:
        print(head)
        print("\n".join(lines))
    if args.report:
        with open(args.report, "w") as f:
            f.write(f"# kvroute simulate\n\n{head}\n\n" + _warning_lines(warnings) + "\n".join(lines) + "\n")
    print(
        json.dumps(
            {
                "seeds": {str(s): r for s, r in per_seed.items()},
                "summary": summary,
                "block_size": outcome["block_size"],
                "warnings": warnings,
            }
        )
    )
    return 0


def _warning_lines(warnings: list[str]) -> str:
    return "".join(f"**Warning:** {w}\n\n" for w in warnings)


def _run_one_seed(args: argparse.Namespace, trace, kv_aware_params: dict, warnings: list[str], log) -> int:
    outcome = _simulate(args, trace, kv_aware_params, log)
    if not args.json:
        print(outcome["summary"])
        print("\n".join(outcome["lines"]))
    plots = []
    if args.plots:
        from kvroute.tools.simulator.plots import write_plots

        plots = write_plots(
            outcome["runs"],
            outcome["oracle"],
            outcome["oracle_inf"],
            args.plots,
            f"{outcome['source_name']}, {args.workers} workers",
        )
        log("plots: " + ", ".join(str(p) for p in plots))
    if args.report:
        with open(args.report, "w") as f:
            f.write(
                f"# kvroute simulate\n\n{outcome['summary']}\n\n" + _warning_lines(warnings) + "\n".join(outcome["lines"]) + "\n"
            )
            for path in plots:
                rel = os.path.relpath(path, os.path.dirname(os.path.abspath(args.report)))
                f.write(f"\n![{path.stem}]({rel})\n")
    views = {"routers": args.routers, "view_delay_ms": args.view_delay_ms} if args.routers > 1 or args.view_delay_ms > 0 else {}
    print(
        json.dumps(
            {
                "oracle_hit_rate": round(outcome["oracle"], 4),
                "oracle_hit_rate_infinite": round(outcome["oracle_inf"], 4),
                "policies": outcome["policies"],
                "block_size": outcome["block_size"],
                "warnings": warnings,
            }
            | views
        )
    )
    return 0


def _simulate(args: argparse.Namespace, trace, kv_aware_params: dict, log) -> dict:
    """One seed (`args.seed`): every policy's results, the Markdown table and the summary line."""
    from kvroute.tools.sim_engine.cost_model import CostModel
    from kvroute.tools.simulator.fleet import TTFT_ORACLE, FleetConfig, oracle_hit_rates
    from kvroute.tools.simulator.sweep import ProgressLine, default_jobs, run_policies

    started = time.monotonic()
    if trace is not None:
        workload = trace.requests
        block_size = args.block_size or trace.block_size
        source = f"trace {args.trace} ({trace.block_size}-token hash ids)"
        source_name = os.path.basename(args.trace)
    else:
        workload = generated_workload(args)
        block_size = args.block_size or 16
        source = source_name = f"workload {args.workload}"
    num_blocks = args.num_blocks or max(1, 1_048_576 // block_size)
    cost = CostModel(prefill_tokens_per_s=args.prefill_tokens_per_s) if args.prefill_tokens_per_s else CostModel()
    config = FleetConfig(
        workers=args.workers,
        num_blocks=num_blocks,
        block_size=block_size,
        cost=cost,
        event_delay_s=args.event_delay_ms / 1000,
        seed=args.seed,
        kv_aware_params=kv_aware_params,
        routers=args.routers,
        view_delay_s=args.view_delay_ms / 1000,
    )
    log(f"{source}: {len(workload)} requests, {args.workers} workers x {num_blocks} blocks of {block_size}")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    t0 = time.monotonic()
    runs = run_policies(
        names,
        workload,
        config,
        jobs=args.jobs or default_jobs(len(names)),
        progress=None if args.json else ProgressLine(len(workload), len(names)),
    )
    if args.prefill_workers:  # the same fleet size split into P/D pools, every router policy again
        pd_names = [n for n in names if n != TTFT_ORACLE]
        pd_config = dataclasses.replace(
            config, prefill_workers=args.prefill_workers, transfer_s_per_block=args.pd_transfer_ms_per_block / 1000
        )
        label = f"P/D {args.prefill_workers}+{args.workers - args.prefill_workers}"
        pd_runs = run_policies(
            pd_names,
            workload,
            pd_config,
            jobs=args.jobs or default_jobs(len(pd_names)),
            progress=None if args.json else ProgressLine(len(workload), len(pd_names)),
        )
        runs |= {f"{name} {label}": run_ for name, run_ in pd_runs.items()}
    log(f"  {len(names)} policies simulated in {time.monotonic() - t0:.1f}s")
    results = {}
    for name, run_ in runs.items():
        busy = run_.busy_s
        results[name] = {
            "hit_rate": round(run_.hit_rate, 4),
            "ttft_p50_ms": round(_pct(run_.ttft_s, 50) * 1000, 2),
            "ttft_p90_ms": round(_pct(run_.ttft_s, 90) * 1000, 2),
            "ttft_p99_ms": round(_pct(run_.ttft_s, 99) * 1000, 2),
            "e2e_p50_ms": round(_pct(run_.e2e_s, 50) * 1000, 2),
            "e2e_p99_ms": round(_pct(run_.e2e_s, 99) * 1000, 2),
            "throughput_rps": round(len(run_.e2e_s) / run_.makespan_s, 3) if run_.makespan_s else 0.0,
            "imbalance": round(max(busy) / (sum(busy) / len(busy)), 3) if sum(busy) else 1.0,
            "rejected": run_.rejected,
        }
    total_blocks = num_blocks * args.workers
    oracle, oracle_inf = oracle_hit_rates(workload, block_size, [total_blocks, None])
    lines = [
        "| policy | hit rate | % of ceiling | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | req/s | imbalance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        share = r["hit_rate"] / oracle if oracle else 0.0
        lines.append(
            f"| {name} | {r['hit_rate']:.1%} | {share:.0%} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
            f"{r['ttft_p99_ms']:.1f} | {r['e2e_p50_ms']:.1f} | {r['e2e_p99_ms']:.1f} | {r['throughput_rps']:.2f} | {r['imbalance']:.2f} |"
        )
    summary = (
        f"{source}; {len(workload)} requests; {args.workers} workers x {num_blocks} blocks of {block_size}; "
        f"pooled-cache ceiling {oracle:.1%} (infinite cache {oracle_inf:.1%}); seed {args.seed}; "
        f"{time.monotonic() - started:.1f}s"
    )
    return {
        "policies": results,
        "lines": lines,
        "summary": summary,
        "runs": runs,
        "oracle": oracle,
        "oracle_inf": oracle_inf,
        "source": source,
        "source_name": source_name,
        "block_size": block_size,
    }
