"""`kvroute` console script: one subcommand per process kind or tool.

The table below is static: `kvroute --help` lists every subcommand without importing one, and
`kvroute NAME ...` imports only NAME's module, which exposes `add_arguments(parser)` and
`run(args) -> int`. So a router process loads nothing of the tools or the other planes. A tool
subcommand needs the `kvroute[tools]` extra; without it, it says in one line what to install
(exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from kvroute.config import EffectiveConfig

DISTRIBUTION = "kvroute"
EXIT_USAGE = 2
EXIT_READER_GONE = 128 + signal.SIGPIPE  # what a shell reports for a program that SIGPIPE ended


class CommandParser(argparse.ArgumentParser):
    """argparse with a usage error as one line, `kvroute router: error: argument --port: ...` (exit 2):
    the usage text it would print first is what --help shows, and it buried the line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Subcommand:
    module: str
    help: str
    extra: str = ""  # the optional-dependency group it needs beyond the runtime dependencies
    configurable: bool = True  # reads --config FILE and KVROUTE_* (kvroute/config.py)


SUBCOMMANDS: dict[str, Subcommand] = {
    "control-plane": Subcommand(
        "kvroute.control_plane.cli", "run the control plane (global prefix index + worker registry, gRPC)"
    ),
    "agent": Subcommand("kvroute.worker_agent.cli", "run a worker agent: engine KV events -> control plane"),
    "router": Subcommand("kvroute.data_plane.cli", "run a stateless router (OpenAI-compatible HTTP + gRPC Route)"),
    "epp": Subcommand(
        "kvroute.data_plane.epp_cli",
        "run a Gateway API Inference Extension endpoint picker (Envoy ext_proc) on the router's decision",
        "epp",
    ),
    "sim-engine": Subcommand(
        "kvroute.tools.sim_engine.cli", "run a GPU-free vLLM stand-in (OpenAI API, real vLLM KV events)", "tools"
    ),
    "sim-dns": Subcommand(
        "kvroute.tools.sim_dns", "run a DNS server answering from a records file (a cluster DNS stand-in)", "tools"
    ),
    "tiny-model": Subcommand(
        "kvroute.tools.tiny_model", "write the demo's tiny local model (tokenizer + config) for --tokenizer", "tools"
    ),
    "audit": Subcommand(
        "kvroute.control_plane.audit_cli", "compare the control plane's block keys per worker with what each engine caches"
    ),
    "demo": Subcommand(
        "kvroute.tools.demo", "compare kv_aware with round_robin live: a local fleet per policy, all at once", "tools"
    ),
    "simulate": Subcommand(
        "kvroute.tools.simulator.cli", "simulate a fleet on a trace or generated workload under several policies", "tools"
    ),
    "bench": Subcommand(
        "kvroute.tools.bench.cli",
        "hot-path micro-benchmarks (ingest, decision, proxy) and the live workload bench (live)",
        "tools",
    ),
    "config": Subcommand(
        "kvroute.config_cli", "show a command's effective configuration (file, KVROUTE_* env, flags)", configurable=False
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: every subcommand with its help line (each one's own flags load with it)."""
    parser = CommandParser(prog="kvroute", description="KV-cache-aware routing for LLM inference fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def missing_requirements(extra: str) -> list[str]:
    """The distributions `extra` names that are not installed ([] when kvroute itself is not installed,
    e.g. run from a source tree: then an import error will say what is missing)."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requires:
        name, _, marker = requirement.partition(";")
        if not re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            continue
        project = re.match(r"[A-Za-z0-9._-]+", name.strip())
        try:
            metadata.version(project.group(0) if project else name.strip())
        except metadata.PackageNotFoundError:
            missing.append(name.strip())
    return missing


def command_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """NAME's own parser and module, importing only that module. Exits 2 when a tool's extra is missing."""
    command = SUBCOMMANDS[name]
    if command.extra and (missing := missing_requirements(command.extra)):
        print(
            f"kvroute {name}: error: needs the {command.extra} extra: pip install 'kvroute[{command.extra}]' "
            f"(missing: {', '.join(missing)})",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)
    module = importlib.import_module(command.module)
    # No abbreviations: `--port` must not quietly mean `--port-file` to a command without `--port`.
    parser = CommandParser(
        prog=f"kvroute {name}",
        description=command.help,
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.add_arguments(parser)
    return parser, module


def _known_to_another_command(key: str) -> bool:
    """Whether any configurable command has `key` (a config file's [common] table may hold it); a command
    whose extra is not installed is skipped. Imports the other modules: only reached for such a key."""
    for name, command in SUBCOMMANDS.items():
        if not command.configurable or (command.extra and missing_requirements(command.extra)):
            continue
        from kvroute.config import has_key

        if has_key(command_parser(name)[0], key):
            return True
    return False


def parse_configured(
    name: str, argv: Sequence[str], allow_missing: bool = False, warn_environment: bool = True
) -> tuple[argparse.Namespace, EffectiveConfig]:
    """NAME's arguments from flags over KVROUTE_* environment over its --config file (kvroute/config.py)."""
    from kvroute import config  # loaded with a command, not for `kvroute --help`

    parser, module = command_parser(name)
    args, effective = config.parse_args(
        name,
        parser,
        argv,
        os.environ,
        known_elsewhere=_known_to_another_command,
        commands=[n for n, c in SUBCOMMANDS.items() if c.configurable],
        allow_missing=allow_missing,
        validate=getattr(module, "validate", None),
        warn_environment=warn_environment,
    )
    args.command, args._run = name, module.run
    return args, effective


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`kvroute ARGV`, importing only the named subcommand's module; `args._run` is its `run`.
    Exits (argparse's way) on --help, on a usage error and when a tool's extra is missing."""
    argv = list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints the help, or says what is wrong
        raise SystemExit(EXIT_USAGE)  # not reached: a bare flag or an unknown name is an error there
    name = argv[0]
    if SUBCOMMANDS[name].configurable:
        return parse_configured(name, argv[1:])[0]
    parser, module = command_parser(name)
    args = parser.parse_args(argv[1:])
    args.command, args._run = name, module.run
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Every command's entry: a reader of stdout that goes away (`kvroute audit | head -5`) ends the
    command quietly with EXIT_READER_GONE, whether it was printing help, a table or its last line."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # inside the try: buffered output meets a closed pipe here, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Python's own flush at exit would fail again and print a traceback: point stdout at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
