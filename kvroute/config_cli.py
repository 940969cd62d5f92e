"""`kvroute config`: a command's effective configuration, and a config file checked before use.

    kvroute config show COMMAND [ARGS...]   # TOML with each value's source (flag > env > file > default)
    kvroute config check FILE               # every command table a file (or directory) holds, parsed as at start

`check` is a CI step for a fleet's configuration, or a ConfigMap before it is applied: exit 2 on the
first bad key or value. The layering itself (file, environment, flags) is `config.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from kvroute.config import COMMON_SECTION, ConfigError, EffectiveConfig, config_files, env_name, load_file, unknown_key


def _toml_value(value: Any) -> str | None:
    """A TOML literal for `value`; None when TOML cannot say it (unset)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value) if math.isfinite(value) else None
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_toml_value(v) for v in value]
        return None if any(i is None for i in items) else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return json.dumps(value if isinstance(value, str) else str(value))  # a JSON string is a TOML basic string


_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@/\s]+@")


def render(effective: EffectiveConfig) -> str:
    """The effective configuration as TOML a `--config` file could hold, each value's source alongside.
    A password inside a URL (`redis://:secret@host`) is printed as `***`."""
    table = effective.command.replace(" ", ".")
    lines = [f"# kvroute {effective.command}: effective configuration (flag > env > file > default)", f"[{table}]"]
    width = max((len(s.key) for s in effective.settings), default=0)
    for s in effective.settings:
        literal = _toml_value(s.value)
        literal = _URL_PASSWORD.sub(r"\1***@", literal) if literal is not None else None
        note = "REQUIRED, not set" if s.required_missing else s.source
        if literal is None:
            lines.append(f"# {s.key.ljust(width)} = (unset)  # {note}")
        else:
            lines.append(f"{s.key.ljust(width)} = {literal}  # {note}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser(
        "show",
        help="print a command's effective configuration (TOML) with each value's source",
        description="Parses COMMAND's flags, KVROUTE_* environment and --config file exactly as "
        "COMMAND would at start, then prints the result instead of running it.",
    )
    show.add_argument("target", metavar="COMMAND", help="the command whose configuration to show, e.g. router")
    show.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="COMMAND's own arguments (--config FILE, flags); for bench: the benchmark's name first",
    )
    check = sub.add_parser(
        "check",
        help="validate every table of a config file (or directory) against its command",
        description="Parses each command whose table the configuration holds (with the "
        "KVROUTE_* environment) as it would at start; exit 2 on the first bad key or value.",
    )
    check.add_argument("config", metavar="FILE", help="a TOML file or a directory of *.toml files")


def _commands_in(path: str) -> list[list[str]]:
    """The command lines whose tables `path` holds: ["router"], ["bench", "live"] for [bench.live]."""
    tables: dict[str, Any] = {}
    for file in config_files(path):
        for name, table in load_file(file).items():
            if name != COMMON_SECTION and isinstance(table, dict):
                nested = tables.setdefault(name, set())
                nested.update(k for k, v in table.items() if isinstance(v, dict))
    return [[name, *([sub] if sub else [])] for name in tables for sub in (sorted(tables[name]) or [""])]


def check(path: str) -> int:
    from kvroute import cli

    try:
        command_lines = _commands_in(path)
    except ConfigError as exc:
        print(f"kvroute config check: error: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    for i, line in enumerate(command_lines or [[n] for n, c in cli.SUBCOMMANDS.items() if c.configurable and not c.extra]):
        configurable = [n for n, c in cli.SUBCOMMANDS.items() if c.configurable]
        if line[0] not in configurable:
            print(
                f"kvroute config check: error: {unknown_key(line[0], [COMMON_SECTION, *configurable], f'--config {path}', 'table')}",
                file=sys.stderr,
            )
            return cli.EXIT_USAGE
        cli.parse_configured(
            line[0],
            [*line[1:], "--config", path],
            allow_missing=True,  # exits 2 naming what is bad
            warn_environment=i == 0,
        )
        print(f"{' '.join(line)}: ok")
    return 0


def run(args: argparse.Namespace) -> int:
    from kvroute import cli  # the dispatcher owns the command table; imported here, not at module load

    if args.action == "check":
        return check(args.config)
    if args.target not in cli.SUBCOMMANDS or not cli.SUBCOMMANDS[args.target].configurable:
        configurable = [n for n, c in cli.SUBCOMMANDS.items() if c.configurable]
        print(
            f"kvroute config show: error: unknown command {args.target!r} (choose from {', '.join(configurable)})",
            file=sys.stderr,
        )
        return cli.EXIT_USAGE
    _, effective = cli.parse_configured(args.target, args.rest, allow_missing=True)
    sys.stdout.write(render(effective))
    missing = [s for s in effective.settings if s.required_missing]
    if missing:
        print(
            f"kvroute config show: {args.target} would not start: "
            f"{', '.join(s.flag for s in missing)} required (flag, {', '.join(env_name(s.key) for s in missing)} "
            f"or the file's [{args.target}] table)",
            file=sys.stderr,
        )
        return cli.EXIT_USAGE
    return 0
