"""The router session against a real control plane (in-process, over a real socket)."""

from __future__ import annotations

import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.control_plane_client import ControlPlaneClient, query_message


async def test_a_query_given_up_on_mid_write_leaves_the_session_usable() -> None:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    await server.start()
    client = ControlPlaneClient(f"127.0.0.1:{server.port}", query_timeout_s=1.0)
    client.start()
    try:
        assert await client.session.wait_connected(10)
        chains = {16: list(range(1, 513))}  # a 4 kB message: its write takes a while
        late = []
        client.session.on_late_answer = late.append
        for _ in range(20):  # a deadline that has passed before the write even starts
            with pytest.raises(TimeoutError):
                await client.session.query(query_message("m", chains), 1e-9)
        assert client.session.connected and client.session.sessions == 1  # the stream was not cut
        answer = await client.session.query(query_message("m", chains), 5.0)
        assert answer.query_id > 20
        assert late, "the answers of the given-up queries are timed when they arrive"
    finally:
        await client.close()
        await server.stop(0)


async def test_a_deadline_missed_because_this_process_stalled_waits_once_more() -> None:
    import asyncio
    import time

    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    await server.start()
    client = ControlPlaneClient(f"127.0.0.1:{server.port}", query_timeout_s=1.0)
    client.start()
    try:
        assert await client.session.wait_connected(10)
        chains = {16: list(range(1, 65))}
        await client.session.query(query_message("m", chains), 5.0)  # warm
        asyncio.get_running_loop().call_soon(time.sleep, 0.08)  # this process held up past the deadline
        answer = await client.session.query(query_message("m", chains), 0.02)
        assert answer.query_id == 2 and client.session.stalled_deadlines == 1
    finally:
        await client.close()
        await server.stop(0)
