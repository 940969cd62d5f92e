"""The router's control-plane client over mTLS: it presents the router certificate, and when the
certificate files are rotated it opens new channels with the new certificate (no restart)."""

from __future__ import annotations

import asyncio
import os

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.control_plane_client import ControlPlaneClient
from kvroute.identity import router_uri
from kvroute.tls import ClientTls, TlsFiles
from tests.helpers import eventually
from tests.tls_certs import TestCA


async def test_router_client_reconnects_with_a_rotated_certificate(tmp_path):
    trusted, untrusted = TestCA(tmp_path / "trusted", "trusted-ca"), TestCA(tmp_path / "untrusted", "untrusted-ca")
    served = trusted.issue("control-plane")
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", tls=TlsFiles(
        str(served.cert), str(served.key), str(trusted.ca_path))))
    port = await server.start()
    mine = untrusted.issue("router-1", uris=[router_uri("router-1")])
    client = ControlPlaneClient(f"localhost:{port}", refresh_interval_s=0.1, router_id="router-1", tls=ClientTls(
        TlsFiles(str(mine.cert), str(mine.key), str(trusted.ca_path))))
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
