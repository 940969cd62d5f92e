"""One configuration (kvroute/config.py): --config FILE (TOML), KVROUTE_* environment, flags; flag >
env > file > default; bad keys and values fail at start naming them; `kvroute config show COMMAND`."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute import cli
from kvroute import config as kvroute_config
from kvroute.tools.local_cluster import ManagedProcess, free_port, http_get, http_ok, kvroute_argv, wait_until


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def kvroute(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(kvroute_config.ENV_PREFIX)}
    return subprocess.run(
        kvroute_argv(*argv), check=False, capture_output=True, text=True, timeout=60, env={**clean, **(env or {})}
    )


@pytest.fixture(autouse=True)
def no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own KVROUTE_* settings must not leak into what these tests expect."""
    for name in list(os.environ):
        if name.startswith(kvroute_config.ENV_PREFIX):
            monkeypatch.delenv(name)


def test_flag_over_env_over_file_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(
        tmp_path / "kvroute.toml",
        """
[common]
log_level = "WARNING"
[control-plane]
listen = "0.0.0.0:6000"
heartbeat_timeout = 7.5
speculative_ttl_ms = 100
audit_probe = true
""",
    )
    monkeypatch.setenv("KVROUTE_HEARTBEAT_TIMEOUT", "9")
    monkeypatch.setenv("KVROUTE_SPECULATIVE_TTL_MS", "200")
    args, effective = cli.parse_configured("control-plane", ["--config", str(config), "--speculative-ttl-ms", "300"])
    assert (args.listen, args.heartbeat_timeout, args.speculative_ttl_ms) == ("0.0.0.0:6000", 9.0, 300)
    assert (args.audit_probe, args.log_level, args.redis_shards) == (True, "WARNING", 16)
    sources = {key: s.source for key, s in effective.by_key().items()}
    assert sources["listen"] == f"file {config} [control-plane]"
    assert sources["log_level"] == f"file {config} [common]"
    assert sources["heartbeat_timeout"] == "env KVROUTE_HEARTBEAT_TIMEOUT"
    assert sources["speculative_ttl_ms"] == "flag"
    assert sources["redis_shards"] == "default"
    # The command's own table beats [common]; a flag beats both. Abbreviations are refused: a new
    # flag (`--port-file` beside `--port`) must not change what an old command line means.
    write(config, '[common]\nlog_level = "WARNING"\n[control-plane]\nlog_level = "ERROR"\n')
    assert cli.parse_configured("control-plane", ["--config", str(config)])[0].log_level == "ERROR"
    assert cli.parse_configured("control-plane", [f"--config={config}", "--log-level", "DEBUG"])[0].log_level == "DEBUG"
    with pytest.raises(SystemExit):
        cli.parse_configured("control-plane", [f"--config={config}", "--log-l", "DEBUG"])


def test_file_and_env_satisfy_required_flags_and_lists_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(
        tmp_path / "k.toml",
        '[router]\ntokenizer = "/models/tiny"\nkv_aware_param = ["queue_weight=1", "decode_weight=2"]\n'
        '[common]\nlisten = "ignored: a control-plane key"\n',
    )
    args = cli.parse_configured("router", ["--config", str(config)])[0]
    assert (args.tokenizer, args.kv_aware_param) == ("/models/tiny", ["queue_weight=1", "decode_weight=2"])
    monkeypatch.setenv("KVROUTE_KV_AWARE_PARAM", "temperature=3, load_bound=4")
    assert cli.parse_configured("router", ["--config", str(config)])[0].kv_aware_param == ["temperature=3", "load_bound=4"]
    # Repeated flags replace the lower layers' list rather than extending it.
    assert cli.parse_configured("router", ["--config", str(config), "--kv-aware-param", "recompute_weight=5"])[
        0
    ].kv_aware_param == ["recompute_weight=5"]
    monkeypatch.setenv("KVROUTE_NO_ROUTER_SESSION", "yes")
    assert cli.parse_configured("router", ["--config", str(config)])[0].no_router_session is True


def test_kvroute_config_names_the_file_when_no_flag_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write(tmp_path / "a.toml", "[control-plane]\nredis_shards = 5\n")
    second = write(tmp_path / "b.toml", "[control-plane]\nredis_shards = 6\n")
    monkeypatch.setenv("KVROUTE_CONFIG", str(first))
    assert cli.parse_configured("control-plane", [])[0].redis_shards == 5
    assert cli.parse_configured("control-plane", ["--config", str(second)])[0].redis_shards == 6


def test_a_config_directory_reads_its_toml_files_in_name_order(tmp_path: Path) -> None:
    """How a Kubernetes overlay adds to the base's configuration: one more file in the ConfigMap."""
    (tmp_path / "conf").mkdir()
    write(tmp_path / "conf" / "10-base.toml", '[control-plane]\nlisten = "0.0.0.0:50051"\nredis_shards = 4\n')
    write(tmp_path / "conf" / "20-ha.toml", '[control-plane]\nredis = "redis://kvroute-redis:6390"\nredis_shards = 8\n')
    write(tmp_path / "conf" / "notes.txt", "not read")
    args, effective = cli.parse_configured("control-plane", ["--config", str(tmp_path / "conf")])
    assert (args.listen, args.redis, args.redis_shards) == ("0.0.0.0:50051", "redis://kvroute-redis:6390", 8)
    assert effective.by_key()["listen"].source == f"file {tmp_path / 'conf' / '10-base.toml'} [control-plane]"
    assert effective.by_key()["redis_shards"].source == f"file {tmp_path / 'conf' / '20-ha.toml'} [control-plane]"
    write(tmp_path / "conf" / "30-bad.toml", "[control-plane]\nlisen = 1\n")
    result = kvroute("control-plane", "--config", str(tmp_path / "conf"))
    assert result.returncode == 2 and "30-bad.toml [control-plane]: unknown key 'lisen'" in result.stderr
    (tmp_path / "empty").mkdir()
    result = kvroute("control-plane", "--config", str(tmp_path / "empty"))
    assert result.returncode == 2 and "holds no *.toml file" in result.stderr


def test_a_mutually_exclusive_flag_beats_its_partner_from_the_file(tmp_path: Path) -> None:
    config = write(tmp_path / "k.toml", '[simulate]\ntrace = "t.jsonl"\n')
    args = cli.parse_configured("simulate", ["--config", str(config), "--workload", "rag"])[0]
    assert (args.trace, args.workload) == (None, "rag")
    assert cli.parse_configured("simulate", ["--config", str(config)])[0].trace == "t.jsonl"


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("[router]\nprot = 1\n", {}, "[router]: unknown key 'prot' (did you mean 'port'?)"),
        ("[common]\nlisen = 'x'\n", {}, "[common]: unknown key 'lisen'"),
        ("[routr]\nport = 1\n", {}, "unknown table 'routr' (did you mean 'router'?)"),
        ("[router]\nport = 'http'\n", {}, "[router] port: port 'http' is not a number"),
        ("[router]\nport = 70000\n", {}, "[router] port: port 70000 is out of range (0..65535)"),
        ("[router]\nkv_aware_param = ['load_bund=1.5']\n", {}, "[router] kv_aware_param: 'load_bund=1.5': expected NAME=VALUE"),
        (
            "[router]\ncontrol_plane = '127.0.0.1:500051'\n",
            {},
            "[router] control_plane: port 500051 in '127.0.0.1:500051' is out of range (1..65535)",
        ),
        ("[router]\npolicy = 'fastest'\n", {}, "[router] policy: invalid choice: 'fastest'"),
        ("[router]\nstage_timing = 'maybe'\n", {}, "[router] stage_timing: expected true or false"),
        ("[router]\nport = true\n", {}, "[router] port: --port takes a value, not true/false"),
        ("[router]\nport = 1\n", {"KVROUTE_PORT": "eighty"}, "environment KVROUTE_PORT: port 'eighty' is not a number"),
        (
            "[router]\nport = 1\n",
            {"KVROUTE_CONTROL_PLANE": "http://127.0.0.1:50051"},
            "environment KVROUTE_CONTROL_PLANE: 'http://127.0.0.1:50051' is a URL: give HOST:PORT (no scheme)",
        ),
        ("[router]\nport = 1\n", {"KVROUTE_CAPTURE_SAMPLE_RATE": "2"}, "environment KVROUTE_CAPTURE_SAMPLE_RATE:"),
        ("[router\n", {}, "not valid TOML"),
    ],
)
def test_a_bad_key_or_value_fails_at_start_naming_it(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    config = write(tmp_path / "bad.toml", toml)
    result = kvroute("router", "--config", str(config), "--tokenizer", str(tmp_path), env=env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no usage wall
    if not env:
        assert str(config) in result.stderr


def test_a_missing_config_file_and_a_bad_control_plane_value_fail_at_start(tmp_path: Path) -> None:
    result = kvroute("control-plane", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and "nope.toml: cannot read" in result.stderr
    config = write(tmp_path / "k.toml", '[control-plane]\nredis = "http://cache:6390"\n')
    result = kvroute("control-plane", "--config", str(config))
    assert result.returncode == 2 and "[control-plane] redis: scheme must be one of" in result.stderr


# What each command needs so that its `config show` has everything required (a command not listed needs nothing).
SHOW_ARGS: dict[str, list[str]] = {
    "control-plane": [],
    "agent": [],
    "router": [],
    "sim-engine": [],
    "tiny-model": ["model-dir"],
    "audit": [],
    "demo": [],
    "simulate": ["--workload", "rag"],
    "bench": ["live"],
    "epp": ["--tokenizer", "/models/tiny"],
    "sim-dns": ["--records", "records.txt"],
}
# One value per command that differs from its default: `config show` must report it as the file's
# (tiny-model has no flag, only its directory argument).
FILE_VALUES = {
    "control-plane": ("redis_shards", 3),
    "agent": ("engine", "sglang"),
    "router": ("port", 9999),
    "sim-engine": ("num_blocks", 77),
    "audit": ("concurrency", 3),
    "demo": ("engines", 3),
    "simulate": ("workers", 3),
    "bench": ("engines", 3),
}


def test_every_command_has_a_config_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commands = [n for n, c in cli.SUBCOMMANDS.items() if c.configurable]
    assert set(SHOW_ARGS) <= set(commands) and len(commands) >= len(SHOW_ARGS)
    config = write(
        tmp_path / "all.toml",
        """
[common]
log_level = "DEBUG"
control_plane = "cp.example:50051"
[control-plane]
redis_shards = 3
[agent]
engine = "sglang"
[router]
port = 9999
tokenizer = "/models/tiny"
[sim-engine]
num_blocks = 77
tokenizer = "/models/tiny"
[audit]
concurrency = 3
[demo]
engines = 3
[simulate]
workers = 3
[bench.live]
engines = 3
""",
    )
    for name in commands:  # a command added later is shown with no argument: it must start from defaults
        extra = SHOW_ARGS.get(name, [])
        assert cli.main(["config", "show", name, "--config", str(config), *extra]) == 0, name
        out = capsys.readouterr().out
        shown = tomllib.loads(out)  # what it prints is a config file again
        table = shown[name] if name != "bench" else shown["bench"]["live"]
        if name in FILE_VALUES:
            key, value = FILE_VALUES[name]
            assert table[key] == value, (name, out)
            assert f"# file {config} [{name}{'.live' if name == 'bench' else ''}]" in next(
                line for line in out.splitlines() if line.startswith(key + " ")
            ), out
        if "control_plane" in table:
            assert table["control_plane"] == "cp.example:50051"
    # Nothing given: the required flag is named, exit 2.
    assert cli.main(["config", "show", "router"]) == 2
    assert "--tokenizer required" in capsys.readouterr().err


def test_config_show_lists_flags_and_env_as_their_sources(tmp_path: Path) -> None:
    result = kvroute(
        "config",
        "show",
        "agent",
        "--worker-id",
        "w7",
        env={"KVROUTE_ENGINE_URL": "http://e:8000", "KVROUTE_REDIS": "not an agent key"},
    )
    assert result.returncode == 0, result.stderr
    lines = {line.split("=")[0].strip(): line for line in result.stdout.splitlines() if "=" in line}
    assert lines["worker_id"].endswith("# flag")
    assert '"http://e:8000"' in lines["engine_url"] and lines["engine_url"].endswith("# env KVROUTE_ENGINE_URL")
    shown = kvroute("config", "show", "control-plane", "--redis", "redis://:hunter2@cache:6390/0").stdout
    assert "hunter2" not in shown and "redis://:***@cache:6390/0" in shown


def test_help_still_shows_the_parsers_defaults() -> None:
    """The layer's first look at the command line suppresses defaults; --help must not print that look."""
    for argv in (["router", "--help"], ["bench", "live", "--help"]):
        result = kvroute(*argv)
        assert result.returncode == 0 and "(default: " in result.stdout and "SUPPRESS" not in result.stdout, argv
        assert "--config FILE" in result.stdout


def test_no_flag_takes_a_reserved_environment_name() -> None:
    """KVROUTE_CACHE and the vLLM test variables belong to scripts; a flag with that dest would read them."""
    for name, command in cli.SUBCOMMANDS.items():
        if command.configurable:
            parser = cli.command_parser(name)[0]
            for p in kvroute_config._all_parsers(parser):
                for action in kvroute_config.configurable_actions(p):
                    assert kvroute_config.env_name(action.dest) not in kvroute_config.RESERVED_ENV, (name, action.dest)


@pytest.mark.e2e
async def test_a_control_plane_and_a_router_start_from_the_config_file_alone(tmp_path: Path, tiny_model_dir: Path) -> None:
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    config = write(
        tmp_path / "kvroute.toml",
        f"""
[common]
log_level = "INFO"
control_plane = "127.0.0.1:{grpc_port}"
[control-plane]
listen = "127.0.0.1:{grpc_port}"
metrics_port = {metrics_port}
heartbeat_timeout = 3.0
[router]
tokenizer = "{tiny_model_dir}"
port = {http_port}
grpc_port = "off"
""",
    )
    procs = [
        ManagedProcess(name, kvroute_argv(name, "--config", str(config)), tmp_path / f"{name}.log")
        for name in ("control-plane", "router")
    ]
    try:
        for proc in procs:
            proc.start()
        wait_until(lambda: http_ok(f"http://127.0.0.1:{metrics_port}/health"), 30, "control plane /health", procs)
        wait_until(lambda: http_ok(f"http://127.0.0.1:{http_port}/health"), 60, "router /health", procs)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        wait_until(
            lambda: json.loads(http_get(f"http://127.0.0.1:{http_port}/health")[1])["control_plane"] == "reachable",
            30,
            "the router reaching the control plane named in [common]",
            procs,
        )
    finally:
        for proc in procs:
            proc.stop()


def test_config_check_validates_every_table_a_file_holds(tmp_path: Path) -> None:
    good = write(
        tmp_path / "good.toml",
        '[common]\ncontrol_plane = "cp:50051"\n[router]\nport = 8081\n[agent]\nengine = "sglang"\n[bench.live]\nengines = 2\n',
    )
    result = kvroute("config", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["router: ok", "agent: ok", "bench live: ok"]
    # A bad value in a table other than the one a process would read is caught too, named with its key.
    bad = write(tmp_path / "bad.toml", '[router]\nport = 8081\n[agent]\nengine = "tgi"\n')
    result = kvroute("config", "check", str(bad))
    assert result.returncode == 2
    assert "[agent] engine: engine 'tgi' is not supported" in result.stderr and "router: ok" in result.stdout
    result = kvroute("config", "check", str(write(tmp_path / "typo.toml", "[agnet]\nengine = 'vllm'\n")))
    assert result.returncode == 2 and "unknown table 'agnet' (did you mean 'agent'?)" in result.stderr
