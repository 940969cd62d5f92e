"""`kvroute bench live --pd vllm|sglang`: the live workload through a prefill/decode fleet, once per
policy choosing the prefill worker (kv_aware against round_robin by default), on the same fleet.

    kvroute bench live --pd vllm --engines 4 --decode-engines 2 --policies kv_aware,round_robin

A local fleet of `--engines` prefill and `--decode-engines` decode sim engines (each with its agent
registering its role) and one `--pd` router per policy. Every run starts from empty prefill caches.
Hit rate comes from the prefill engines' own prefix-cache counters (the decode engines take the
prompt's KV from the transfer, so theirs say nothing of the choice); TTFT is client-side, first
text chunk of the decode worker's stream, prefill leg and transfer included, scaled back to
cost-model time (x speedup). The simulator does not model P/D pools, so there is no simulated
column. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial

from kvroute.tools.bench.live import (
    LiveRun,
    fleet_idle,
    local_cluster,
    run_live,
    sim_engine_args,
    split_csv,
    wait_router_ready,
)
from kvroute.tools.local_cluster import LocalCluster
from kvroute.tools.simulator.cli import generated_workload
from kvroute.tools.simulator.workloads import SimWorkloadRequest


def start_pd_fleet(cluster: LocalCluster, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The control plane, prefill-i and decode-j sim engines with their agents: (prefill URLs, decode URLs)."""
    cluster.start_control_plane()
    pools = {"prefill": args.engines, "decode": args.decode_engines}
    for role, count in pools.items():
        for i in range(count):
            cluster.add_sim_engine(
                f"{role}-{i}", *sim_engine_args(args), "--role", role, "--pd-protocol", args.pd, agent_args=("--role", role)
            )
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered()
    urls = {role: [e.url for e in cluster.engines if e.worker_id.startswith(role + "-")] for role in pools}
    return urls["prefill"], urls["decode"]


def run_pd(args: argparse.Namespace, workload: list[SimWorkloadRequest], log: Callable[..., None]) -> dict[str, LiveRun]:
    cluster, bodies, probes = local_cluster(args, workload, "kvroute-bench-pd-")
    log(
        f"starting {args.engines} prefill + {args.decode_engines} decode sim engines ({args.pd}) x {args.num_blocks} "
        f"blocks of {args.block_size}, speedup {args.speedup}; logs in {cluster.workdir}"
    )
    runs: dict[str, LiveRun] = {}
    try:
        prefill_urls, _ = start_pd_fleet(cluster, args)
        weights = [a for item in args.kv_aware_param for a in ("--kv-aware-param", item)]
        workers = args.engines + args.decode_engines
        for policy in split_csv(args.policies):
            url = cluster.start_router(
                f"pd-{policy}", policy, "--pd", args.pd, "--query-timeout-ms", "500", *(weights if policy == "kv_aware" else ())
            )
            log(f"live: {policy} choosing the prefill worker ...")
            ready = partial(
                wait_router_ready,
                url,
                cluster.model,
                workers,
                probes,
                procs=tuple(cluster.all_processes()),
                fleet_idle=partial(fleet_idle, cluster),
            )
            runs[policy] = run_live(policy, url, prefill_urls, bodies, workload, args, ready)
            cluster.stop_router(f"pd-{policy}")
    finally:
        cluster.stop()
    return runs


def print_pd_table(runs: dict[str, LiveRun], file=sys.stdout) -> None:
    print(f"{'prefill policy':<16} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'errors':>7}  prefill workers", file=file)
    for name, run in runs.items():
        s = run.summary()
        hit = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        print(
            f"{name:<16} {hit:>9} {s['ttft_p50_ms']:>8.1f}ms {s['ttft_p99_ms']:>8.1f}ms {s['errors']:>7}  "
            f"{s.get('per_prefill_worker', {})}",
            file=file,
        )


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    workload = generated_workload(args)
    runs = run_pd(args, workload, log)
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
            "pd": args.pd,
            "prefill_engines": args.engines,
            "decode_engines": args.decode_engines,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "speedup": args.speedup,
            "loop": f"closed x{args.concurrency}" if args.concurrency > 0 else "open",
        },
        "policies": {name: {"live": r.summary()} for name, r in runs.items()},
        "wall_s": round(time.monotonic() - started, 1),
    }
    if not args.json:
        print_pd_table(runs)
        print(
            f"{len(workload)} {args.workload} requests, {args.engines} prefill + {args.decode_engines} decode "
            f"engines x {args.num_blocks} blocks; {result['wall_s']}s"
        )
    print(json.dumps(result))
    return 0 if all(r.errors == 0 for r in runs.values()) else 1
