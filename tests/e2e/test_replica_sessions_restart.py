"""A control-plane replica killed -9 and restarted knows the router sessions the other replicas held
before it started: a router on it sees the other router's reservation again (its load and its
speculative claims), and follows what that router does next; the other router sees the re-sent one.

Real replica processes over a real Redis; the two routers are RouterSession clients, each pinned to
one replica, the worker an in-process agent on replica A."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvroute.data_plane.cp_link.router_session import RouterSessionLink, SessionUnavailable
from kvroute.tools.redis_harness import RedisServer
from kvroute.tools.replica_cluster import ReplicaCluster
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import eventually
from tests.replica_helpers import MODEL, Agent

pytestmark = pytest.mark.e2e

# From the restarted replica's readiness to the other router's reservation being visible on it:
# immediate by design; generous for a busy machine, far below the claims' TTL and the max age.
VISIBLE_WITHIN_S = 15.0


async def seen_by(link: RouterSessionLink, chain: list[int]) -> pb.WorkerMatch | None:
    """w1 as `link`'s router sees it (other routers' reservations and claims), None while its
    session is down."""
    message = pb.RouterMessage(query=pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=chain)]))
    try:
        reply = await link.query(message, 2.0)
    except (SessionUnavailable, TimeoutError):
        return None
    return next((w for w in reply.workers if w.worker_id == "w1"), None)


async def test_a_restarted_replica_sees_the_sessions_opened_before_it(tmp_path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    # No engines or HTTP routers here: the tokenizer directory is never read.
    cluster = ReplicaCluster(workdir=tmp_path, tokenizer_dir=tmp_path)
    agent = link1 = link2 = None
    channels: list[grpc.aio.Channel] = []
    try:
        # Claims live long enough to outlast the restart: their restore is part of what is checked.
        await asyncio.to_thread(cluster.start_replicas, redis.port, 2, "--speculative-ttl-ms", "120000")
        a, b = (r.address for r in cluster.replicas)
        agent = Agent(a)
        chain = await agent.chain_past_held(20)  # 2 blocks past what w1 holds: claims
        channels = [grpc.aio.insecure_channel(a), grpc.aio.insecure_channel(b)]
        link1 = RouterSessionLink(pb_grpc.ControlPlaneStub(channels[0]), "router-1", max_reconnect_delay_s=0.5)
        link2 = RouterSessionLink(pb_grpc.ControlPlaneStub(channels[1]), "router-2", max_reconnect_delay_s=0.5)
        link1.start()
        link2.start()
        assert await link1.wait_connected(20) and await link2.wait_connected(20)

        async def sees(link: RouterSessionLink, requests: int, speculative: int | None = None) -> bool:
            w = await seen_by(link, chain)
            return (
                w is not None and w.reserved_requests == requests and (speculative is None or w.speculative_blocks == speculative)
            )

        first = link1.reserve("w1", 4, chain, prefill_tokens=24, prompt_tokens=24)
        await eventually(lambda: sees(link2, 1, 2), 20, what="router-2 (on B) sees router-1's reservation")
        link2.reserve("w1", 4, [], prefill_tokens=8)
        await eventually(lambda: sees(link1, 1), 20, what="router-1 (on A) sees router-2's reservation")

        cluster.kill_replica(1)
        await eventually(lambda: not link2.connected, 20, what="router-2 lost B")
        cluster.restart_replica(1)
        await asyncio.to_thread(cluster.wait_replica_ready, 1, 60)
        await eventually(lambda: link2.connected and link2.sessions >= 2, 30, what="router-2 back on B")
        await eventually(
            lambda: sees(link2, 1, 2),
            VISIBLE_WITHIN_S,
            what="router-2 (on the restarted B) sees router-1's reservation and its claims",
        )
        await eventually(lambda: sees(link1, 1), 20, what="router-1 sees router-2's re-sent reservation")
        # The restored session is router-1's own: what it does next applies on B.
        link1.release(first)
        await eventually(lambda: sees(link2, 0, 0), 20, what="B applied router-1's release")
    finally:
        for link in (link1, link2):
            if link is not None:
                await link.close()
        if agent is not None:
            await agent.close()
        for channel in channels:
            await channel.close()
        await asyncio.to_thread(cluster.stop)
        redis.stop()
