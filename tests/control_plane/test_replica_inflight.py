"""Reservations made by a router on one replica are seen by queries answered on another, and go away
when released, when the router closes its session, and when its replica falls silent."""

from __future__ import annotations

import asyncio

import grpc

from kvroute.data_plane.router_session import RouterSessionLink
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import eventually
from tests.replica_helpers import MODEL, Agent, start_replica


async def test_reservations_cross_replicas(redis_any) -> None:
    a, b = await start_replica(redis_any, "a"), await start_replica(redis_any, "b")
    b.inflight_sync.silent_after_s = 0.5
    agent = Agent(f"127.0.0.1:{a.port}")
    channel_a = grpc.aio.insecure_channel(f"127.0.0.1:{a.port}")
    channel_b = grpc.aio.insecure_channel(f"127.0.0.1:{b.port}")
    link = RouterSessionLink(pb_grpc.ControlPlaneStub(channel_a), "router-1")
    stub_b = pb_grpc.ControlPlaneStub(channel_b)
    try:
        await eventually(lambda: agent.link.connected)
        agent.store_chain(4)
        await eventually(agent.settled)
        chain = list(agent.resolver.held_keys()) + [111, 222]  # the prompt runs 2 blocks past what w1 holds
        await eventually(lambda: b.registry.get("w1") is not None)
        link.start()
        assert await link.wait_connected(5)
        seen = {}

        async def seen_on_b() -> pb.WorkerMatch:
            reply = await stub_b.Query(pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4,
                                                                                          block_keys=chain)]))
            seen["w1"] = reply.workers[0]
            return reply.workers[0]

        async def wait_b(predicate, timeout_s: float = 5.0) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while loop.time() < deadline:
                if predicate(await seen_on_b()):
                    return
                await asyncio.sleep(0.005)
            raise AssertionError(f"b never saw it: {seen}")

        first = link.reserve("w1", 4, chain, prefill_tokens=24, prompt_tokens=24)
        await wait_b(lambda w: w.reserved_requests == 1 and w.matched_blocks == 6 and w.speculative_blocks == 2)
        assert seen["w1"].reserved_prefill_tokens == 8  # only the 2 blocks w1 does not hold are prefilled
        link.prefill_done(first)
        await wait_b(lambda w: w.reserved_requests == 1 and w.reserved_prefill_tokens == 0)
        link.release(first)
        await wait_b(lambda w: w.reserved_requests == 0 and w.speculative_blocks == 0)
        # A router whose session closes takes its reservations with it.
        link.reserve("w1", 4, chain, prefill_tokens=24)
        await wait_b(lambda w: w.reserved_requests == 1)
        await link.close()
        await eventually(lambda: a.inflight.reservation_count() == 0, what="a dropped the closed session's reservation")
        await wait_b(lambda w: w.reserved_requests == 0)
        # A replica that goes away silently: the others drop its routers' reservations.
        link = RouterSessionLink(pb_grpc.ControlPlaneStub(channel_a), "router-2")
        link.start()
        assert await link.wait_connected(5)
        link.reserve("w1", 4, chain, prefill_tokens=24)
        await wait_b(lambda w: w.reserved_requests == 1)
        await a.inflight_sync.stop()  # a stops publishing (its beats too), as if cut off
        await wait_b(lambda w: w.reserved_requests == 0)
        assert b.inflight_sync.counters.dropped_silent_replicas == 1
        assert b.metrics_registry.get_sample_value("kvroute_cp_inflight_sync_events_total",
                                                   {"event": "dropped_silent_replicas"}) == 1
        assert b.metrics_registry.get_sample_value("kvroute_cp_redis_ready") == 1
    finally:
        await link.close()
        await agent.close()
        await channel_a.close()
        await channel_b.close()
        await a.stop(0)
        await b.stop(0)
