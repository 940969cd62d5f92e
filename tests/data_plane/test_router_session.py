"""The router session against a real control plane (in-process, over a real socket)."""

from __future__ import annotations

import grpc
import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, query_message
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import AgentStream, eventually


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


async def test_a_first_request_another_router_already_sent_is_recounted_as_the_control_plane_charged_it() -> None:
    """Two routers send the first request of one new prefix to one worker at the same moment, neither
    seeing the other's: both announce its whole prefill. The control plane charges the second only what
    the first's claims do not cover, and says so; that router then counts its own request as charged, so
    its next decisions do not see the prefix's prefill twice on that worker."""
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    agent = AgentStream(pb_grpc.ControlPlaneStub(channel))
    await agent.register("w0", block_size=16)
    first = ControlPlaneClient(f"127.0.0.1:{server.port}", router_id="first")
    second = ControlPlaneClient(f"127.0.0.1:{server.port}", router_id="second")
    for client in (first, second):
        client.start()
    try:
        for client in (first, second):
            assert await client.session.wait_connected(10)
        prefix = list(range(1, 65))  # 64 blocks of 16 tokens
        mine, theirs = RouterInflight(first.session), RouterInflight(second.session)
        mine.start("w0", 64 * 16 + 16, [*prefix, 1000], 16, 64 * 16 + 16)
        await eventually(lambda: server.state.inflight.reservation_count() == 1, 10, what="the first reservation")
        theirs.start("w0", 64 * 16 + 16, [*prefix, 2000], 16, 64 * 16 + 16)
        await eventually(lambda: theirs.inflight("w0") == (1, 16), 10, what="the second one recounted")
        assert mine.inflight("w0") == (1, 64 * 16 + 16)
    finally:
        for client in (first, second):
            await client.close()
        await agent.close()
        await channel.close()
        await server.stop(0)
