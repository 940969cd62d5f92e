"""One configuration for every command: a TOML file, `KVROUTE_*` environment variables and flags.

A generic layer over each subcommand's own argparse parser, so a flag added there is configurable with
no edit here: an optional flag's dest is its key (`--control-plane` -> `control_plane` in the file,
`KVROUTE_CONTROL_PLANE` in the environment). Precedence: flag > environment > file > the parser's
default. File and environment values go through the flag's own type, choices and action, so a bad one
fails at start (exit 2) naming the key and where it came from, as a bad flag does.

The file (`--config FILE`, or a directory of `*.toml` files read in name order) holds a table per command (`[router]`, `[control-plane]`, `[agent]`, ...; a
command with sub-commands nests them: `[bench.live]`) and an optional `[common]` table whose keys apply
to every command that has them (`log_level`, `control_plane`). A key no command knows is an error.
In the environment, a list flag (`--kv-aware-param`, repeated) takes comma-separated values and a switch
(`--audit-probe`) takes true/false/1/0/yes/no/on/off.

The `kvroute config` command (show, check) is `config_cli.py`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVROUTE_"
COMMON_SECTION = "common"
CONFIG_DEST = "config"
# Environment variables of the project's scripts and tests, not settings of a command: no flag may take
# their name (tests/test_config.py checks), or setting one would silently configure a command too.
RESERVED_ENV = frozenset({"KVROUTE_CACHE", "KVROUTE_VLLM_PYTHON", "KVROUTE_VLLM_PACKAGE", "KVROUTE_VLLM_VENV"})
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
_LISTS = (argparse._AppendAction, argparse._ExtendAction)


class ConfigError(Exception):
    """A configuration value or key that cannot be used; the message names the key and its source."""


@dataclass(frozen=True)
class Setting:
    key: str  # the flag's dest, as written in the file
    value: Any
    source: str  # "flag", "env KVROUTE_X", "file PATH [section]", "default"
    flag: str  # the flag's first long option string, for messages and `config show`
    required_missing: bool = False


@dataclass
class EffectiveConfig:
    command: str  # "router", "bench live"
    settings: list[Setting] = field(default_factory=list)

    def by_key(self) -> dict[str, Setting]:
        return {s.key: s for s in self.settings}


@dataclass(frozen=True)
class _Candidate:
    value: Any
    source: str


# ---------------------------------------------------------------------------------------------- parsers


def _parser_chain(parser: argparse.ArgumentParser, chosen: argparse.Namespace) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser and, for a command with sub-commands, the chosen sub-parser(s): [(name, parser), ...]."""
    chain: list[tuple[str, argparse.ArgumentParser]] = [("", parser)]
    while True:
        sub = next((a for a in chain[-1][1]._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(chosen, sub.dest, None) if sub is not None and sub.dest != argparse.SUPPRESS else None
        if sub is None or name not in sub.choices:
            return chain
        chain.append((name, sub.choices[name]))


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser once
                yield from _all_parsers(sub)


def configurable_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The optional flags a file or the environment may set (not --help, --config, positionals)."""
    return [
        a
        for a in parser._actions
        if a.option_strings
        and a.dest not in (argparse.SUPPRESS, "help", CONFIG_DEST)
        and not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
    ]


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _flag(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` on the parser and every sub-parser (so it may follow a sub-command's name)."""
    for p in _all_parsers(parser):
        if not any(a.dest == CONFIG_DEST for a in p._actions):
            p.add_argument(
                "--config",
                dest=CONFIG_DEST,
                metavar="FILE",
                default=None,
                help="TOML file (or a directory of *.toml files, read in name order; or KVROUTE_CONFIG) with a table per "
                "command ([router], [agent], ...) and [common]; "
                "flags override KVROUTE_* environment variables, which override the file",
            )


class _HelpRequested(Exception):
    """--help during the look at the command line: help is printed by the real parse, with the defaults."""


def _raise_help_requested(*_args: Any, **_kwargs: Any) -> None:
    raise _HelpRequested


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | None:
    """Parse `argv` with every default suppressed and nothing required: what is set was given as a flag.
    A malformed command line fails here with argparse's own message (exit 2); None when it asks for --help."""
    saved: list[tuple[Any, str, Any]] = []
    for p in _all_parsers(parser):
        saved.append((p, "print_help", None))  # an instance attribute over the method, removed below
        p.print_help = _raise_help_requested  # type: ignore[method-assign]
        for action in p._actions:
            saved += [(action, "default", action.default), (action, "required", action.required)]
            action.default, action.required = argparse.SUPPRESS, False
        for group in p._mutually_exclusive_groups:
            saved.append((group, "required", group.required))
            group.required = False
        saved.append((p, "_defaults", p._defaults))
        p._defaults = {}
    try:
        return parser.parse_args(list(argv))
    except _HelpRequested:
        return None
    finally:
        for obj, attr, value in saved:
            if attr == "print_help":
                del obj.print_help
            else:
                setattr(obj, attr, value)


# ------------------------------------------------------------------------------------------- conversion


def _convert_one(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(raw, (bool, dict, list)):
        raise ConfigError(f"{where}: expected a single value for {_flag(action)}, got {json.dumps(raw)}")
    if isinstance(raw, float) and not math.isfinite(raw):
        raise ConfigError(f"{where}: {raw} is not a usable value")
    text = str(raw)
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        kind = getattr(convert, "__name__", repr(convert))
        raise ConfigError(f"{where}: invalid {kind} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ConfigError(f"{where}: invalid choice: {value!r} (choose from {choices})")
    return value


def _parse_bool(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {json.dumps(raw)}")


def convert_value(action: argparse.Action, raw: Any, where: str, *, from_env: bool) -> Any:
    """`raw` (a TOML value, or an environment string) as the value the flag would have stored."""
    if isinstance(action, _SWITCHES):
        on = _parse_bool(raw, where)
        if isinstance(action, argparse._StoreFalseAction):
            return action.const if not on else action.default  # the dest's meaning is inverted: key = the value
        return on if isinstance(action, argparse.BooleanOptionalAction) else (action.const if on else action.default)
    if isinstance(action, argparse._StoreConstAction):
        return action.const if _parse_bool(raw, where) else action.default
    if isinstance(action, argparse._CountAction):
        if isinstance(raw, bool) or not str(raw).strip().isdigit():
            raise ConfigError(f"{where}: expected a count (0, 1, 2, ...), got {json.dumps(raw)}")
        return int(str(raw).strip())
    many = isinstance(action, _LISTS) or action.nargs in ("*", "+") or isinstance(action.nargs, int)
    if many:
        if from_env:
            items = [part.strip() for part in str(raw).split(",") if part.strip()]
        else:
            items = raw if isinstance(raw, list) else [raw]
        values = [_convert_one(action, item, where) for item in items]
        if isinstance(action, argparse._AppendAction) and action.nargs not in (None, "?"):
            raise ConfigError(f"{where}: {_flag(action)} takes several values per use; set it with flags")
        return values
    if not from_env and isinstance(raw, bool):
        raise ConfigError(f"{where}: {_flag(action)} takes a value, not true/false")
    return _convert_one(action, raw, where)


# ----------------------------------------------------------------------------------------------- layers


def config_files(path: str) -> list[str]:
    """`--config` names a file, or a directory whose `*.toml` files are read in name order, a later
    one's keys over an earlier one's (a Kubernetes ConfigMap mounted as a directory: an overlay or
    component adds a file instead of rewriting the base's)."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, name) for name in os.listdir(path) if name.endswith(".toml") and not name.startswith(".")
        )
        if not files:
            raise ConfigError(f"--config {path}: the directory holds no *.toml file")
        return files
    return [path]


def load_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None


def unknown_key(key: str, known: Sequence[str], where: str, what: str = "key") -> ConfigError:
    close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown {what} {key!r}{hint}")


def file_candidates(
    data: Mapping[str, Any],
    path: str,
    command: str,
    chain: Sequence[tuple[str, argparse.ArgumentParser]],
    known_elsewhere: Callable[[str], bool] | None,
    commands: Sequence[str],
) -> dict[str, _Candidate]:
    """The file's values for this command: [common] first, then the command's own table (which wins)."""
    for section in data:
        if section != COMMON_SECTION and section not in commands:
            raise unknown_key(section, [COMMON_SECTION, *commands], f"--config {path}", "table")
        if not isinstance(data[section], dict):
            raise ConfigError(f"--config {path}: {section!r} must be a table ([{section}]), not a value")
    actions = {a.dest: a for _, p in chain for a in configurable_actions(p)}
    out: dict[str, _Candidate] = {}
    common = data.get(COMMON_SECTION, {})
    for key, raw in common.items():
        where = f"--config {path} [{COMMON_SECTION}] {key}"
        if key in actions:
            out[key] = _Candidate(convert_value(actions[key], raw, where, from_env=False), f"file {path} [{COMMON_SECTION}]")
        elif known_elsewhere is None or not known_elsewhere(key):  # [common] may hold other commands' keys
            raise unknown_key(key, sorted(actions), f"--config {path} [{COMMON_SECTION}]")
    table: Any = data.get(command, {})
    section = command
    for depth, (name, parser) in enumerate(chain):
        if depth:
            table = table.get(name, {}) if isinstance(table, dict) else {}
            section = f"{section}.{name}"
        own = {a.dest: a for a in configurable_actions(parser)}
        subs = {n for a in parser._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices}
        for key, raw in table.items():
            where = f"--config {path} [{section}] {key}"
            if key in own:
                out[key] = _Candidate(convert_value(own[key], raw, where, from_env=False), f"file {path} [{section}]")
            elif key in subs and isinstance(raw, dict):
                continue  # a nested table for a sub-command: read when that one runs
            else:
                raise unknown_key(key, sorted(own) + sorted(subs), f"--config {path} [{section}]")
    return out


def env_candidates(environ: Mapping[str, str], chain: Sequence[tuple[str, argparse.ArgumentParser]]) -> dict[str, _Candidate]:
    out: dict[str, _Candidate] = {}
    for _, parser in chain:
        for action in configurable_actions(parser):
            name = env_name(action.dest)
            if name in environ:
                out[action.dest] = _Candidate(
                    convert_value(action, environ[name], f"environment {name}", from_env=True), f"env {name}"
                )
    return out


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    """One line, exit 2: the usage text argparse would add says nothing about a file or variable."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(
    command: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    known_elsewhere: Callable[[str], bool] | None = None,
    commands: Sequence[str] = (),
    allow_missing: bool = False,
    validate: Callable[[argparse.Namespace], None] | None = None,
    warn_environment: bool = True,
) -> tuple[argparse.Namespace, EffectiveConfig]:
    """Parse `argv` for `command` with its file and environment layers under the flags.

    `known_elsewhere(key)` says whether another command has a key ([common] may hold keys for others);
    `commands` lists the table names the file may hold. `validate(args)`: the command's checks of flags
    that only fail together, raising ValueError naming them (`--http-tls needs --tls-cert`). Exits 2
    with one line on any bad input, naming where each value came from, unless `allow_missing` (for
    `config show` and `config check`): then a required flag that nobody set is reported, not fatal.
    A KVROUTE_* variable that no command has is warned about (one line each; `warn_environment` False:
    not again, for a caller that parses several commands in one process).
    """
    environ = os.environ if environ is None else environ
    add_config_flag(parser)
    given = _given_on_command_line(parser, argv)
    if given is None:
        parser.parse_args(list(argv))  # prints the help with the parser's own defaults, and exits
        raise SystemExit(0)
    chain = _parser_chain(parser, given)
    config_path = getattr(given, CONFIG_DEST, None) or environ.get(env_name(CONFIG_DEST)) or None
    try:
        layered: dict[str, _Candidate] = {}
        for path in config_files(config_path) if config_path else ():
            layered.update(file_candidates(load_file(path), path, command, chain, known_elsewhere, commands or (command,)))
        layered.update(env_candidates(environ, chain))
    except ConfigError as exc:
        _fail(chain[-1][1], str(exc))
    from_layers = {dest: c for dest, c in layered.items() if not hasattr(given, dest)}

    # Whatever the file or environment sets is no longer required on the command line; and a
    # mutually exclusive partner given as a flag wins over the file's or environment's choice.
    saved: list[tuple[Any, Any]] = []
    actions = {a.dest: a for _, p in chain for a in configurable_actions(p)}
    for _, p in chain:
        for group in p._mutually_exclusive_groups:
            members = [a.dest for a in group._group_actions]
            if any(hasattr(given, d) for d in members):
                for d in members:
                    from_layers.pop(d, None)
            layered_members = [d for d in members if d in from_layers]
            if len(layered_members) > 1:
                _fail(
                    p,
                    f"{' and '.join(_flag(actions[d]) for d in layered_members)} are mutually exclusive "
                    f"(set by {', '.join(from_layers[d].source for d in layered_members)})",
                )
            if layered_members or allow_missing:
                saved.append((group, group.required))
                group.required = False
        for action in configurable_actions(p):
            if action.required and (action.dest in from_layers or allow_missing):
                saved.append((action, action.required))
                action.required = False
    try:
        args = parser.parse_args(list(argv))
    finally:
        for obj, required in saved:
            obj.required = required
    for dest, candidate in from_layers.items():
        setattr(args, dest, candidate.value)

    effective = EffectiveConfig(" ".join([command, *(name for name, _ in chain[1:])]))
    for _, p in chain:
        for action in configurable_actions(p):
            if action.dest in given:
                source = "flag"
            elif action.dest in from_layers:
                source = from_layers[action.dest].source
            else:
                source = "default"
            missing = source == "default" and action.required
            effective.settings.append(Setting(action.dest, getattr(args, action.dest, None), source, _flag(action), missing))
    if warn_environment:
        warn_unknown_environment(chain[-1][1].prog, environ, chain, known_elsewhere)
    if validate is not None:
        try:
            validate(args)
        except ValueError as exc:
            _fail(chain[-1][1], with_sources(str(exc), effective))
    return args, effective


# Documented KVROUTE_* variables that are not a flag's: the config file's name, TLS files (tls.py) and API
# keys (data_plane/access/api_keys.py) read from the environment, and the project's scripts' own.
NOT_SETTINGS = RESERVED_ENV | {env_name(CONFIG_DEST), "KVROUTE_API_KEYS"}
NOT_SETTINGS_PREFIXES = ("KVROUTE_TLS_",)


def warn_unknown_environment(
    prog: str,
    environ: Mapping[str, str],
    chain: Sequence[tuple[str, argparse.ArgumentParser]],
    known_elsewhere: Callable[[str], bool] | None,
) -> None:
    """One line on stderr per KVROUTE_* variable no command reads (a typo is otherwise silently ignored)."""
    own = {env_name(a.dest) for _, p in chain for a in configurable_actions(p)}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in own or name in NOT_SETTINGS or name.startswith(NOT_SETTINGS_PREFIXES):
            continue
        key = name.removeprefix(ENV_PREFIX).lower()
        if known_elsewhere is not None and known_elsewhere(key):
            continue  # another command's setting, e.g. a shared environment for several processes
        # Compared without the prefix every name shares, which would make any two look alike.
        close = difflib.get_close_matches(key, sorted(n.removeprefix(ENV_PREFIX).lower() for n in own), n=1, cutoff=0.75)
        hint = f" (did you mean {env_name(close[0])}?)" if close else ""
        print(f"{prog}: warning: environment variable {name} is not a kvroute setting{hint}; ignored", file=sys.stderr)


_FLAG_IN_MESSAGE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def with_sources(message: str, effective: EffectiveConfig) -> str:
    """`message` followed by where each flag it names got its value, when not from the command line:
    `--kv-aware-param needs --policy kv_aware (--kv-aware-param from file k.toml [router]; --policy left at its
    default)`."""
    by_flag = {s.flag: s for s in effective.settings}
    notes = []
    for flag in dict.fromkeys(_FLAG_IN_MESSAGE.findall(message)):
        setting = by_flag.get(flag)
        if setting is not None and setting.source != "flag":
            notes.append(f"{flag} left at its default" if setting.source == "default" else f"{flag} from {setting.source}")
    return f"{message} ({'; '.join(notes)})" if notes else message


def has_key(parser: argparse.ArgumentParser, key: str) -> bool:
    """Whether `key` is a configurable flag's dest in `parser` or one of its sub-parsers."""
    return any(key == a.dest for p in _all_parsers(parser) for a in configurable_actions(p))
