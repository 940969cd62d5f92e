"""The router's control-plane client over mTLS: it presents the router certificate, and when the
certificate files are rotated it opens new channels with the new certificate (no restart); files
that do not load leave the link as it was."""

from __future__ import annotations

import asyncio
import logging
import os

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.identity import router_uri
from kvroute.tls import ClientTls, TlsFiles
from tests.helpers import eventually
from tests.tls_certs import CertFiles, TestCA


async def mtls_link(server_ca: TestCA, client_ca: TestCA) -> tuple[ControlPlaneServer, ControlPlaneClient, CertFiles]:
    """A control plane trusting `server_ca`'s client certificates and a router client (not started)
    whose certificate `client_ca` signed; the client's certificate files."""
    served = server_ca.issue("control-plane")
    server = ControlPlaneServer(
        ControlPlaneConfig(listen="127.0.0.1:0", tls=TlsFiles(str(served.cert), str(served.key), str(server_ca.ca_path)))
    )
    port = await server.start()
    mine = client_ca.issue("router-1", uris=[router_uri("router-1")])
    client = ControlPlaneClient(
        f"localhost:{port}",
        refresh_interval_s=0.1,
        router_id="router-1",
        tls=ClientTls(TlsFiles(str(mine.cert), str(mine.key), str(server_ca.ca_path))),
    )
    return server, client, mine


async def test_router_client_reconnects_with_a_rotated_certificate(tmp_path):
    trusted, untrusted = TestCA(tmp_path / "trusted", "trusted-ca"), TestCA(tmp_path / "untrusted", "untrusted-ca")
    server, client, mine = await mtls_link(trusted, untrusted)
    client.start()
    try:
        await asyncio.sleep(1.0)
        assert not client.reachable and client.last_error  # the control plane does not take this CA's certificates
        replacement = trusted.issue("router-1b", uris=[router_uri("router-1")])
        for src, dst in ((replacement.cert, mine.cert), (replacement.key, mine.key)):
            os.replace(src, dst)
        await eventually(lambda: client.reachable, timeout=10, what="ListWorkers with the rotated certificate")
        await eventually(lambda: server.inflight.open_sessions == 1, timeout=10, what="the router session")
    finally:
        await client.close()
        await server.stop(0)


async def test_router_client_keeps_its_link_when_the_new_certificate_does_not_load(tmp_path, caplog):
    """Garbage in the certificate file: the client keeps its channels and certificate (refreshes and the
    session go on), says once that the files do not load, and takes the next valid certificate."""
    ca = TestCA(tmp_path / "pki", "kvroute-ca")
    server, client, mine = await mtls_link(ca, ca)
    caplog.set_level(logging.INFO, logger="kvroute")
    client.start()
    try:
        await eventually(lambda: client.reachable and server.inflight.open_sessions == 1, timeout=10, what="the link up")
        mine.cert.write_text("garbage\n")
        await eventually(lambda: "do not load" in caplog.text, timeout=10, what="the warning")
        warned_at = client.fleet_updated_at
        # Refreshes after the warning still succeed: they opened no channel with the garbage.
        await eventually(lambda: client.fleet_updated_at > warned_at + 1.0, timeout=15, what="refreshes go on")
        assert client.reachable and client.last_error == "" and server.inflight.open_sessions == 1
        assert client.session is not None and client.session.sessions == 1  # never lost
        assert caplog.text.count("do not load") == 1 and "new channels" not in caplog.text
        replacement = ca.issue("router-1b", uris=[router_uri("router-1")])
        for src, dst in ((replacement.cert, mine.cert), (replacement.key, mine.key)):
            os.replace(src, dst)
        await eventually(
            lambda: "control-plane TLS certificates changed: new channels" in caplog.text,
            timeout=10,
            what="the new certificate taken",
        )
        changed_at = client.fleet_updated_at
        await eventually(
            lambda: client.fleet_updated_at > changed_at and client.reachable, timeout=10, what="a refresh over a new channel"
        )
    finally:
        await client.close()
        await server.stop(0)
