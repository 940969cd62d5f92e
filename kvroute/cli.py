"""`kvroute` console script: one subcommand per process kind.

Each subcommand lives in the module that owns it and exposes
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches, so no plane
imports another.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "control-plane": ("kvroute.control_plane.cli", "run the control plane (global prefix index + worker registry, gRPC)"),
    "agent": ("kvroute.worker_agent.cli", "run a worker agent: engine KV events -> control plane"),
    "router": ("kvroute.data_plane.cli", "run a stateless router (OpenAI-compatible HTTP + gRPC Route)"),
    "sim-engine": ("kvroute.tools.sim_engine.cli", "run a GPU-free vLLM stand-in (OpenAI API, real vLLM KV events)"),
    "tiny-model": ("kvroute.tools.tiny_model", "write the demo's tiny local model (tokenizer + config) for --tokenizer"),
    "audit": ("kvroute.control_plane.audit_cli", "compare the control plane's block keys per worker with what each engine caches"),
    "demo": ("kvroute.tools.demo", "compare kv_aware with round_robin live: a local fleet per policy, all at once"),
    "simulate": ("kvroute.tools.simulator.cli", "simulate a fleet on a trace or generated workload under several policies"),
    "bench": ("kvroute.tools.bench.cli", "hot-path micro-benchmarks (ingest, decision, proxy) and the live workload bench (live)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for LLM inference fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
