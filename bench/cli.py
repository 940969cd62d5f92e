"""`kvroute bench {ingest,decision,proxy}`: hot-path micro-benchmarks; the last stdout line is JSON."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    ingest = sub.add_parser("ingest", help="event decode -> key resolution -> index update (block events/s, bytes/entry)")
    ingest.add_argument("--batches", type=int, default=4000, help="vLLM event batches to ingest")
    ingest.add_argument("--blocks-per-event", type=int, default=16, help="blocks per BlockStored")
    ingest.add_argument("--workers", type=int, default=8, help="workers the batches are spread over")
    decision = sub.add_parser("decision", help="tokenize + hash + control-plane query over gRPC + score (p50/p99)")
    decision.add_argument("--prompt-tokens", type=int, default=8192, help="prompt length")
    decision.add_argument("--workers", type=int, default=64, help="registered workers")
    decision.add_argument("--iterations", type=int, default=300, help="timed decisions")
    decision.add_argument("--block-size", type=int, default=16, help="worker block size")
    proxy = sub.add_parser("proxy", help="completion latency direct to an engine vs through the router")
    proxy.add_argument("--requests", type=int, default=300, help="requests per path")
    for sp in (ingest, decision, proxy):
        sp.add_argument("--json", action="store_true", help="print only the JSON result")


def run(args: argparse.Namespace) -> int:
    if args.bench == "ingest":
        from bench.ingest import run_ingest

        result = run_ingest(args.batches, args.blocks_per_event, workers=args.workers)
    elif args.bench == "decision":
        from bench.decision import run_decision

        result = run_decision(args.prompt_tokens, args.workers, args.block_size, args.iterations)
    else:
        from bench.proxy import run_proxy

        result = run_proxy(args.requests)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    print(json.dumps(result))
    return 0
