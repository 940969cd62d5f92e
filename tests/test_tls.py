"""kvroute/tls.py and kvroute/identity.py over real TLS sockets: certificates rotated on disk are served
from the next handshake on (gRPC server, HTTPS listener, client channels) without a restart; bad
files are one line at start-up; worker ids survive the URI SAN round trip."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from kvroute import tls as tls_module
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.identity import identity_from_uris, router_uri, worker_uri
from kvroute.listeners import start_http_site
from kvroute.tls import (
    ClientTls,
    ServerTls,
    TlsConfigError,
    TlsFiles,
    describe_rpc_error,
    open_channel,
    rpc_failure_reason,
    tls_failure_hint,
)
from kvroute.tools.local_cluster import kvroute_argv
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.tls_certs import CertFiles, TestCA


def rotate(target: CertFiles, new: CertFiles) -> None:
    """Replace the files' contents the way a secret update does (new bytes, new modification time)."""
    for src, dst in ((new.cert, target.cert), (new.key, target.key)):
        tmp = dst.with_suffix(".tmp")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


def client(ca: TestCA, name: str) -> ClientTls:
    cert = ca.issue(name, uris=[router_uri(name)])
    return ClientTls(TlsFiles(str(cert.cert), str(cert.key), str(cert.ca)))


async def list_workers(port: int, tls: ClientTls) -> grpc.StatusCode:
    async with open_channel(f"localhost:{port}", tls) as channel:
        try:
            await pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=3)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_control_plane_serves_a_rotated_certificate_without_a_restart(tmp_path):
    """The server certificate is swapped for one from another CA that also trusts the clients: a client
    that trusts only the new CA fails before the swap and succeeds after it, on the same process."""
    old_ca, new_ca = TestCA(tmp_path / "old", "old-ca"), TestCA(tmp_path / "new", "new-ca")
    served = old_ca.issue("control-plane")
    # The CA file the server verifies clients with holds both CAs, so clients of either are let in.
    both = tmp_path / "clients-ca.pem"
    both.write_bytes(old_ca.ca_path.read_bytes() + new_ca.ca_path.read_bytes())
    server = ControlPlaneServer(
        ControlPlaneConfig(listen="127.0.0.1:0", tls=TlsFiles(str(served.cert), str(served.key), str(both)))
    )
    port = await server.start()
    try:
        old_client, new_client = client(old_ca, "router-old"), client(new_ca, "router-new")
        assert await list_workers(port, old_client) == grpc.StatusCode.OK
        assert await list_workers(port, new_client) == grpc.StatusCode.UNAVAILABLE  # the server's cert is old_ca's
        rotate(served, new_ca.issue("control-plane-2"))
        await asyncio.sleep(1.1)  # files are checked at most once a second
        assert await list_workers(port, new_client) == grpc.StatusCode.OK
        assert await list_workers(port, old_client) == grpc.StatusCode.UNAVAILABLE
        # A half-written certificate keeps the last good one.
        served.cert.write_text("-----BEGIN CERTIFICATE-----\nnot really\n")
        await asyncio.sleep(1.1)
        assert await list_workers(port, new_client) == grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def test_client_channels_pick_up_a_rotated_client_certificate(tmp_path):
    """A client certificate from a CA the server does not trust is refused; once the files hold one
    it trusts, the next channel opened with the same ClientTls gets in."""
    trusted, untrusted = TestCA(tmp_path / "trusted", "trusted-ca"), TestCA(tmp_path / "untrusted", "untrusted-ca")
    served = trusted.issue("control-plane")
    server = ControlPlaneServer(
        ControlPlaneConfig(listen="127.0.0.1:0", tls=TlsFiles(str(served.cert), str(served.key), str(trusted.ca_path)))
    )
    port = await server.start()
    try:
        mine = untrusted.issue("router-1", uris=[router_uri("router-1")])
        tls = ClientTls(TlsFiles(str(mine.cert), str(mine.key), str(trusted.ca_path)))
        generation = tls.generation
        assert await list_workers(port, tls) == grpc.StatusCode.UNAVAILABLE
        rotate(mine, trusted.issue("router-1b", uris=[router_uri("router-1")]))
        await asyncio.sleep(1.1)
        assert tls.generation == generation + 1
        assert await list_workers(port, tls) == grpc.StatusCode.OK
    finally:
        await server.stop(0)


def overwrite(path: Path, data: bytes) -> None:
    """New contents in place, with a later modification time than the last version's (the files are
    told apart by time and size, and two writes within one tick of the kernel's clock share a time)."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    if path.stat().st_mtime_ns <= before:
        os.utime(path, ns=(before + 1, before + 1))


def do_not_load(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "do not load" in r.getMessage()]


async def test_client_tls_keeps_the_previous_certificate_when_new_files_do_not_load(tmp_path, caplog, monkeypatch):
    """Garbage, then a key of another certificate, in a client's files: channels opened meanwhile still
    use the last pair that loaded (and get in), `generation` stays, and each bad version is one warning;
    a valid new certificate is picked up."""
    monkeypatch.setattr(tls_module, "RECHECK_S", 0.0)  # every look at the files checks them
    ca = TestCA(tmp_path / "pki", "kvroute-ca")
    served = ca.issue("control-plane")
    server = ControlPlaneServer(
        ControlPlaneConfig(listen="127.0.0.1:0", tls=TlsFiles(str(served.cert), str(served.key), str(ca.ca_path)))
    )
    port = await server.start()
    caplog.set_level(logging.INFO, logger="kvroute.tls")
    try:
        mine = ca.issue("router-1", uris=[router_uri("router-1")])
        tls = ClientTls(TlsFiles(str(mine.cert), str(mine.key), str(ca.ca_path)))
        assert await list_workers(port, tls) == grpc.StatusCode.OK
        overwrite(mine.cert, b"garbage, not a certificate\n")
        for _ in range(3):
            assert tls.generation == 0
            assert await list_workers(port, tls) == grpc.StatusCode.OK
        assert len(do_not_load(caplog)) == 1 and str(mine.cert) in do_not_load(caplog)[0], caplog.text
        other = ca.issue("router-other", uris=[router_uri("router-1")])
        overwrite(mine.cert, other.cert.read_bytes())  # a valid certificate, but not the key's
        assert tls.generation == 0 and await list_workers(port, tls) == grpc.StatusCode.OK
        assert len(do_not_load(caplog)) == 2, caplog.text
        overwrite(mine.key, other.key.read_bytes())  # now the pair matches again: a new certificate
        assert tls.generation == 1
        assert await list_workers(port, tls) == grpc.StatusCode.OK
        assert "TLS files reloaded" in caplog.text and len(do_not_load(caplog)) == 2
    finally:
        await server.stop(0)


def test_server_tls_warns_once_per_bad_version_of_its_files(tmp_path, caplog, monkeypatch):
    """The server side's reload is the same code: a bad file is one warning however many handshakes
    look at it, and the configuration stays the last good one."""
    monkeypatch.setattr(tls_module, "RECHECK_S", 0.0)
    ca = TestCA(tmp_path / "pki")
    served = ca.issue("control-plane")
    tls = ServerTls(TlsFiles(str(served.cert), str(served.key), str(ca.ca_path)))
    caplog.set_level(logging.INFO, logger="kvroute.tls")
    overwrite(served.key, b"-----BEGIN PRIVATE KEY-----\nhalf writ")
    assert [tls.fetch() for _ in range(5)] == [None] * 5
    assert len(do_not_load(caplog)) == 1, caplog.text
    overwrite(served.key, served.key.read_bytes()[:10])  # another bad version: said again
    assert tls.fetch() is None and len(do_not_load(caplog)) == 2
    fresh = ca.issue("control-plane-2")
    overwrite(served.key, fresh.key.read_bytes())
    overwrite(served.cert, fresh.cert.read_bytes())
    assert tls.fetch() is not None and "TLS files reloaded" in caplog.text


async def test_the_tls_hint_names_a_plaintext_server_and_stays_out_of_other_failures(tmp_path):
    """A TLS client of a plaintext server is told so; a refused connection and a server's own error
    are not TLS failures and read as before."""
    ca = TestCA(tmp_path / "pki")
    tls = client(ca, "router-1")
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    port = await server.start()

    async def failure(address: str, tls: ClientTls | None) -> grpc.aio.AioRpcError:
        async with open_channel(address, tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:  # an unknown worker: NOT_FOUND once connected
                await pb_grpc.ControlPlaneStub(channel).GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="nobody"), timeout=5)
        return failed.value

    try:
        plaintext = await failure(f"localhost:{port}", tls)
        assert describe_rpc_error(plaintext, tls).startswith("UNAVAILABLE: TLS handshake failed (WRONG_VERSION_NUMBER):")
        assert "serves no TLS" in describe_rpc_error(plaintext, tls) and "--tls-cert/--tls-key/--tls-ca" in describe_rpc_error(
            plaintext, tls
        )
        unknown = await failure(f"localhost:{port}", None)
        assert tls_failure_hint(unknown, None) is None and rpc_failure_reason(unknown, None) == unknown.code().name
    finally:
        await server.stop(0)
    refused = await failure(f"127.0.0.1:{port}", tls)
    assert tls_failure_hint(refused, tls) is None and tls_failure_hint(refused, None) is None
    assert describe_rpc_error(refused, tls) == f"UNAVAILABLE: {refused.details()}"


async def https_health_site(tls: ServerTls, require_client_cert: bool) -> tuple[web.AppRunner, int]:
    """A real HTTPS listener (the router's `start_http_site`) answering GET /health with `tls`'s context."""

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = await start_http_site(
        runner, "--port", "127.0.0.1", 0, ssl_context=tls.ssl_context(require_client_cert=require_client_cert)
    )
    return runner, port


async def test_https_listener_serves_a_rotated_certificate(tmp_path):
    old_ca, new_ca = TestCA(tmp_path / "old", "old-ca"), TestCA(tmp_path / "new", "new-ca")
    served = old_ca.issue("router")
    tls = ServerTls(TlsFiles(str(served.cert), str(served.key)))
    runner, port = await https_health_site(tls, require_client_cert=False)

    async def status(ca: TestCA) -> int | str:
        context = ssl.create_default_context(cafile=ca.ca_path)
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(f"https://localhost:{port}/health", ssl=context) as response:
                    return response.status
            except aiohttp.ClientConnectorCertificateError:
                return "certificate refused"

    try:
        assert await status(old_ca) == 200
        assert await status(new_ca) == "certificate refused"
        rotate(served, new_ca.issue("router-2"))
        await asyncio.sleep(1.1)
        assert await status(new_ca) == 200
        assert await status(old_ca) == "certificate refused"
    finally:
        await runner.cleanup()


async def test_https_listener_with_client_certificates_takes_only_the_cas(tmp_path):
    ca, other = TestCA(tmp_path / "pki", "kvroute-ca"), TestCA(tmp_path / "other", "other-ca")
    served = ca.issue("router")
    tls = ServerTls(TlsFiles(str(served.cert), str(served.key), str(ca.ca_path)))
    runner, port = await https_health_site(tls, require_client_cert=True)

    async def status(client_cert) -> int | str:
        context = ssl.create_default_context(cafile=ca.ca_path)
        if client_cert is not None:
            context.load_cert_chain(client_cert.cert, client_cert.key)
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(f"https://localhost:{port}/health", ssl=context) as response:
                    return response.status
            except (aiohttp.ClientError, ssl.SSLError, ConnectionError):
                return "refused"

    try:
        assert await status(ca.issue("app")) == 200
        assert await status(None) == "refused"
        assert await status(other.issue("app")) == "refused"
    finally:
        await runner.cleanup()


def test_bad_tls_files_are_one_line_and_exit_2(tmp_path):
    ca = TestCA(tmp_path / "pki")
    cert = ca.issue("control-plane")
    other = ca.issue("other")
    with pytest.raises(TlsConfigError, match="go together"):
        TlsFiles(cert=str(cert.cert)).check(server=True)
    with pytest.raises(TlsConfigError, match="cannot read"):
        TlsFiles(str(tmp_path / "missing.crt"), str(cert.key)).check(server=True)
    with pytest.raises(TlsConfigError, match="do not load"):  # a key that is not the certificate's
        TlsFiles(str(cert.cert), str(other.key)).check(server=True)
    done = subprocess.run(
        kvroute_argv("control-plane", "--listen", "127.0.0.1:0", "--tls-cert", str(cert.cert), "--tls-key", str(other.key)),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvroute control-plane: error: --tls-cert"), done.stderr
    # The environment variables stand in for the flags.
    done = subprocess.run(
        kvroute_argv("control-plane", "--listen", "127.0.0.1:0"),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVROUTE_TLS_CERT": str(cert.cert)},
    )
    assert done.returncode == 2 and "--tls-cert and --tls-key go together" in done.stderr


@pytest.mark.parametrize("worker_id", ["node-7:8000", "gpu node/3", "w-dp0", "ünïcode"])
def test_worker_ids_round_trip_through_uri_sans(worker_id):
    uri = worker_uri(worker_id)
    assert (
        uri.startswith("spiffe://kvroute/worker/") and " " not in uri and "/" not in uri.removeprefix("spiffe://kvroute/worker/")
    )
    identity = identity_from_uris([uri, router_uri("r1"), "spiffe://other/worker/x"])
    assert identity.worker_ids == {worker_id} and identity.routers == {"r1"}
    assert identity.may_write(worker_id) and not identity.may_write("x")


def test_identity_needs_the_kvroute_trust_domain():
    identity = identity_from_uris(["spiffe://other/worker/w1", "spiffe://kvroute/worker/", "https://kvroute/worker/w1"])
    assert not identity.worker_ids and not identity.is_router
