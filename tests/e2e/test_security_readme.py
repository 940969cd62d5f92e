"""docs/security.md's "mTLS set-up" works as written, against live processes over real TLS sockets.

Both blocks are read out of docs/security.md and run by bash in an empty directory: the openssl commands
make the CA and the certificates, the second block starts a control plane (mTLS), a sim engine,
its agent (with a certificate naming worker sim-0) and a router (HTTPS, API key), sends a chat
request with curl over HTTPS and runs `kvroute audit` with the router's certificate. Only the fixed
ports are swapped for free ones. Then, against the same live control plane: the agent's certificate
cannot write another worker, the router's cannot write at all (PERMISSION_DENIED, counted, the index
unchanged), and a plaintext client or a certificate from another CA does not get in.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvroute.tls import ClientTls, TlsFiles, open_channel
from kvroute.tools.local_cluster import ManagedProcess, kvroute_argv, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import doc_env, doc_sh_blocks, process_group_alive, with_free_ports
from tests.tls_certs import TestCA

README_PORTS = (50051, 50052, 8000, 8443, 5557, 5558)


def tls(pki: Path, name: str) -> ClientTls:
    return ClientTls(TlsFiles(str(pki / f"{name}.crt"), str(pki / f"{name}.key"), str(pki / "ca.crt")))


async def check_authority(address: str, pki: Path, stranger: Path) -> None:
    async with (
        open_channel(address, tls(pki, "router-1")) as router_channel,
        open_channel(address, tls(pki, "agent-sim-0")) as agent_channel,
    ):
        router, agent = pb_grpc.ControlPlaneStub(router_channel), pb_grpc.ControlPlaneStub(agent_channel)
        workers = (await router.ListWorkers(pb.ListWorkersRequest(), timeout=5)).workers
        assert [w.worker_id for w in workers] == ["sim-0"] and workers[0].cached_blocks > 0
        before = {w.worker_id: w.cached_blocks for w in workers}
        for stub, worker_id, expected in (
            (agent, "sim-1", "does not name worker 'sim-1'"),
            (agent, "sim-0-other", "does not name worker"),
            (router, "sim-0", "may query and reserve but not write"),
        ):
            call = stub.Connect()
            await call.write(
                pb.AgentMessage(
                    register=pb.RegisterWorker(
                        worker_id=worker_id, model="tiny-llama", engine="vllm", block_size=16, endpoint="http://evil"
                    )
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    await call
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
            assert expected in refused.value.details()
        after = {w.worker_id: w.cached_blocks for w in (await router.ListWorkers(pb.ListWorkersRequest())).workers}
        assert after == before  # nothing applied, sim-0 untouched
    for channel in (
        open_channel(address, None),
        open_channel(
            address,
            ClientTls(TlsFiles(str(stranger.with_suffix(".crt")), str(stranger.with_suffix(".key")), str(pki / "ca.crt"))),
        ),
    ):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=3)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


async def check_router_grpc(address: str, pki: Path) -> None:
    """The router's gRPC Router port: TLS with client certificates, and the API key in metadata."""
    request = pb.RouteRequest(model="tiny-llama", prompt="hello")
    async with open_channel(address, tls(pki, "router-1")) as channel:
        route = pb_grpc.RouterStub(channel).Route
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await route(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = await route(request, metadata=(("authorization", "Bearer sk-demo-key"),), timeout=5)
        assert answer.worker_id == "sim-0"
    async with open_channel(address, ClientTls(TlsFiles(ca=str(pki / "ca.crt")))) as channel:  # no certificate
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pb_grpc.RouterStub(channel).Route(request, metadata=(("authorization", "Bearer sk-demo-key"),), timeout=3)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(240)
def test_mtls_setup_works_as_written(tmp_path: Path) -> None:
    certs, fleet = doc_sh_blocks("docs/security.md", "## mTLS set-up", 2)
    fleet, ports = with_free_ports(fleet, README_PORTS)
    script = tmp_path / "mtls.sh"
    # set -e: a failing openssl, curl or audit fails the run; the processes stay up for the checks below.
    script.write_text("set -e\n" + certs + fleet + "echo READY\nwait\n")
    env = doc_env()
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.strip() == "READY":
                break
        logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(tmp_path.glob("*.log")))
        assert lines and lines[-1] == "READY", f"(ports {ports})\nstdout:\n{lines}\n{logs}\n{proc.stderr and ''}"
        completion = json.loads(lines[1]) if lines[1].startswith("{") else {}
        assert completion.get("object") == "chat.completion" and completion["model"] == "tiny-llama", f"{lines}\n{logs}"
        assert completion["usage"]["completion_tokens"] == 8, completion
        audit = json.loads(lines[-2])
        assert audit["audited"] == 1 and audit["divergence"] == 0 and not audit["errors"], audit
        pki = tmp_path / "pki"
        assert {"ca.crt", "control-plane.crt", "agent-sim-0.crt", "router-1.crt"} <= {p.name for p in pki.iterdir()}
        stranger = TestCA(tmp_path / "other-pki", "other-ca").issue("stranger", uris=["spiffe://kvroute/worker/sim-0"])
        asyncio.run(check_authority(f"127.0.0.1:{ports[50051]}", pki, stranger.cert.with_suffix("")))
        asyncio.run(check_router_grpc(f"localhost:{ports[50052]}", pki))
        # The README's claim: an agent process with that certificate and another worker id is refused, says
        # so in its log, and keeps retrying; the index never holds sim-1.
        intruder = ManagedProcess(
            "agent-sim-1",
            kvroute_argv(
                "agent",
                "--control-plane",
                f"127.0.0.1:{ports[50051]}",
                "--engine",
                "vllm",
                "--kv-events",
                f"tcp://127.0.0.1:{ports[5557]}",
                "--engine-url",
                f"http://127.0.0.1:{ports[8000]}",
                "--worker-id",
                "sim-1",
                "--block-size",
                "16",
                "--tls-cert",
                str(pki / "agent-sim-0.crt"),
                "--tls-key",
                str(pki / "agent-sim-0.key"),
                "--tls-ca",
                str(pki / "ca.crt"),
            ),
            tmp_path / "intruder.log",
        )
        intruder.start()
        try:
            wait_until(
                lambda: "PERMISSION_DENIED" in (tmp_path / "intruder.log").read_text(),
                30,
                "the intruding agent's refusal",
                [intruder],
            )
            assert "does not name worker 'sim-1'" in (tmp_path / "intruder.log").read_text()
            assert intruder.alive()
        finally:
            intruder.stop()
        router_log = (tmp_path / "router.log").read_text()
        assert "router listening: https://" in router_log and "tls=mtls" in router_log, router_log[-2000:]
    finally:
        if process_group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
