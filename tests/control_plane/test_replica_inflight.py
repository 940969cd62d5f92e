"""Reservations made by a router on one replica are seen by queries answered on another, and go away
when released, when the router closes its session, and when its replica falls silent; a replica
started later holds them too (from the others' state entries), and ops for sessions a replica does
not mirror are counted."""

from __future__ import annotations

import asyncio
import logging

import grpc
import msgspec
from redis.asyncio import Redis

from kvroute.control_plane.replication.inflight_sync import (
    BEAT,
    OPEN,
    RESERVE,
    STREAM,
    HeldReservation,
    HeldSession,
    RouterOp,
)
from kvroute.control_plane.replication.redis_log import parse_id
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link.router_session import RouterSessionLink
from kvroute.fleet.entries import pack_keys
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
        chain = await agent.chain_past_held()  # the prompt runs 2 blocks past what w1 holds
        await eventually(lambda: b.registry.get("w1") is not None)
        link.start()
        assert await link.wait_connected(5)
        seen = {}

        async def seen_on_b() -> pb.WorkerMatch:
            reply = await stub_b.Query(pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=chain)]))
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
        assert (
            b.metrics_registry.get_sample_value("kvroute_cp_inflight_sync_events_total", {"event": "dropped_silent_replicas"})
            == 1
        )
        assert b.metrics_registry.get_sample_value("kvroute_cp_redis_ready") == 1
    finally:
        await link.close()
        await agent.close()
        await channel_a.close()
        await channel_b.close()
        await a.stop(0)
        await b.stop(0)


async def query_w1(stub: pb_grpc.ControlPlaneStub, chain: list[int]) -> pb.WorkerMatch:
    reply = await stub.Query(pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=chain)]))
    return next(w for w in reply.workers if w.worker_id == "w1")


async def test_a_replica_started_later_holds_the_live_reservations_and_nothing_released(redis_any) -> None:
    a = await start_replica(redis_any, "a", speculative_ttl_s=60.0)
    agent = Agent(f"127.0.0.1:{a.port}")
    channel_a = grpc.aio.insecure_channel(f"127.0.0.1:{a.port}")
    link = RouterSessionLink(pb_grpc.ControlPlaneStub(channel_a), "router-1")
    c = channel_c = None
    try:
        chain = await agent.chain_past_held()
        link.start()
        assert await link.wait_connected(5)
        claiming = link.reserve("w1", 4, chain, prefill_tokens=24, prompt_tokens=24)
        released = link.reserve("w1", 4, [], prefill_tokens=100)
        started = link.reserve("w1", 4, [], prefill_tokens=50)
        link.prefill_done(started)
        link.release(released)
        await eventually(lambda: a.inflight.reservation_count() == 2, what="a holds the 2 live reservations")
        states = a.inflight_sync.counters.states_published  # a state entry goes after the ops in a's outbox
        await eventually(lambda: a.inflight_sync.counters.states_published > states, what="a published the ops")
        redis = a.inflight_sync.redis
        done_ms = parse_id((await redis.xrevrange(STREAM, count=1))[0][0])[0]

        async def ops_out_of_replay() -> bool:  # as a router session is, opened long before
            head_ms = parse_id((await redis.xrevrange(STREAM, count=1))[0][0])[0]
            return head_ms - done_ms > a.inflight_sync.replay_s * 1000

        await eventually(ops_out_of_replay, 20, interval=0.1, what="a's ops older than a replay reads")
        c = await start_replica(redis_any, "c")  # ready: the log, then the router sessions replayed
        channel_c = grpc.aio.insecure_channel(f"127.0.0.1:{c.port}")
        stub_c = pb_grpc.ControlPlaneStub(channel_c)

        async def c_sees(requests: int, prefill: int, speculative: int) -> bool:
            w = await query_w1(stub_c, chain)
            return (w.reserved_requests, w.reserved_prefill_tokens, w.speculative_blocks) == (requests, prefill, speculative)

        # The released one stays gone, the started one's prefill is done, the claims are restored.
        await eventually(lambda: c_sees(2, 8, 2), 10, what="c holds a's 2 live reservations")
        assert (c.inflight_sync.counters.restored_sessions, c.inflight_sync.counters.restored_reservations) == (1, 2)
        assert c.inflight_sync.counters.unknown_worker == 0  # the registry was loaded before the replay
        link.release(claiming)  # c follows the restored session's next ops
        await eventually(lambda: c_sees(1, 0, 0), 10, what="c applied the release")
        await link.close()
        await eventually(lambda: c_sees(0, 0, 0), 10, what="c dropped the closed session")
        assert c.inflight_sync.counters.unknown_session == 0
    finally:
        await link.close()
        await agent.close()
        for channel in (channel_a, channel_c):
            if channel is not None:
                await channel.close()
        for server in (a, c):
            if server is not None:
                await server.stop(0)


def ghost_entry(*ops: RouterOp, state: list[HeldSession] | None = None) -> dict[str, bytes]:
    """A stream entry as a replica "ghost" writes it."""
    encode = msgspec.msgpack.encode
    return {"r": b"ghost", "d": encode(list(ops))} | ({"s": encode(state)} if state is not None else {})


async def test_state_entries_restore_and_drop_and_ops_for_unknown_sessions_are_counted(redis_single, caplog) -> None:
    b = await start_replica(redis_single.url, "b")
    b.inflight_sync.silent_after_s = 600.0  # the ghost replica writes no beats
    agent = Agent(f"127.0.0.1:{b.port}")
    redis = Redis.from_url(redis_single.url)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{b.port}")
    stub = pb_grpc.ControlPlaneStub(channel)
    sync = b.inflight_sync
    try:
        chain = await agent.chain_past_held()
        reserve = RouterOp(RESERVE, "router-g", 1, 1, "w1", 4, b"", 8)
        # Before the ghost's first state: its state covers what came before it, nothing to report.
        await redis.xadd(STREAM, ghost_entry(reserve))
        await eventually(lambda: sync.counters.before_state == 1)
        await redis.xadd(STREAM, ghost_entry(state=[]))
        await eventually(lambda: sync.counters.states_applied == 1)
        with caplog.at_level(logging.WARNING, logger="kvroute.control_plane.inflight_sync"):
            await redis.xadd(STREAM, ghost_entry(reserve))
            await eventually(lambda: sync.counters.unknown_session == 1)
        assert "reserve for router router-g's session 1, which this replica does not mirror" in caplog.text
        assert b.metrics_registry.get_sample_value("kvroute_cp_inflight_sync_events_total", {"event": "unknown_session"}) == 1
        # Its next state repairs it: the session and its reservation (load and claims) are restored.
        held = HeldReservation(1, "w1", 4, 8, 60_000, 60_000, pack_keys([111, 222]))
        await redis.xadd(STREAM, ghost_entry(state=[HeldSession("router-g", 1, [held])]))
        w = await eventually(lambda: query_matching(stub, chain, lambda w: w.reserved_requests == 1))
        assert (w.reserved_prefill_tokens, w.speculative_blocks) == (8, 2)
        # A state no longer holding the reservation, then the session, drops them.
        await redis.xadd(STREAM, ghost_entry(state=[HeldSession("router-g", 1, [])]))
        await eventually(lambda: query_matching(stub, chain, lambda w: w.reserved_requests == 0 and not w.speculative_blocks))
        await redis.xadd(STREAM, ghost_entry(state=[]))
        await eventually(lambda: b.inflight.open_sessions == 0, what="b dropped the session no state holds")
        assert sync.counters.dropped_by_state == 2 and sync.counters.restored_reservations == 1
    finally:
        await agent.close()
        await channel.close()
        await redis.aclose()
        await b.stop(0)


async def query_matching(stub: pb_grpc.ControlPlaneStub, chain: list[int], predicate) -> pb.WorkerMatch | None:
    w = await query_w1(stub, chain)
    return w if predicate(w) else None


async def test_a_replayed_state_brings_back_nothing_expired_meanwhile(redis_single) -> None:
    """Ages in a state are what was left when it was written; the replay takes off the time since,
    by the stream ids (Redis' clock): a reservation past its max age, or claims past their TTL, stay gone."""
    a = await start_replica(redis_single.url, "a")
    agent = Agent(f"127.0.0.1:{a.port}")
    redis = Redis.from_url(redis_single.url)
    c = channel = None
    try:
        chain = await agent.chain_past_held()
        at_ms = parse_id((await redis.xrevrange(STREAM, count=1))[0][0])[0] + 1
        state = [
            HeldSession(
                "router-g",
                1,
                [
                    HeldReservation(1, "w1", 4, 10, max_age_ms=500),  # expired since
                    HeldReservation(
                        2,
                        "w1",
                        4,
                        20,
                        max_age_ms=60_000,
                        claim_ttl_ms=500,  # its claims expired since
                        keys=pack_keys([111]),
                    ),
                    HeldReservation(3, "w1", 4, 40, max_age_ms=60_000, claim_ttl_ms=60_000, keys=pack_keys([111, 222])),
                ],
            )
        ]
        # Written at at_ms; the stream's head is 2 s later (ids fix the times the replay computes with).
        await redis.xadd(STREAM, ghost_entry(state=state), id=f"{at_ms}-0")
        await redis.xadd(STREAM, ghost_entry(RouterOp(BEAT)), id=f"{at_ms + 2000}-0")
        c = ControlPlaneServer(
            ControlPlaneConfig(
                listen="127.0.0.1:0", redis_url=redis_single.url, replica_id="c", redis_shards=4, heartbeat_timeout_s=2.0
            )
        )
        c.inflight_sync.silent_after_s = 600.0  # the ghost replica writes no beats
        await c.start()
        await eventually(lambda: c.ready, 10, what="c ready")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{c.port}")
        w = await query_w1(pb_grpc.ControlPlaneStub(channel), chain)
        assert (w.reserved_requests, w.reserved_prefill_tokens, w.speculative_blocks) == (2, 60, 2)
        assert (c.inflight_sync.counters.restored_sessions, c.inflight_sync.counters.restored_reservations) == (1, 2)
    finally:
        await agent.close()
        if channel is not None:
            await channel.close()
        await redis.aclose()
        for server in (a, c):
            if server is not None:
                await server.stop(0)


async def test_the_router_sessions_gauge_tells_local_streams_from_mirrored_ones(redis_single) -> None:
    a, b = await start_replica(redis_single.url, "a"), await start_replica(redis_single.url, "b")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{a.port}")
    link = RouterSessionLink(pb_grpc.ControlPlaneStub(channel), "router-1")

    def sessions(replica: ControlPlaneServer) -> tuple[float | None, float | None]:
        return tuple(
            replica.metrics_registry.get_sample_value("kvroute_cp_router_sessions", {"origin": origin})
            for origin in ("local", "replica")
        )

    try:
        assert sessions(a) == sessions(b) == (0, 0)
        link.start()
        assert await link.wait_connected(5)
        await eventually(lambda: b.inflight.open_sessions == 1, what="b mirrors router-1's session")
        assert sessions(a) == (1, 0)
        assert sessions(b) == (0, 1)  # a mirrored session is no stream of b's
        await link.close()
        await eventually(lambda: sessions(b) == (0, 0), what="b dropped the closed session")
        assert sessions(a) == (0, 0)
    finally:
        await link.close()
        await channel.close()
        await a.stop(0)
        await b.stop(0)


async def test_a_router_that_moved_counts_once_while_its_old_replica_still_holds_it(redis_single) -> None:
    """router-1 moves from a to b while a still holds its old stream (half-open): b's open drops the
    old session everywhere, and a's later states, which still hold it, do not bring it back."""
    a, b, c = [await start_replica(redis_single.url, name) for name in "abc"]
    agent = Agent(f"127.0.0.1:{a.port}")
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in (a, b, c)]
    old = RouterSessionLink(pb_grpc.ControlPlaneStub(channels[0]), "router-1")
    new = RouterSessionLink(pb_grpc.ControlPlaneStub(channels[1]), "router-1")
    try:
        await eventually(lambda: agent.link.connected)
        await eventually(lambda: all(r.registry.get("w1") for r in (a, b, c)), what="w1 known everywhere")
        old.start()
        assert await old.wait_connected(5)
        first = old.reserve("w1", 4, [], prefill_tokens=8)
        await eventually(lambda: b.inflight.reservation_count() == c.inflight.reservation_count() == 1)
        new.start()  # the same router on b, re-sending its reservation; its stream on a stays open
        assert await new.wait_connected(5)
        new.reserve("w1", 4, [], prefill_tokens=8)
        await eventually(lambda: b.inflight.reservation_count() == c.inflight.reservation_count() == 1)
        applied = {r: r.inflight_sync.counters.states_applied for r in (b, c)}
        await eventually(
            lambda: all(r.inflight_sync.counters.states_applied >= n + 4 for r, n in applied.items()),
            20,
            what="two rounds of states from the other replicas",
        )
        for replica in (b, c):
            assert replica.inflight.reservation_count() == 1, replica.replica_id
            assert replica.inflight_sync.counters.restored_sessions == 0, replica.replica_id
        assert a.inflight.reservation_count() == 2  # a holds both: its own stream and b's mirror
        old.release(first)  # on the old stream: for b and c an op of a superseded session, nothing lost
        await eventually(lambda: all(r.inflight_sync.counters.superseded == 1 for r in (b, c)))
        assert all(r.inflight_sync.counters.unknown_session == 0 for r in (b, c))
    finally:
        await old.close()
        await new.close()
        await agent.close()
        for channel in channels:
            await channel.close()
        for replica in (a, b, c):
            await replica.stop(0)


async def test_a_restarted_replica_is_mirrored_again_while_its_router_holds_a_session_elsewhere(redis_single) -> None:
    """router-1 holds a stream on b and a later one on "ghost"; ghost restarts (same id, sessions
    numbered from 1 again) and its open of router-1's new session never arrives: its states bring
    that session to b all the same."""
    b = await start_replica(redis_single.url, "b")
    b.inflight_sync.silent_after_s = 600.0  # the ghost replica writes no beats
    agent = Agent(f"127.0.0.1:{b.port}")
    redis = Redis.from_url(redis_single.url)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{b.port}")
    link = RouterSessionLink(pb_grpc.ControlPlaneStub(channel), "router-1")
    try:
        await agent.chain_past_held()
        link.start()
        assert await link.wait_connected(5)
        await redis.xadd(STREAM, ghost_entry(RouterOp(OPEN, "router-1", 7)))
        await eventually(lambda: b.inflight.open_sessions == 2, what="b mirrors ghost's session 7")
        await redis.xadd(STREAM, ghost_entry(state=[]))  # ghost's first entry after its restart
        held = HeldReservation(1, "w1", 4, 8, max_age_ms=60_000)
        await redis.xadd(STREAM, ghost_entry(state=[HeldSession("router-1", 1, [held])]))
        await eventually(lambda: b.inflight.reservation_count() == 1, what="b restored ghost's new session")
        assert b.inflight.open_sessions == 2
    finally:
        await link.close()
        await agent.close()
        await channel.close()
        await redis.aclose()
        await b.stop(0)
