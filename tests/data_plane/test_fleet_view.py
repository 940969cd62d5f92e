"""A router's view of the fleet (`ControlPlane.Follow` into `FleetView`) against a real control plane
over real sockets: it equals the control plane's state after every change, resumes without a
snapshot, resynchronises when it fell behind or got a change it cannot apply, survives a control-plane
restart, and under mTLS only a router identity may follow."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.fleet.changes import MalformedChange
from kvroute.fleet.entries import pack_keys
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import TIERS
from kvroute.tools.redis_harness import TcpProxy
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import MODEL, AgentStream, BidiStream, eventually, removed, stored

BS = 4


def digest(state: FleetState) -> dict:
    """Everything a decision reads of a state, keyed by worker id (slots differ between processes)."""
    out: dict = {}
    inflight = state.inflight
    for r in state.registry.workers():
        load = r.load
        out[r.worker_id] = (
            r.model,
            r.block_size,
            r.endpoint,
            r.lora_adapters,
            r.data_parallel_rank,
            r.role,
            (load.running_requests, load.waiting_requests, round(load.kv_usage, 6), load.kv_capacity_tokens),
            tuple(tuple(sorted(state.index.worker_keys(r.slot, tier))) for tier in TIERS),
            inflight.reserved_by_others(r.slot, None),
        )
    out["_routers"] = sorted(
        (
            router_id,
            tally.sessions,
            tuple(sorted((state.registry.at_slot(slot).worker_id, n) for slot, n in tally.requests.items())),
        )
        for router_id, tally in inflight.routers.items()
    )
    return out


def speculative(state: FleetState, chain: list[int]) -> dict[str, int]:
    match = state.index.match_tiers(chain)
    return {state.registry.at_slot(slot).worker_id: n for slot, n in match.speculative_blocks.items()}


@pytest.fixture
async def control_plane():
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=30))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield server, pb_grpc.ControlPlaneStub(channel), port
    await channel.close()
    await server.stop(0)


async def following(address: str, router_id: str = "follower", **view_options) -> tuple[ControlPlaneClient, FleetView]:
    view = FleetView(router_id, **view_options)
    client = ControlPlaneClient(address, use_session=False, view=view)
    client.start()
    await eventually(lambda: view.synced, 10, what="the view's first snapshot")
    return client, view


async def caught_up(server: ControlPlaneServer, view: FleetView) -> None:
    await eventually(
        lambda: view.position is not None and view.position.seq == server.feed.seq, 10, what="the view at the feed's position"
    )


class RouterStream(BidiStream):
    def __init__(self, stub: pb_grpc.ControlPlaneStub, router_id: str) -> None:
        super().__init__(stub.RouterSession, pb.RouterMessage)
        self.router_id = router_id

    async def hello(self) -> None:
        await self.send(hello=pb.RouterHello(router_id=self.router_id))
        await self.recv()


async def test_the_view_equals_the_control_plane_after_every_change(control_plane) -> None:
    server, stub, port = control_plane
    rng = random.Random(7)
    agents: dict[str, tuple[AgentStream, int]] = {}
    for i in range(3):
        agent = AgentStream(stub)
        await agent.register(f"w{i}", block_size=BS, lora_adapters=["ad"] if i == 0 else [], role=("prefill", "decode", "")[i])
        agents[f"w{i}"] = (agent, 0)
    client, view = await following(f"127.0.0.1:{port}")
    routers = [RouterStream(stub, "r1"), RouterStream(stub, "r2")]
    for r in routers:
        await r.hello()
    chains = [prompt_block_keys(list(range(p * 100, p * 100 + 8 * BS)), BS, MODEL) for p in range(6)]
    live: list[tuple[RouterStream, int]] = []
    next_reservation = 1
    try:
        for step in range(120):
            action = rng.random()
            worker = rng.choice(sorted(agents))
            agent, seq = agents[worker]
            chain = rng.choice(chains)
            if action < 0.35:
                await agent.batch(seq + 1, stored(chain[: rng.randint(1, 8)], rng.choice([0, 0, 1, 2])))
                agents[worker] = (agent, seq + 1)
            elif action < 0.5:
                await agent.batch(seq + 1, removed(chain[rng.randint(0, 7) :], rng.choice([0, 1])))
                agents[worker] = (agent, seq + 1)
            elif action < 0.55:
                await agent.batch(seq + 1, pb.BlockEvent(cleared=pb.AllBlocksCleared()))
                agents[worker] = (agent, seq + 1)
            elif action < 0.65:
                await agent.send(
                    heartbeat=pb.Heartbeat(
                        load=pb.WorkerLoad(
                            running_requests=rng.randint(0, 9),
                            waiting_requests=rng.randint(0, 3),
                            kv_usage=rng.random(),
                            kv_capacity_tokens=rng.choice([0, 16_384, 1 << 20]),
                        ),
                        lora_adapters=rng.choice([[], ["ad"], ["ad", "other"]]),
                    )
                )
            elif action < 0.85 or not live:
                router = rng.choice(routers)
                await router.send(
                    reserve=pb.Reservation(
                        reservation_id=next_reservation,
                        worker_id=worker,
                        block_size=BS,
                        block_keys=chain,
                        prefill_tokens=rng.randint(1, 64),
                        prompt_tokens=len(chain) * BS,
                    )
                )
                live.append((router, next_reservation))
                next_reservation += 1
            else:
                router, reservation = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.5:
                    await router.send(prefill_done=pb.ReservationDone(reservation_id=reservation))
                    live.append((router, reservation))
                else:
                    await router.send(release=pb.ReservationDone(reservation_id=reservation))
            if step % 40 == 39:  # a router goes away: its session and reservations with it
                gone = routers.pop(0)
                await gone.close()
                live = [(r, n) for r, n in live if r is not gone]
                routers.append(RouterStream(stub, f"r{step}"))
                await routers[-1].hello()
            await eventually(lambda: server.feed.seq > 0, 5)
            await caught_up(server, view)
            assert digest(view.state) == digest(server.state), f"step {step}"
            for chain_ in chains:
                assert speculative(view.state, chain_) == speculative(server.state, chain_), f"step {step}"
        assert view.counters.snapshots == 1 and view.counters.malformed == 0
    finally:
        for r in routers:
            await r.close()
        for agent, _ in agents.values():
            await agent.close()
        await client.close()


async def test_a_follower_resumes_after_a_cut_without_a_snapshot(control_plane) -> None:
    server, stub, port = control_plane
    agent = AgentStream(stub)
    await agent.register("w0", block_size=BS)
    proxy = TcpProxy(port).start()
    client, view = await following(f"127.0.0.1:{proxy.port}")
    try:
        chain = prompt_block_keys(list(range(64)), BS, MODEL)
        await agent.batch(1, stored(chain[:4]))
        await caught_up(server, view)
        proxy.cut()
        await eventually(lambda: view.counters.stream_failures >= 1, 10, what="the stream cut")
        await agent.batch(2, stored(chain[4:8]))  # applied while the follower is cut off
        proxy.restore()
        await caught_up(server, view)
        assert view.counters.snapshots == 1 and view.counters.resumed >= 1
        assert digest(view.state) == digest(server.state)
    finally:
        await agent.close()
        await client.close()
        proxy.stop()


async def test_a_position_outside_the_window_gets_a_snapshot_and_the_window_is_bounded() -> None:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=30, follow_window_changes=50))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ControlPlaneStub(channel)
    agent = AgentStream(stub)
    await agent.register("w0", block_size=BS)
    try:
        client, view = await following(f"127.0.0.1:{port}")
        await client.close()  # the follower stops reading; the fleet moves on
        for seq in range(1, 121):
            await agent.batch(seq, stored([seq * 7919]))
        assert server.feed.window_size()[0] <= 50
        client = ControlPlaneClient(f"127.0.0.1:{port}", use_session=False, view=view)
        client.start()
        await caught_up(server, view)
        assert view.counters.snapshots == 2 and digest(view.state) == digest(server.state)
        await client.close()
    finally:
        await agent.close()
        await channel.close()
        await server.stop(0)


class ScriptedFollow:
    """A control plane's Follow as a test scripts it: stream i answers with scripts[i] (then stays open)."""

    def __init__(self, scripts: list[list[pb.FollowUpdate]]) -> None:
        self.scripts = scripts
        self.requests: list[pb.FollowRequest] = []

    async def follow(self, request: pb.FollowRequest, context) -> None:
        self.requests.append(request)
        for update in self.scripts[min(len(self.requests), len(self.scripts)) - 1]:
            yield update
        await asyncio.Event().wait()


def _update(seq: int, *changes: pb.FleetChange, begin: bool = False, end: bool = False) -> pb.FollowUpdate:
    return pb.FollowUpdate(
        position=pb.FollowPosition(feed_id="scripted", seq=seq), snapshot_begin=begin, snapshot_end=end, changes=list(changes)
    )


def _joined(worker_id: str) -> pb.FleetChange:
    return pb.FleetChange(
        joined=pb.WorkerJoined(worker_id=worker_id, model=MODEL, engine="sim", block_size=BS, endpoint=f"http://{worker_id}")
    )


def _blocks(worker_id: str, data: bytes) -> pb.FleetChange:
    return pb.FleetChange(
        blocks=pb.WorkerBlocks(
            worker_id=worker_id, seq=1, ops=[pb.PackedBlockOp(kind=pb.BLOCKS_STORED, tier=pb.TIER_GPU, keys=data)]
        )
    )


async def test_a_malformed_change_is_refused_counted_and_the_view_resynchronises() -> None:
    script = ScriptedFollow(
        [
            [_update(1, _joined("w0"), begin=True, end=True), _update(2, _blocks("w0", b"\x01" * 7))],  # 7 bytes: no key
            [_update(5, _joined("w1"), _blocks("w1", pack_keys([11, 12])), begin=True, end=True)],
        ]
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "kvroute.v1.ControlPlane",
                {
                    "Follow": grpc.unary_stream_rpc_method_handler(
                        script.follow, pb.FollowRequest.FromString, pb.FollowUpdate.SerializeToString
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    view = FleetView("follower")
    client = ControlPlaneClient(f"127.0.0.1:{port}", use_session=False, view=view)
    client.start()
    try:
        await eventually(lambda: view.counters.snapshots == 2, 10, what="the second snapshot")
        assert view.counters.malformed == 1
        assert not script.requests[1].HasField("resume_after")  # it asked for a snapshot, not a resume
        assert sorted(r.worker_id for r in view.state.registry.workers()) == ["w1"]
        record = view.state.registry.get("w1")
        assert view.state.index.worker_keys(record.slot, TIERS[0]) == {11, 12}
    finally:
        await client.close()
        await server.stop(0)


def test_each_kind_of_malformed_change_is_refused_before_it_changes_anything() -> None:
    view = FleetView("follower")
    view.apply_update(_update(1, _joined("w0"), begin=True, end=True))
    before = digest(view.state)
    bad = [
        _blocks("w0", b"\x00" * 9),
        _blocks("nobody", pack_keys([1])),
        pb.FleetChange(blocks=pb.WorkerBlocks(worker_id="w0", ops=[pb.PackedBlockOp(kind=7, keys=pack_keys([1]))])),
        pb.FleetChange(heartbeat=pb.WorkerHeartbeat(worker_id="w0", load=pb.WorkerLoad(kv_usage=2.0))),
        pb.FleetChange(router=pb.RouterChange(kind=pb.ROUTER_RESERVED, origin="x", session=1, worker_id="w0")),
        pb.FleetChange(joined=pb.WorkerJoined(worker_id="w1", model=MODEL)),
        pb.FleetChange(),
    ]
    for change in bad:
        with pytest.raises(MalformedChange):
            view.apply_update(_update(2, change))
        assert digest(view.state) == before, change


async def test_a_control_plane_restart_mid_stream_resynchronises_the_view_and_the_old_one_serves_meanwhile() -> None:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=30))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    agent = AgentStream(pb_grpc.ControlPlaneStub(channel))
    await agent.register("w0", block_size=BS)
    await agent.batch(1, stored([1, 2, 3]))
    client, view = await following(f"127.0.0.1:{port}")
    try:
        await caught_up(server, view)
        await agent.close()
        await channel.close()
        await server.stop(0)
        await eventually(lambda: view.counters.stream_failures >= 1, 10, what="the stream lost")
        assert view.unusable_reason() == "" and view.answer(MODEL, {BS: [1, 2, 3]})[0].matched_blocks == [3]
        server = ControlPlaneServer(ControlPlaneConfig(listen=f"127.0.0.1:{port}", heartbeat_timeout_s=30))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        agent = AgentStream(pb_grpc.ControlPlaneStub(channel))
        await agent.register("w9", block_size=BS)
        await eventually(lambda: view.counters.snapshots == 2, 10, what="a snapshot of the new control plane")
        await caught_up(server, view)
        assert digest(view.state) == digest(server.state) and list(digest(view.state)) == ["w9", "_routers"]
    finally:
        await agent.close()
        await channel.close()
        await client.close()
        await server.stop(0)


async def test_with_every_control_plane_gone_the_view_serves_until_it_is_stale() -> None:
    clock = [1000.0]
    view = FleetView("follower", max_stale_s=60.0, clock=lambda: clock[0])
    view.apply_update(_update(1, _joined("w0"), _blocks("w0", pack_keys([1, 2])), begin=True, end=True))
    assert view.answer(MODEL, {BS: [1, 2]})[0].matched_blocks == [2]
    clock[0] += 59.0
    assert view.answer(MODEL, {BS: [1, 2]})[0].matched_blocks == [2]
    clock[0] += 2.0
    assert view.answer(MODEL, {BS: [1, 2]}) == (None, "the view of the fleet is stale (no control plane heard from)")
    view.apply_update(_update(2))  # a keepalive: heard again
    assert view.answer(MODEL, {BS: [1, 2]})[0].matched_blocks == [2]


async def test_a_router_s_own_sessions_are_left_out_of_its_view(control_plane) -> None:
    """It knows its own requests exactly (RouterInflight) and leaves them out of its answers: the
    control plane does not echo them back to it (`leave_out_own`), and still sends every other router's."""
    server, stub, port = control_plane
    agent = AgentStream(stub)
    await agent.register("w0", block_size=BS)
    me, other = RouterStream(stub, "me"), RouterStream(stub, "other")
    for router in (me, other):
        await router.hello()
    view = FleetView("me")
    view.knows_own = True
    client = ControlPlaneClient(f"127.0.0.1:{port}", use_session=False, view=view)
    client.start()
    try:
        await eventually(lambda: view.synced, 10, what="the view's first snapshot")
        for router in (me, other):
            await router.send(
                reserve=pb.Reservation(reservation_id=1, worker_id="w0", block_size=BS, block_keys=[7, 8], prefill_tokens=32)
            )
        await eventually(lambda: server.state.inflight.reservation_count() == 2, 10, what="both reservations")
        await caught_up(server, view)
        assert sorted(server.state.inflight.routers) == ["me", "other"]
        assert sorted(view.state.inflight.routers) == ["other"]
        assert view.state.inflight.reserved_by_others(view.state.registry.get("w0").slot, None) == (1, 32)
    finally:
        for stream in (me, other, agent):
            await stream.close()
        await client.close()
