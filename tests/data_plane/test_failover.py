"""The router's control-plane client over several replicas: when the one it uses dies, it moves to
the next and keeps answering from the index within one query deadline."""

from __future__ import annotations

import asyncio

import grpc

from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from tests.helpers import eventually
from tests.replica_helpers import MODEL, Agent, start_replica

DEADLINE_S = 0.05


async def test_a_router_moves_to_another_replica_within_one_query_deadline(redis_single) -> None:
    a, b = await start_replica(redis_single.url, "a"), await start_replica(redis_single.url, "b")
    agent = Agent(f"127.0.0.1:{a.port},127.0.0.1:{b.port}")
    client = ControlPlaneClient(f"127.0.0.1:{a.port},127.0.0.1:{b.port}", query_timeout_s=DEADLINE_S, refresh_interval_s=0.1)
    client.start()
    try:
        await eventually(lambda: agent.link.connected)
        agent.store_chain(4)
        await eventually(agent.settled)
        chain = list(agent.resolver.held_keys())  # one chain, in chain order
        await eventually(lambda: client.session.connected and client.fleet)
        loop = asyncio.get_running_loop()
        columns = await client.query(MODEL, {4: chain})
        assert list(columns.matched_blocks) == [4] and client.address == f"127.0.0.1:{a.port}"
        failures: list[float] = []
        stop_at = None
        started = loop.time()
        while loop.time() - started < 1.5:
            if stop_at is None and loop.time() - started > 0.3:
                await a.stop(0)  # the replica in use goes away
                stop_at = loop.time()
            try:
                columns = await client.query(MODEL, {4: chain})
                assert list(columns.matched_blocks) == [4]
            except (TimeoutError, grpc.aio.AioRpcError):
                failures.append(loop.time())
            await asyncio.sleep(0.002)
        assert client.address == f"127.0.0.1:{b.port}" and client.failovers >= 1
        # Only queries inside one deadline after the fault failed open (stop(0) itself takes a moment).
        late = [t - stop_at for t in failures if t - stop_at > DEADLINE_S + 0.05]
        assert not late, f"failed queries {late} s after the replica stopped"
        assert client.session.connected
    finally:
        await client.close()
        await agent.close()
        await a.stop(0)
        await b.stop(0)
