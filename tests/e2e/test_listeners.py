"""Every listener of every kvroute process refuses a port in use, and a malformed address, with one
line on stderr naming the flag and the address and exit code 2 (kvroute/listeners.py)."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.tools.local_cluster import ManagedProcess, _tcp_open, free_port, http_get, kvroute_argv
from tests.helpers import REPO


@pytest.fixture(scope="module")
def control_plane_port(tmp_path_factory) -> Iterator[int]:
    """A real control plane process: its gRPC port is the one others must not share. It listens on
    port 0 and says which port it got in its --port-file."""
    workdir = tmp_path_factory.mktemp("cp")
    proc = ManagedProcess(
        "control-plane",
        kvroute_argv("control-plane", "--listen", "127.0.0.1:0", "--port-file", str(workdir / "cp.ports")),
        workdir / "control-plane.log",
        port_file=workdir / "cp.ports",
    )
    proc.start()
    try:
        port = proc.wait_ports()["grpc"]
        assert port and _tcp_open(f"127.0.0.1:{port}")
        yield port
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A plain listening socket (SO_REUSEADDR, no SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def refused(argv: list[str], flag: str, address: str, reason: str) -> None:
    proc = subprocess.run(kvroute_argv(*argv), check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr  # no traceback, no log lines before it
    assert lines[0].startswith(f"kvroute {argv[0]}: error: {flag} {address}: ") and reason in lines[0], lines[0]


def test_a_second_control_plane_on_the_same_port_exits_2(control_plane_port: int) -> None:
    address = f"127.0.0.1:{control_plane_port}"
    refused(["control-plane", "--listen", address], "--listen", address, "address already in use")


def test_a_router_grpc_port_taken_by_a_control_plane_exits_2(control_plane_port: int, tiny_model_dir: Path) -> None:
    refused(
        ["router", "--tokenizer", str(tiny_model_dir), "--port", str(free_port()), "--grpc-port", str(control_plane_port)],
        "--grpc-port",
        f"127.0.0.1:{control_plane_port}",
        "address already in use",
    )


def test_an_epp_grpc_port_taken_by_a_control_plane_exits_2(control_plane_port: int, tiny_model_dir: Path) -> None:
    refused(
        ["epp", "--tokenizer", str(tiny_model_dir), "--grpc-port", str(control_plane_port)],
        "--grpc-port",
        f"127.0.0.1:{control_plane_port}",
        "address already in use",
    )


@pytest.mark.parametrize("process", ["control-plane", "agent", "agent-kv-events-bind", "router", "sim-engine"])
def test_http_and_zmq_ports_in_use_exit_2(process: str, busy_port: int, tiny_model_dir: Path) -> None:
    agent = ["agent", "--model", "tiny", "--engine-url", "http://127.0.0.1:9", "--control-plane", f"127.0.0.1:{free_port()}"]
    argv, flag, address = {
        "control-plane": (
            ["control-plane", "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(busy_port)],
            "--metrics-port",
            f"127.0.0.1:{busy_port}",
        ),
        "agent": ([*agent, "--metrics-port", str(busy_port)], "--metrics-port", f"127.0.0.1:{busy_port}"),
        "agent-kv-events-bind": (
            [*agent, "--kv-events-bind", "--kv-events", f"tcp://127.0.0.1:{busy_port}"],
            "--kv-events-bind",
            f"tcp://127.0.0.1:{busy_port}",
        ),
        "router": (
            ["router", "--tokenizer", str(tiny_model_dir), "--port", str(busy_port), "--grpc-port", "off"],
            "--port",
            f"127.0.0.1:{busy_port}",
        ),
        "sim-engine": (
            ["sim-engine", "--tokenizer", str(tiny_model_dir), "--port", str(busy_port)],
            "--port",
            f"127.0.0.1:{busy_port}",
        ),
    }[process]
    refused(argv, flag, address, "address already in use")


def test_a_listen_address_that_does_not_resolve_exits_2() -> None:
    refused(
        ["control-plane", "--listen", "no-such-host.invalid:50051"],
        "--listen",
        "no-such-host.invalid:50051",
        "cannot resolve the host",
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["control-plane", "--listen", "notaport"], "argument --listen: no port in 'notaport'"),
        (["control-plane", "--listen", "127.0.0.1:99999"], "argument --listen: port 99999 in '127.0.0.1:99999' is out of range"),
        (["router", "--tokenizer", "t", "--grpc-port", "70000"], "argument --grpc-port: port 70000 is out of range (0..65535)"),
    ],
)
def test_a_malformed_listen_address_is_refused_when_parsed(argv: list[str], message: str) -> None:
    """Before anything starts (tests/test_command_line.py has every address flag)."""
    proc = subprocess.run(kvroute_argv(*argv), check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"kvroute {argv[0]}: error: {message}"), lines


async def test_no_grpc_server_can_share_a_kvroute_grpc_port() -> None:
    from kvroute.listeners import GrpcListener, ListenError

    listener = GrpcListener("--listen", "127.0.0.1:0", ("kvroute.v1.Test",))
    await listener.start()
    try:
        # gRPC's default (SO_REUSEPORT) would let this one bind too if ours had it set.
        with pytest.raises(RuntimeError):
            grpc.aio.server().add_insecure_port(f"127.0.0.1:{listener.port}")
        with pytest.raises(ListenError, match=f"--listen 127.0.0.1:{listener.port}: address already in use"):
            GrpcListener("--listen", f"127.0.0.1:{listener.port}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvroute.v1.Test"):
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await listener.stop(0)


def test_every_grpc_server_in_the_product_is_a_grpc_listener() -> None:
    """grpc.aio.server() is made in kvroute/listeners.py only (tests make their own fakes)."""
    made_elsewhere = []
    for package in ("kvroute", "control_plane", "data_plane", "worker_agent", "tools"):
        for path in (REPO / package).rglob("*.py"):
            if path.name != "listeners.py" and re.search(r"\bgrpc\.(aio\.)?server\(", path.read_text()):
                made_elsewhere.append(str(path.relative_to(REPO)))
    assert made_elsewhere == []


def test_port_0_is_any_free_port_on_every_listener_and_off_turns_one_off(control_plane_port: int, tmp_path: Path) -> None:
    """0 means the same everywhere: the OS picks, and --port-file says what it picked; `off` is how a
    listener that may be left out (gRPC Route, /metrics) is turned off."""
    cp_file, agent_file = tmp_path / "cp.ports", tmp_path / "agent.ports"
    cp = ManagedProcess(
        "cp-metrics",
        kvroute_argv("control-plane", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(cp_file)),
        tmp_path / "cp.log",
        port_file=cp_file,
    )
    agent = ManagedProcess(
        "agent",
        kvroute_argv(
            "agent",
            "--control-plane",
            f"127.0.0.1:{control_plane_port}",
            "--engine-url",
            f"http://127.0.0.1:{free_port()}",
            "--metrics-port",
            "0",
            "--port-file",
            str(agent_file),
        ),
        tmp_path / "agent.log",
        port_file=agent_file,
    )
    try:
        cp.start()
        agent.start()
        cp_ports, agent_ports = cp.wait_ports(), agent.wait_ports()
        assert set(cp_ports) == {"grpc", "metrics"} and 0 not in cp_ports.values(), cp_ports
        assert set(agent_ports) == {"metrics"} and agent_ports["metrics"] != 0, agent_ports
        for ports in (cp_ports, agent_ports):
            assert http_get(f"http://127.0.0.1:{ports['metrics']}/metrics")[0] == 200
    finally:
        agent.stop()
        cp.stop()
    off_file = tmp_path / "off.ports"
    off = ManagedProcess(
        "cp-off",
        kvroute_argv("control-plane", "--listen", "127.0.0.1:0", "--metrics-port", "off", "--port-file", str(off_file)),
        tmp_path / "off.log",
        port_file=off_file,
    )
    try:
        off.start()
        assert set(off.wait_ports()) == {"grpc"}
    finally:
        off.stop()


def test_a_port_that_is_neither_a_number_nor_off_exits_2() -> None:
    proc = subprocess.run(
        kvroute_argv("control-plane", "--metrics-port", "none"),
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2 and "--metrics-port" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
