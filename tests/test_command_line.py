"""The command line's edges: every address flag parsed strictly at start, list-valued flags checked before
any work, one line and exit 2 for a usage error, no traceback when stdout's reader goes away, and
`kvroute config check` refusing what start would refuse, naming where the value came from."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from kvroute import addresses, cli
from kvroute import config as kvroute_config
from kvroute.tools.local_cluster import kvroute_argv

EXIT_READER_GONE = 141


def kvroute(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(kvroute_config.ENV_PREFIX)}
    return subprocess.run(
        kvroute_argv(*argv), check=False, capture_output=True, text=True, timeout=timeout, env={**clean, **(env or {})}
    )


# A flag whose dest ends like this takes an address (a host, a port, a URL, an endpoint...).
ADDRESS_DEST = re.compile(r"(^|_)(port|host|url|urls|listen|endpoint|control_plane|redis|static_workers|kv_events)$")


def test_every_address_flag_of_every_command_has_a_parser_from_kvroute_addresses() -> None:
    """A new address flag without one would take `127.0.0.1:500051` and fail (or not) much later."""
    seen = set()
    for name, command in cli.SUBCOMMANDS.items():
        if not command.configurable:
            continue
        for parser in kvroute_config._all_parsers(cli.command_parser(name)[0]):
            for action in kvroute_config.configurable_actions(parser):
                if ADDRESS_DEST.search(action.dest) and not action.dest.startswith("taskset_"):  # CPU lists
                    seen.add(action.dest)
                    assert getattr(action.type, "__module__", None) == addresses.__name__, (name, action.dest)
    assert {
        "control_plane",
        "listen",
        "host",
        "port",
        "grpc_port",
        "metrics_port",
        "metrics_host",
        "engine_url",
        "kv_events",
        "replay_endpoint",
        "static_workers",
        "redis",
        "router_url",
        "engine_urls",
    } <= seen


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["router", "--tokenizer", "t", "--control-plane", "127.0.0.1:500051"],
            "argument --control-plane: port 500051 in '127.0.0.1:500051' is out of range (1..65535)",
        ),
        (
            ["router", "--tokenizer", "t", "--control-plane", "http://127.0.0.1:50051"],
            "argument --control-plane: 'http://127.0.0.1:50051' is a URL: give HOST:PORT (no scheme)",
        ),
        (["router", "--tokenizer", "t", "--control-plane", "127.0.0.1"], "argument --control-plane: no port in '127.0.0.1'"),
        (
            ["router", "--tokenizer", "t", "--control-plane", "a:1,127.0.0.256:2"],
            "argument --control-plane: '127.0.0.256' in '127.0.0.256:2' is not an IPv4 address",
        ),
        (["router", "--tokenizer", "t", "--port", "70000"], "argument --port: port 70000 is out of range (0..65535)"),
        (["router", "--tokenizer", "t", "--host", "127.0.0.1:8080"], "argument --host: '127.0.0.1:8080' is not a host"),
        (
            ["router", "--tokenizer", "t", "--static-workers", "w0=10.0.0.1:8000"],
            "argument --static-workers: '10.0.0.1:8000' is not an http:// or https:// URL",
        ),
        (
            ["router", "--tokenizer", "t", "--static-workers", "w0@=http://e"],
            "argument --static-workers: 'w0@=http://e' is not ID=URL or ID@MODEL=URL",
        ),
        (["epp", "--tokenizer", "t", "--metrics-port", "65536"], "argument --metrics-port: port 65536 is out of range"),
        (["control-plane", "--listen", "0.0.0.0"], "argument --listen: no port in '0.0.0.0'"),
        (["control-plane", "--metrics-host", "http://0.0.0.0"], "argument --metrics-host: 'http://0.0.0.0' is not a host"),
        (
            ["control-plane", "--redis", "redis://cache:99999"],
            "argument --redis: port 99999 in 'cache:99999' is out of range (1..65535)",
        ),
        (["agent", "--engine-url", "127.0.0.1:8000"], "argument --engine-url: '127.0.0.1:8000' is not an http:// or https://"),
        (["agent", "--engine-url", "http://127.0.0.1:80000"], "argument --engine-url: port 80000 in '127.0.0.1:80000'"),
        (["agent", "--kv-events", "tcp://127.0.0.1"], "argument --kv-events: no port in '127.0.0.1'"),
        (
            ["agent", "--replay-endpoint", "127.0.0.1:5558"],
            "argument --replay-endpoint: '127.0.0.1:5558' is not tcp://HOST:PORT, ipc://PATH or inproc://NAME",
        ),
        (["audit", "--control-plane", "127.0.0.1:0"], "argument --control-plane: port 0 in '127.0.0.1:0' is out of range"),
        (["sim-engine", "--tokenizer", "t", "--port", "-1"], "argument --port: port '-1' is not a number"),
        (["bench", "live", "--router-url", "localhost:8080"], "argument --router-url: 'localhost:8080' is not an http://"),
        (["bench", "live", "--engine-urls", "http://a:1,http://b:x"], "argument --engine-urls: port 'x' in 'b:x'"),
    ],
)
def test_a_bad_address_is_one_line_naming_the_flag_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err  # no usage wall


def test_good_addresses_of_every_form_pass_as_written() -> None:
    args = cli.parse_args(
        [
            "router",
            "--tokenizer",
            "t",
            "--control-plane",
            "cp-0.kvroute-cp:50051,[::1]:50051",
            "--host",
            "[::1]",
            "--port",
            "0",
            "--static-workers",
            "w0=http://10.0.0.1:8000/,w1@org/chat-1b=https://e",
        ]
    )
    assert (args.control_plane, args.host, args.port) == ("cp-0.kvroute-cp:50051,[::1]:50051", "::1", 0)
    assert addresses.parse_static_workers(args.static_workers) == {"w0": "http://10.0.0.1:8000", "w1": "https://e"}
    assert addresses.parse_static_fleet(args.static_workers) == {
        "w0": addresses.StaticWorker("http://10.0.0.1:8000", ""),  # the router's default model
        "w1": addresses.StaticWorker("https://e", "org/chat-1b"),
    }
    args = cli.parse_args(
        [
            "agent",
            "--kv-events",
            "tcp://*:5557",
            "--replay-endpoint",
            "ipc:///tmp/replay",
            "--engine-url",
            "http://[fd00::7]:8000",
        ]
    )
    assert (args.kv_events, args.replay_endpoint) == ("tcp://*:5557", "ipc:///tmp/replay")
    assert cli.parse_args(["control-plane", "--listen", "[::]:0", "--redis", "redis+sentinel://s1,s2:26380/m"]).listen == "[::]:0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["simulate", "--workload", "rag", "--policies", "kv_aware,foo"],
            "argument --policies: unknown policy 'foo' (choose from ",
        ),
        (["simulate", "--workload", "rag", "--policies", "kv_aware,kv_aware"], "names a policy twice"),
        (["simulate", "--workload", "rag", "--seeds", "1,x"], "argument --seeds: '1,x': expected comma-separated integers"),
        (["simulate", "--workload", "rag", "--kv-aware-param", "load_bund=1.5"], "(did you mean 'load_bound'?)"),
        (["simulate", "--workload", "rag", "--seeds", "1,2", "--plots", "p"], "--plots draws one seed's runs"),
        (["demo", "--policies", "kv_aware,fastest"], "argument --policies: unknown policy 'fastest'"),
        (["demo", "--models", "3", "--engines", "2"], "--models 3: each model needs an engine of its own"),
        (["bench", "live", "--policies", "round-robin"], "argument --policies: unknown policy 'round-robin'"),
        (["bench", "proxy", "--policies", ","], "argument --policies: no policy in ','"),
        (["bench", "replicas", "--catchup-blocks", "100000,1e6"], "argument --catchup-blocks: '100000,1e6'"),
        (["bench", "live", "--engine-urls", "http://e:8000"], "--engine-urls without --router-url needs --direct"),
        (
            ["router", "--tokenizer", "t", "--policy", "chwbl", "--kv-aware-param", "load_bound=2"],
            "--kv-aware-param needs --policy kv_aware",
        ),
        (["router", "--tokenizer", "t", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["router", "--tokenizer", "t", "--model-tokenizer", "org/id"],
            "argument --model-tokenizer: 'org/id' is not MODEL=PATH_OR_ID",
        ),
        (
            ["router", "--tokenizer", "t", "--model-tokenizer", "a=x", "--model-tokenizer", "a=y"],
            "--model-tokenizer names a model twice",
        ),
        (
            ["router", "--tokenizer", "t", "--model-tokenizer", "t=x"],
            "--model-tokenizer names a model twice (or the default model",
        ),
        (["router", "--tokenizer", "t", "--serve-models", "a,,b"], "argument --serve-models: 'a,,b' is not MODEL,MODEL"),
        (["router", "--tokenizer", "t", "--max-loaded-tokenizers", "0"], "argument --max-loaded-tokenizers: must be > 0, got 0"),
        (["router", "--tokenizer", "t", "--query-timeout-ms", "0"], "argument --query-timeout-ms: must be > 0, got 0"),
        (["router", "--tokenizer", "t", "--max-reservations", "0"], "argument --max-reservations: must be > 0, got 0"),
        (["sim-engine", "--tokenizer", "t", "--block-size", "0"], "argument --block-size/--page-size: must be > 0, got 0"),
        (["bench", "live", "--router-url", "http://r:8080", "--direct"], "--direct needs --engine-urls"),
    ],
)
def test_a_bad_list_or_combination_fails_before_any_work_in_one_line(argv: list[str], message: str) -> None:
    started = time.monotonic()
    result = kvroute(*argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout, (result.stdout, result.stderr)
    assert time.monotonic() - started < 30  # no simulation, no fleet: it stopped at the parse


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """`kvroute audit ... | head -5`: stdout's pipe closes before the command is done printing."""
    config = tmp_path / "k.toml"
    config.write_text('[router]\ntokenizer = "/models/tiny"\n')
    for argv in (
        ["config", "show", "router", "--config", str(config)],
        ["config", "check", str(config)],
        ["simulate", "--workload", "rag", "--requests", "50", "--workers", "2", "--policies", "round_robin"],
    ):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line
        try:
            clean = {k: v for k, v in os.environ.items() if not k.startswith(kvroute_config.ENV_PREFIX)}
            result = subprocess.run(
                kvroute_argv(*argv), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=clean, check=False
            )
        finally:
            os.close(write_end)
        assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
        assert result.returncode == EXIT_READER_GONE, (argv, result.returncode, result.stderr)


def test_config_check_refuses_what_start_refuses_naming_the_file_key(tmp_path: Path) -> None:
    for table, message in (
        ("port = 70000", "[router] port: port 70000 is out of range (0..65535)"),
        ('kv_aware_param = ["load_bund=1.5"]', "[router] kv_aware_param: 'load_bund=1.5'"),
        ('control_plane = "http://cp:50051"', "[router] control_plane: 'http://cp:50051' is a URL"),
    ):
        config = tmp_path / "k.toml"
        config.write_text(f'[router]\ntokenizer = "/models/tiny"\n{table}\n')
        for argv in (["config", "check", str(config)], ["router", "--config", str(config)]):
            result = kvroute(*argv)
            assert result.returncode == 2, (argv, result.stdout, result.stderr)
            assert f"--config {config} {message}" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    # Flags that are valid alone but not together: the same check at start and in `config check`, naming
    # where each value came from (here one from the file, one from the environment).
    config.write_text('[router]\ntokenizer = "/models/tiny"\nkv_aware_param = ["load_bound=2"]\n')
    for argv in (["config", "check", str(config)], ["router", "--config", str(config)]):
        result = kvroute(*argv, env={"KVROUTE_POLICY": "chwbl"})
        assert result.returncode == 2, result.stderr
        assert (
            f"--kv-aware-param needs --policy kv_aware (--kv-aware-param from file {config} [router]; "
            "--policy from env KVROUTE_POLICY)"
        ) in result.stderr, result.stderr
    config.write_text('[router]\ntokenizer = "/models/tiny"\nhttp_tls = "mtls"\n')
    result = kvroute("config", "check", str(config))
    assert result.returncode == 2 and "--http-tls needs --tls-cert and --tls-key" in result.stderr, result.stderr


def test_an_unknown_kvroute_environment_variable_is_warned_about(tmp_path: Path) -> None:
    result = kvroute(
        "config",
        "show",
        "router",
        "--tokenizer",
        "/models/tiny",
        env={
            "KVROUTE_CONTROL_PLAIN": "cp:50051",
            "KVROUTE_API_KEYS": "sk-1",
            "KVROUTE_CONFIG_DIR": "x",
            "KVROUTE_CACHE": "/tmp",
            "KVROUTE_TLS_CERT_RELOAD": "1",
            "KVROUTE_ENGINE_URL": "http://e:1",
        },
    )
    assert result.returncode == 0, result.stderr  # a warning, not fatal
    warnings = result.stderr.strip().splitlines()
    assert warnings == [
        "kvroute router: warning: environment variable KVROUTE_CONFIG_DIR is not a kvroute setting; ignored",
        (
            "kvroute router: warning: environment variable KVROUTE_CONTROL_PLAIN is not a kvroute setting "
            "(did you mean KVROUTE_CONTROL_PLANE?); ignored"
        ),
    ], result.stderr
    config = tmp_path / "k.toml"  # several tables checked in one process: the warning once
    config.write_text('[router]\ntokenizer = "/models/tiny"\n[agent]\nengine = "vllm"\n[control-plane]\n')
    result = kvroute("config", "check", str(config), env={"KVROUTE_CONTROL_PLAIN": "cp:50051"})
    assert result.returncode == 0 and result.stdout.splitlines() == ["router: ok", "agent: ok", "control-plane: ok"]
    assert len(result.stderr.strip().splitlines()) == 1 and "KVROUTE_CONTROL_PLAIN" in result.stderr, result.stderr


def test_a_model_tokenizer_that_is_nowhere_on_disk_stops_the_router_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Neither a directory nor in the Hugging Face cache: nothing is downloaded, the router does not start."""
    result = kvroute(
        "router",
        "--tokenizer",
        str(tiny_model_dir),
        "--model-tokenizer",
        "chat=org/not-cached",
        "--control-plane",
        "127.0.0.1:1",
        "--port",
        "0",
        "--grpc-port",
        "0",
        env={"HF_HUB_CACHE": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model 'chat'" in lines[0] and "nothing is downloaded" in lines[0], result.stderr
