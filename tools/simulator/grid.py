"""`kvroute simulate --grid`: every source x cache size x arrival rate x router count, several seeds,
one set of policy parameters for all points; kv_aware against the best other policy at each point.

Usage: `kvroute simulate --grid --seeds 3,4,5 --jobs 2` (a tiny one: `--grid-sources one-shot
--grid-caches default --grid-rates default --requests 40 --seeds 1,2`).

Sources are the generated workloads at the rates and cache sizes the simulator suite used for them
(docs/benchmarks/2026-12-03-simulator-suite.md: 8 workers, 16-token blocks, 32 groups) and the
shipped Mooncake slice at its own arrival times with 1M tokens of KV per engine (`kvroute simulate`'s
default). A point scales those defaults: cache `roomy` / `default` / `tight` multiplies the blocks per
engine by CACHE_FACTORS, rate `low` / `default` / `high` multiplies the arrival rate by RATE_FACTORS
(for the trace: divides its inter-arrival times). Each point runs every policy on every seed with
one router and with several (`routers`, each on a view of the fleet `view_delay_ms` late); a
point's figures are means over its seeds, and kv_aware's ratio is its mean over the lowest mean
among the other policies, for p50 and p99 separately. kv_aware meets the targets at a point when
its p50 ratio <= P50_TARGET and its p99 ratio <= P99_TARGET.

Contract: a (source, cache, rate, seed) task is self-contained and seeded, so `jobs` processes give
the numbers one process gives, bit for bit. `run_grid` returns the JSON document `kvroute simulate
--grid` prints as its last line; `markdown(document)` is the table it prints before it.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.simulator.fleet import FleetConfig, oracle_hit_rates, simulate_policy
from kvroute.tools.simulator.workloads import GeneratedWorkload, SimWorkloadRequest, generate, load_mooncake_trace
from kvroute.tools.stats import percentile

MOONCAKE = "mooncake"
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class SourceDefaults:
    """A source's default point: arrival rate (req/s; None = the trace's own times) and blocks per engine."""

    rate_rps: float | None
    num_blocks: int
    block_size: int


# The simulator suite's rate and cache size per workload; the trace at 1M tokens per engine.
SOURCES: dict[str, SourceDefaults] = {
    "agent": SourceDefaults(3.0, 4096, 16),
    "rag": SourceDefaults(6.0, 2048, 16),
    "multi-turn": SourceDefaults(12.0, 1024, 16),
    "hot-prefix": SourceDefaults(24.0, 2048, 16),
    "one-shot": SourceDefaults(8.0, 1024, 16),
    "shared-prefix": SourceDefaults(12.0, 1024, 16),
    MOONCAKE: SourceDefaults(None, 2048, 512),
}
GROUPS = 32  # distinct shared prompts / documents / agents, as in the suite
CACHE_FACTORS: dict[str, float] = {"roomy": 4.0, "default": 1.0, "tight": 0.5}
RATE_FACTORS: dict[str, float] = {"low": 0.5, "default": 1.0, "high": 1.5}
GRID_POLICIES = ("kv_aware", "approx_tree", "chwbl", "least_loaded", "round_robin", "session")
CHALLENGER = "kv_aware"
P50_TARGET = 1.02
P99_TARGET = 1.1


@dataclass(frozen=True)
class GridSpec:
    sources: Sequence[str] = tuple(SOURCES)
    caches: Sequence[str] = tuple(CACHE_FACTORS)
    rates: Sequence[str] = tuple(RATE_FACTORS)
    seeds: Sequence[int] = (3, 4, 5)
    routers: Sequence[int] = (1, 4)
    view_delay_ms: float = 10.0  # for points with several routers; one router reads the control plane itself
    policies: Sequence[str] = GRID_POLICIES
    requests: int = 2000  # per generated workload
    trace_limit: int | None = None  # the trace's first N requests (None: all)
    workers: int = 8
    trace_path: str = str(SHIPPED_TRACE)
    prefill_tokens_per_s: float | None = None
    event_delay_ms: float = 0.0
    kv_aware_params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Task:
    source: str
    cache: str
    rate: str
    seed: int


def _workload(spec: GridSpec, task: _Task) -> list[SimWorkloadRequest]:
    factor = RATE_FACTORS[task.rate]
    if task.source == MOONCAKE:
        requests = load_mooncake_trace(spec.trace_path, spec.trace_limit).requests
        for r in requests:
            r.arrival_s /= factor
        return requests
    base = SOURCES[task.source].rate_rps
    assert base is not None
    return generate(GeneratedWorkload(task.source, requests=spec.requests, rate_rps=base * factor, seed=task.seed, groups=GROUPS))


def factors(table: dict[str, float]) -> str:
    """`roomy 4x, default 1x, ...`: a factor table for --help."""
    return ", ".join(f"{name} {factor:g}x" for name, factor in table.items())


def num_blocks(source: str, cache: str) -> int:
    return max(1, round(SOURCES[source].num_blocks * CACHE_FACTORS[cache]))


def _run_task(spec: GridSpec, task: _Task) -> tuple[_Task, dict]:
    """One seed of one point: ceilings, and per router count each policy's hit rate and TTFT p50 / p99."""
    workload = _workload(spec, task)
    defaults = SOURCES[task.source]
    blocks = num_blocks(task.source, task.cache)
    cost = CostModel(prefill_tokens_per_s=spec.prefill_tokens_per_s) if spec.prefill_tokens_per_s else CostModel()
    ceiling, ceiling_inf = oracle_hit_rates(workload, defaults.block_size, [blocks * spec.workers, None])
    by_routers: dict[int, dict[str, dict[str, float]]] = {}
    for routers in spec.routers:
        config = FleetConfig(
            workers=spec.workers,
            num_blocks=blocks,
            block_size=defaults.block_size,
            cost=cost,
            event_delay_s=spec.event_delay_ms / 1000,
            seed=task.seed,
            kv_aware_params=spec.kv_aware_params,
            routers=routers,
            view_delay_s=spec.view_delay_ms / 1000 if routers > 1 else 0.0,
        )
        by_routers[routers] = {}
        for name in spec.policies:
            run = simulate_policy(name, workload, config)
            by_routers[routers][name] = {
                "hit_rate": run.hit_rate,
                "ttft_p50_ms": percentile(run.ttft_s, 50) * 1000,
                "ttft_p99_ms": percentile(run.ttft_s, 99) * 1000,
            }
    return task, {"ceiling": ceiling, "ceiling_infinite": ceiling_inf, "requests": len(workload), "routers": by_routers}


def _run_task_star(args: tuple[GridSpec, _Task]) -> tuple[_Task, dict]:
    return _run_task(*args)


def kv_aware_ratio(means: dict[str, float], challenger: str = CHALLENGER) -> tuple[float, str]:
    """The challenger's value over the lowest other policy's, and that policy (ties: the first named)."""
    best = min((name for name in means if name != challenger), key=lambda name: means[name])
    if means[best] == 0:
        return (1.0 if means[challenger] == 0 else float("inf")), best
    return means[challenger] / means[best], best


def run_grid(spec: GridSpec, jobs: int = 1, progress: Callable[[int, int], None] | None = None) -> dict:
    """Every task, in `jobs` processes (a fork server: the caller may hold threads), then the document."""
    if CHALLENGER not in spec.policies or len(spec.policies) < 2:
        raise ValueError(f"the grid compares {CHALLENGER} with other policies: name it and at least one more")
    if MOONCAKE in spec.sources and not Path(spec.trace_path).is_file():
        raise ValueError(
            f"the grid's Mooncake trace {spec.trace_path} is not a file: pass --grid-trace, or leave "
            f"{MOONCAKE} out of --grid-sources"
        )
    tasks = [_Task(s, c, r, seed) for s in spec.sources for c in spec.caches for r in spec.rates for seed in spec.seeds]
    results: dict[_Task, dict] = {}
    if jobs <= 1:
        for task in tasks:
            results[task] = _run_task(spec, task)[1]
            if progress:
                progress(len(results), len(tasks))
    else:
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(jobs) as pool:
            for task, result in pool.imap_unordered(_run_task_star, [(spec, t) for t in tasks]):
                results[task] = result
                if progress:
                    progress(len(results), len(tasks))
    return _document(spec, results)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _document(spec: GridSpec, results: dict[_Task, dict]) -> dict:
    points = []
    summary = {str(r): {"points": 0, "meet_p50": 0, "meet_p99": 0, "meet_both": 0} for r in spec.routers}
    for source in spec.sources:
        defaults = SOURCES[source]
        for cache in spec.caches:
            for rate in spec.rates:
                per_seed = {seed: results[_Task(source, cache, rate, seed)] for seed in spec.seeds}
                first = per_seed[spec.seeds[0]]
                for routers in spec.routers:
                    policies: dict[str, dict[str, Any]] = {}
                    for name in spec.policies:
                        seeds = {
                            str(s): {k: round(v, 4 if k == "hit_rate" else 3) for k, v in r["routers"][routers][name].items()}
                            for s, r in per_seed.items()
                        }
                        policies[name] = {
                            metric: _mean([r["routers"][routers][name][metric] for r in per_seed.values()])
                            for metric in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")
                        }
                        policies[name]["per_seed"] = seeds
                    ratio_p50, best_p50 = kv_aware_ratio({n: p["ttft_p50_ms"] for n, p in policies.items()})
                    ratio_p99, best_p99 = kv_aware_ratio({n: p["ttft_p99_ms"] for n, p in policies.items()})
                    for p in policies.values():
                        p["hit_rate"] = round(p["hit_rate"], 4)
                        p["ttft_p50_ms"] = round(p["ttft_p50_ms"], 3)
                        p["ttft_p99_ms"] = round(p["ttft_p99_ms"], 3)
                    meets_p50, meets_p99 = ratio_p50 <= P50_TARGET, ratio_p99 <= P99_TARGET
                    tally = summary[str(routers)]
                    tally["points"] += 1
                    tally["meet_p50"] += meets_p50
                    tally["meet_p99"] += meets_p99
                    tally["meet_both"] += meets_p50 and meets_p99
                    points.append(
                        {
                            "source": source,
                            "cache": cache,
                            "rate": rate,
                            "routers": routers,
                            "view_delay_ms": spec.view_delay_ms if routers > 1 else 0.0,
                            "workers": spec.workers,
                            "num_blocks": num_blocks(source, cache),
                            "block_size": defaults.block_size,
                            "rate_rps": None if defaults.rate_rps is None else defaults.rate_rps * RATE_FACTORS[rate],
                            "rate_factor": RATE_FACTORS[rate],
                            "cache_factor": CACHE_FACTORS[cache],
                            "requests": first["requests"],
                            "ceiling": round(_mean([r["ceiling"] for r in per_seed.values()]), 4),
                            "ceiling_infinite": round(_mean([r["ceiling_infinite"] for r in per_seed.values()]), 4),
                            "policies": policies,
                            "kv_aware_ratio_p50": round(ratio_p50, 4),
                            "best_other_p50": best_p50,
                            "kv_aware_ratio_p99": round(ratio_p99, 4),
                            "best_other_p99": best_p99,
                            "meets_p50": meets_p50,
                            "meets_p99": meets_p99,
                        }
                    )
    return {
        "grid": {
            "sources": list(spec.sources),
            "caches": {c: CACHE_FACTORS[c] for c in spec.caches},
            "rates": {r: RATE_FACTORS[r] for r in spec.rates},
            "seeds": list(spec.seeds),
            "routers": list(spec.routers),
            "view_delay_ms": spec.view_delay_ms,
            "policies": list(spec.policies),
            "requests": spec.requests,
            "trace_limit": spec.trace_limit,
            "workers": spec.workers,
            "kv_aware_params": spec.kv_aware_params,
            "targets": {"p50_ratio": P50_TARGET, "p99_ratio": P99_TARGET},
        },
        "points": points,
        "summary": summary,
    }


def markdown(document: dict) -> list[str]:
    """Per point and router count: each policy's p50 / p99 ms (hit rate), the pooled ceiling, kv_aware's
    ratios to the best other policy, flagged where they miss a target; then the count per router count."""
    policies = document["grid"]["policies"]
    lines = [
        "| source | cache | rate | routers | ceiling | "
        + " | ".join(policies)
        + " | kv_aware p50 ratio | kv_aware p99 ratio | misses |",
        "|---|---|---|---|---|" + "---|" * len(policies) + "---|---|---|",
    ]
    for p in document["points"]:
        cells = [
            f"{p['policies'][n]['ttft_p50_ms']:.1f} / {p['policies'][n]['ttft_p99_ms']:.1f} ({p['policies'][n]['hit_rate']:.0%})"
            for n in policies
        ]
        misses = [f"p50 (vs {p['best_other_p50']})"] if not p["meets_p50"] else []
        misses += [f"p99 (vs {p['best_other_p99']})"] if not p["meets_p99"] else []
        lines.append(
            f"| {p['source']} | {p['cache']} | {p['rate']} | {p['routers']} | {p['ceiling']:.1%} | "
            + " | ".join(cells)
            + f" | {p['kv_aware_ratio_p50']:.3f} | {p['kv_aware_ratio_p99']:.3f} | "
            f"{'**' + ', '.join(misses) + '**' if misses else ''} |"
        )
    targets = document["grid"]["targets"]
    lines += [
        "",
        (f"| routers | points | p50 <= {targets['p50_ratio']}x best other | p99 <= {targets['p99_ratio']}x best other | both |"),
        "|---|---|---|---|---|",
    ]
    for routers, t in document["summary"].items():
        lines.append(f"| {routers} | {t['points']} | {t['meet_p50']} | {t['meet_p99']} | {t['meet_both']} |")
    return lines
