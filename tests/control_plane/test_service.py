"""ControlPlane gRPC service over a real socket: register, events per tier, acks, query, adapters,
data-parallel ranks, GetWorkerKeys, liveness."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import grpc
import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import MODEL, AgentStream, BidiStream, eventually, removed, stored


@pytest.fixture
async def control_plane():
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=0.6))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield server, pb_grpc.ControlPlaneStub(channel)
    await channel.close()
    await server.stop(0)


def tier_keys(response: pb.GetWorkerKeysResponse) -> dict[str, list[int]]:
    return {pb.Tier.Name(t.tier).removeprefix("TIER_").lower(): list(t.block_keys) for t in response.tiers}


def query(keys: list[int], block_size: int = 4, **fields) -> pb.QueryRequest:
    return pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=block_size, block_keys=keys)], **fields)


def matches(response: pb.QueryResponse) -> dict[str, tuple[int, int, int]]:
    """worker -> (matched, cpu, disk) blocks"""
    return {w.worker_id: (w.matched_blocks, w.cpu_blocks, w.disk_blocks) for w in response.workers}


async def test_events_update_query_answers(control_plane) -> None:
    _, stub = control_plane
    tokens = list(range(1, 17))  # 4 blocks of 4
    keys = prompt_block_keys(tokens, 4, MODEL)
    a, b = AgentStream(stub), AgentStream(stub)
    registered = await a.register("a")
    assert registered.registered.worker_id == "a" and registered.registered.heartbeat_timeout_ms == 600
    await b.register("b")
    ack = await a.batch(1, stored(keys), snapshot=True)
    assert ack.ack.seq == 1 and ack.ack.applied_events == 1
    await b.batch(1, stored(keys[:2]))
    response = await stub.Query(query(keys))
    assert {w.worker_id: w.matched_blocks for w in response.workers} == {"a": 4, "b": 2}
    await a.batch(2, removed([keys[1]]))
    response = await stub.Query(query(keys))
    assert {w.worker_id: w.matched_blocks for w in response.workers} == {"a": 1, "b": 2}
    await b.batch(2, pb.BlockEvent(cleared=pb.AllBlocksCleared()))
    response = await stub.Query(query(keys))
    assert {w.worker_id: w.matched_blocks for w in response.workers} == {"a": 1, "b": 0}
    # Heartbeat load shows up in answers.
    await a.send(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(running_requests=3, waiting_requests=2)))

    async def load_of_a() -> tuple[int, int]:
        listed = await stub.ListWorkers(pb.ListWorkersRequest(model=MODEL))
        load = {w.worker_id: w for w in listed.workers}["a"].load
        return load.running_requests, load.waiting_requests

    await eventually(lambda: _equals(load_of_a(), (3, 2)), 5, what="a's heartbeat load listed")
    by_id = {w.worker_id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest(model=MODEL))).workers}
    assert by_id["a"].cached_blocks == 3 and by_id["b"].cached_blocks == 0


async def test_block_size_chains_are_matched_per_worker(control_plane) -> None:
    _, stub = control_plane
    tokens = list(range(64))
    small, large = AgentStream(stub), AgentStream(stub)
    await small.register("small", block_size=4)
    await large.register("large", block_size=16)
    await small.batch(1, stored(prompt_block_keys(tokens, 4, MODEL)))
    await large.batch(1, stored(prompt_block_keys(tokens, 16, MODEL)[:2]))
    response = await stub.Query(
        pb.QueryRequest(
            model=MODEL,
            chains=[
                pb.KeyChain(block_size=4, block_keys=prompt_block_keys(tokens, 4, MODEL)),
                pb.KeyChain(block_size=16, block_keys=prompt_block_keys(tokens, 16, MODEL)),
            ],
        )
    )
    assert {w.worker_id: w.matched_blocks for w in response.workers} == {"small": 16, "large": 2}


async def test_sequence_gap_rejects_stream(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    await agent.batch(1, stored([1]))
    await agent.send(batch=pb.EventBatch(seq=3, events=[stored([2])]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.recv()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expected batch seq 2" in err.value.details()


async def test_first_message_must_register(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.send(batch=pb.EventBatch(seq=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.recv()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_second_stream_for_a_live_worker_id_is_refused_and_changes_nothing(control_plane) -> None:
    server, stub = control_plane
    first = AgentStream(stub)
    await first.register("a")
    await first.batch(1, stored([1, 2, 3]))
    generation = server.registry.get("a").generation
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as other_channel:  # another agent, another peer
        second = AgentStream(pb_grpc.ControlPlaneStub(other_channel))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await second.register("a", block_size=8)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    holder_peer = server.registry.get("a").peer
    assert "'a'" in err.value.details() and holder_peer.startswith("ipv4:127.0.0.1:") and holder_peer in err.value.details()
    # The first agent's registration, blocks and stream are as they were.
    record = server.registry.get("a")
    assert (record.generation, record.block_size) == (generation, 4)
    assert (await stub.Query(query([1, 2, 3]))).workers[0].matched_blocks == 3
    assert (await first.batch(2, stored([4]))).ack.seq == 2
    assert (await stub.Query(query([1, 2, 3, 4]))).workers[0].matched_blocks == 4


async def test_reconnect_after_the_stream_ended_keeps_blocks_until_the_snapshot(control_plane) -> None:
    _, stub = control_plane
    old = AgentStream(stub)
    await old.register("a")
    await old.batch(1, stored([1, 2, 3]))
    await old.close()
    assert await old.recv() is grpc.aio.EOF  # the control plane ended the stream: the id is free
    new = AgentStream(stub)
    assert (await new.register("a")).registered.worker_id == "a"
    # Blocks are kept until the snapshot arrives, so routers never see a blank worker in between.
    assert (await stub.Query(query([1, 2, 3]))).workers[0].matched_blocks == 3
    await new.batch(1, stored([1, 9]), snapshot=True)
    assert (await stub.Query(query([1, 2, 3]))).workers[0].matched_blocks == 1


async def test_a_stream_silent_past_the_heartbeat_timeout_is_superseded(control_plane) -> None:
    _, stub = control_plane
    old = AgentStream(stub)
    await old.register("a")
    await old.batch(1, stored([1, 2, 3]))
    # Not a race: the registry's clock alone decides (no heartbeat from `old` can come), so waiting out
    # the 0.6 s timeout is the scenario itself.
    await asyncio.sleep(0.8)  # > 0.6 s heartbeat timeout, the stream still open
    new = AgentStream(stub)
    assert (await new.register("a")).registered.worker_id == "a"
    await new.batch(1, stored([1, 9]), snapshot=True)
    await old.send(batch=pb.EventBatch(seq=2, events=[stored([2])]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await old.recv()
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert (await stub.Query(query([1, 9]))).workers[0].matched_blocks == 2


async def test_silent_worker_is_dropped_with_its_blocks(control_plane) -> None:
    server, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    await agent.batch(1, stored([1, 2]))
    assert len((await stub.ListWorkers(pb.ListWorkersRequest())).workers) == 1
    await eventually(lambda: _equals(listed_count(stub), 0), 5, what="a dropped after the 0.6 s heartbeat timeout")
    assert server.registry.index.entry_count() == 0
    assert (await stub.Query(query([1, 2]))).workers == []


async def test_tiers_are_held_apart_and_matched_together(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    # Snapshot: one BlocksStored per tier (an unset tier is gpu).
    await agent.batch(
        1,
        pb.BlockEvent(stored=pb.BlocksStored(block_keys=[1, 2])),
        stored([3, 4], pb.TIER_CPU),
        stored([4, 5], pb.TIER_DISK),
        snapshot=True,
    )
    assert matches(await stub.Query(query([1, 2, 3, 4, 5, 6]))) == {"a": (5, 2, 1)}
    # An offload: removed from gpu, stored on cpu. Removing a key on one tier keeps the others.
    await agent.batch(2, removed([2]), stored([2], pb.TIER_CPU), removed([4], pb.TIER_CPU))
    assert matches(await stub.Query(query([1, 2, 3, 4, 5]))) == {"a": (5, 2, 2)}
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert keys.worker_id == "a" and keys.block_size == 4
    assert tier_keys(keys) == {"gpu": [1], "cpu": [2, 3], "disk": [4, 5]}
    listed = (await stub.ListWorkers(pb.ListWorkersRequest())).workers[0]
    assert listed.cached_blocks == 1  # the gpu tier
    # A snapshot replaces every tier, including ones it does not name.
    await agent.batch(3, stored([7], pb.TIER_CPU), snapshot=True)
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert tier_keys(keys) == {"gpu": [], "cpu": [7], "disk": []}
    # AllBlocksCleared clears every tier.
    await agent.batch(4, stored([1]), pb.BlockEvent(cleared=pb.AllBlocksCleared()))
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert all(not t.block_keys for t in keys.tiers)


async def test_unknown_tier_is_indexed_as_disk_and_counted(control_plane) -> None:
    server, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    ack = await agent.batch(1, stored([1]), stored([2], 7))  # 7: a tier a newer agent might send
    assert ack.ack.applied_events == 2
    assert matches(await stub.Query(query([1, 2]))) == {"a": (2, 0, 1)}
    assert server.metrics_registry.get_sample_value("kvroute_cp_unknown_medium_events_total") == 1


async def test_get_worker_keys_of_an_unknown_worker_is_not_found(control_plane) -> None:
    _, stub = control_plane
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="nobody"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.value.details()


async def test_lora_queries_see_only_workers_serving_the_adapter(control_plane) -> None:
    _, stub = control_plane
    a, b, c = AgentStream(stub), AgentStream(stub), AgentStream(stub)
    await a.register("a", lora_adapters=["sql", "chat"])
    await b.register("b", lora_adapters=["chat"])
    await c.register("c")
    await a.batch(1, stored([1, 2]))

    async def workers(lora_name: str) -> set[str]:
        return {w.worker_id for w in (await stub.Query(query([1, 2], lora_name=lora_name))).workers}

    assert await workers("") == {"a", "b", "c"}
    assert await workers("sql") == {"a"}
    assert await workers("chat") == {"a", "b"}
    assert await workers("nope") == set()
    # A heartbeat's adapter list replaces the registered one (here: b loads sql, a unloads everything).
    await b.send(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(running_requests=1), lora_adapters=["chat", "sql"]))
    await a.send(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(running_requests=2)))
    await eventually(lambda: _equals(workers("sql"), {"b"}), 5, what="the heartbeats' adapter lists applied")
    listed = {w.worker_id: list(w.lora_adapters) for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert listed == {"a": [], "b": ["chat", "sql"], "c": []}
    answer = {w.worker_id: w for w in (await stub.Query(query([1, 2], lora_name="chat"))).workers}
    assert answer["b"].load.running_requests == 1  # answers follow heartbeats (no stale cached answer)


async def test_data_parallel_rank_and_engine_version_are_exposed(control_plane) -> None:
    _, stub = control_plane
    rank0, rank1, plain = AgentStream(stub), AgentStream(stub), AgentStream(stub)
    await rank0.register("dp-0", data_parallel_rank=0, engine_version="0.26.0")
    await rank1.register("dp-1", data_parallel_rank=1)
    await plain.register("plain")
    listed = {w.worker_id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert listed["dp-0"].HasField("data_parallel_rank") and listed["dp-0"].data_parallel_rank == 0
    assert listed["dp-1"].data_parallel_rank == 1 and not listed["plain"].HasField("data_parallel_rank")
    assert listed["dp-0"].engine_version == "0.26.0" and listed["plain"].engine_version == ""
    answer = {w.worker_id: w for w in (await stub.Query(query([1]))).workers}
    assert answer["dp-0"].HasField("data_parallel_rank") and answer["dp-0"].data_parallel_rank == 0
    assert answer["dp-1"].data_parallel_rank == 1 and not answer["plain"].HasField("data_parallel_rank")


async def test_roles_are_exposed_and_an_unknown_role_is_refused(control_plane) -> None:
    _, stub = control_plane
    prefill, decode, whole, both = AgentStream(stub), AgentStream(stub), AgentStream(stub), AgentStream(stub)
    await prefill.register("p", role="prefill")
    await decode.register("d", role="decode")
    await whole.register("w")
    await both.register("b", role="both")  # the command line's spelling of "": whole requests
    listed = {w.worker_id: w.role for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert listed == {"p": "prefill", "d": "decode", "w": "", "b": ""}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await AgentStream(stub).register("x", role="mixer")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role must be one of" in err.value.details()


@pytest.mark.parametrize(
    "chains,message",
    [
        ([pb.KeyChain(block_size=0, block_keys=[1])], "block_size"),
        ([pb.KeyChain(block_size=4, block_keys=[1]), pb.KeyChain(block_size=4, block_keys=[2])], "one KeyChain per block size"),
    ],
)
async def test_malformed_query_is_invalid_argument(control_plane, chains, message) -> None:
    _, stub = control_plane
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Query(pb.QueryRequest(model=MODEL, chains=chains))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


# ---------------------------------------------------------------- RouterSession


class RouterStream(BidiStream):
    """Drives one RouterSession stream the way a router does."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub) -> None:
        super().__init__(stub.RouterSession, pb.RouterMessage)
        self.query_ids = iter(range(1, 1 << 30))

    async def hello(self, router_id: str) -> pb.RouterWelcome:
        await self.send(hello=pb.RouterHello(router_id=router_id))
        return (await self.recv()).welcome

    async def query(self, keys: list[int] = (), block_size: int = 4, **fields) -> dict[str, pb.WorkerMatch]:
        """Ask and wait for the answer (so every message sent before it has been applied)."""
        query_id = next(self.query_ids)
        await self.send(query=query(list(keys), block_size, query_id=query_id, **fields))
        reply = await self.recv()
        assert reply.WhichOneof("body") == "result" and reply.result.query_id == query_id
        return {w.worker_id: w for w in reply.result.workers}

    async def reserve(
        self,
        reservation_id: int,
        worker_id: str,
        keys: list[int] = (),
        prefill_tokens: int = 0,
        ttl_ms: int = 0,
        block_size: int = 4,
    ) -> None:
        await self.send(
            reserve=pb.Reservation(
                reservation_id=reservation_id,
                worker_id=worker_id,
                block_size=block_size,
                block_keys=list(keys),
                prefill_tokens=prefill_tokens,
                ttl_ms=ttl_ms,
            )
        )


async def two_routers(stub: pb_grpc.ControlPlaneStub) -> tuple[RouterStream, RouterStream]:
    router_a, router_b = RouterStream(stub), RouterStream(stub)
    await router_a.hello("router-a")
    await router_b.hello("router-b")
    return router_a, router_b


def reserved(workers: dict[str, pb.WorkerMatch]) -> dict[str, tuple[int, int]]:
    return {w: (m.reserved_requests, m.reserved_prefill_tokens) for w, m in workers.items()}


def blocks(workers: dict[str, pb.WorkerMatch]) -> dict[str, tuple[int, int]]:
    """worker -> (matched, speculative) blocks"""
    return {w: (m.matched_blocks, m.speculative_blocks) for w, m in workers.items()}


# What eventually() polls: an answer compared with what the test waits for.
async def _equals(answer: Awaitable[object], expected: object) -> bool:
    return await answer == expected


async def reserved_of(router: RouterStream) -> dict[str, tuple[int, int]]:
    return reserved(await router.query())


async def blocks_of(router: RouterStream, keys: list[int]) -> dict[str, tuple[int, int]]:
    return blocks(await router.query(keys))


async def listed_count(stub: pb_grpc.ControlPlaneStub) -> int:
    return len((await stub.ListWorkers(pb.ListWorkersRequest())).workers)


def reservation_events(server, event: str) -> float:
    return server.metrics_registry.get_sample_value("kvroute_cp_reservation_events_total", {"event": event})


async def test_router_session_first_message_must_be_hello(control_plane) -> None:
    _, stub = control_plane
    router = RouterStream(stub)
    await router.send(query=query([1]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.recv()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "hello" in err.value.details()


async def test_router_session_answers_queries_in_order(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    await agent.batch(1, stored([1, 2, 3]))
    router = RouterStream(stub)
    welcome = await router.hello("router-1")
    assert welcome.router_id == "router-1" and welcome.reservation_max_age_ms == 600_000
    chains = [[1], [1, 2, 3], [9], [1, 2]]
    for query_id, keys in enumerate(chains, start=100):
        await router.send(query=query(keys, query_id=query_id))
    replies = [(await router.recv()).result for _ in chains]
    assert [r.query_id for r in replies] == [100, 101, 102, 103]
    assert [r.workers[0].matched_blocks for r in replies] == [1, 3, 0, 2]
    await router.close()


async def test_reservations_are_seen_by_other_routers_until_released(control_plane) -> None:
    _, stub = control_plane
    for worker_id in ("a", "b"):
        await AgentStream(stub).register(worker_id)
    router_a, router_b = await two_routers(stub)
    await router_a.reserve(1, "a", prefill_tokens=100)
    await router_a.reserve(2, "a", prefill_tokens=30)
    await router_b.reserve(1, "b", prefill_tokens=7)
    # Each router sees the others' reservations, never its own (it tracks those exactly itself).
    assert reserved(await router_a.query()) == {"a": (0, 0), "b": (1, 7)}
    assert reserved(await router_b.query()) == {"a": (2, 130), "b": (0, 0)}
    unary = await stub.Query(query([]))
    assert {w.worker_id: (w.reserved_requests, w.reserved_prefill_tokens) for w in unary.workers} == {"a": (2, 130), "b": (1, 7)}
    await router_a.send(prefill_done=pb.ReservationDone(reservation_id=1))  # first token: prefill no longer pending
    await router_a.query()
    assert reserved(await router_b.query()) == {"a": (2, 30), "b": (0, 0)}
    await router_a.send(release=pb.ReservationDone(reservation_id=1))
    await router_a.send(release=pb.ReservationDone(reservation_id=77))  # unknown id: counted, harmless
    await router_a.query()
    assert reserved(await router_b.query()) == {"a": (1, 30), "b": (0, 0)}
    # Closing the stream drops the router's reservations.
    await router_a.close()
    await eventually(
        lambda: _equals(reserved_of(router_b), {"a": (0, 0), "b": (0, 0)}),
        5,
        what="router a's reservations dropped with its stream",
    )
    assert reserved(await router_b.query()) == reserved(await router_b.query())


async def test_a_router_crash_drops_its_reservations(control_plane) -> None:
    server, stub = control_plane
    await AgentStream(stub).register("a")
    crashed, survivor = RouterStream(stub), RouterStream(stub)
    await crashed.hello("crashed")
    await survivor.hello("survivor")
    await crashed.reserve(1, "a", keys=[1, 2], prefill_tokens=50)
    await crashed.query()
    assert reserved(await survivor.query()) == {"a": (1, 50)}
    crashed.call.cancel()
    await eventually(lambda: _equals(reserved_of(survivor), {"a": (0, 0)}), 5, what="the crashed router's reservations dropped")
    assert reserved(await survivor.query([1, 2])) == {"a": (0, 0)}
    assert blocks(await survivor.query([1, 2])) == {"a": (0, 0)}
    assert reservation_events(server, "closed_with_session") == 1


async def test_speculative_blocks_expire_by_ttl(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    await AgentStream(stub).register("b")
    await agent.batch(1, stored([1]))
    router_a, router_b = await two_routers(stub)
    await router_a.reserve(1, "a", keys=[1, 2, 3, 4], prefill_tokens=16, ttl_ms=300)
    await router_a.reserve(2, "b", keys=[1, 2], prefill_tokens=8)  # ttl 0: the control plane's default (5 s)
    await router_a.query()
    # Speculative holders count for every router, the one that reserved included.
    for router in (router_a, router_b):
        assert blocks(await router.query([1, 2, 3, 4, 5])) == {"a": (4, 3), "b": (2, 2)}
    await eventually(
        lambda: _equals(blocks_of(router_b, [1, 2, 3, 4, 5]), {"a": (1, 0), "b": (2, 2)}),
        5,
        what="a's speculative blocks gone after their 300 ms TTL",
    )
    assert reserved(await router_b.query()) == {"a": (1, 16), "b": (1, 8)}  # the requests still count


async def test_events_confirming_a_block_replace_its_speculative_entry(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    router_a, router_b = await two_routers(stub)
    await router_a.reserve(1, "a", keys=[1, 2, 3, 4], ttl_ms=60_000)
    await router_a.query()
    assert blocks(await router_b.query([1, 2, 3, 4])) == {"a": (4, 4)}
    await agent.batch(1, stored([1, 2]))  # the engine cached the first two blocks
    assert blocks(await router_b.query([1, 2, 3, 4])) == {"a": (4, 2)}
    # From now on the index alone speaks for 1 and 2: evicting 1 ends the match there, even
    # though the reservation that once vouched for it is still live.
    await agent.batch(2, removed([1]))
    assert blocks(await router_b.query([1, 2, 3, 4])) == {"a": (0, 0)}
    assert blocks(await router_b.query([2, 3, 4])) == {"a": (3, 2)}
    await router_a.send(release=pb.ReservationDone(reservation_id=1))
    await router_a.query()
    assert blocks(await router_b.query([2, 3, 4])) == {"a": (1, 0)}


async def test_cleared_or_dropped_worker_loses_its_in_flight_state(control_plane) -> None:
    server, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    router_a, router_b = await two_routers(stub)
    await router_a.reserve(1, "a", keys=[1, 2], prefill_tokens=10, ttl_ms=60_000)
    await router_a.query()
    await agent.batch(1, pb.BlockEvent(cleared=pb.AllBlocksCleared()))
    answer = await router_b.query([1, 2])
    assert blocks(answer) == {"a": (0, 0)} and reserved(answer) == {"a": (1, 10)}
    await router_a.reserve(2, "a", keys=[1, 2], prefill_tokens=5, ttl_ms=60_000)
    await router_a.query()
    assert blocks(await router_b.query([1, 2])) == {"a": (2, 2)}
    # Past the 0.6 s heartbeat timeout the worker is dropped.
    await eventually(lambda: _equals(router_b.query([1, 2]), {}), 5, what="a dropped after its heartbeat timeout")
    await AgentStream(stub).register("a")  # back (a new stream): nothing of the old in-flight state
    assert blocks(await router_b.query([1, 2])) == {"a": (0, 0)} and reserved(await router_b.query()) == {"a": (0, 0)}
    assert reservation_events(server, "dropped_with_worker") == 2


async def test_reservations_on_unknown_workers_or_other_block_sizes(control_plane) -> None:
    server, stub = control_plane
    await AgentStream(stub).register("a", block_size=4)
    router_a, router_b = await two_routers(stub)
    await router_a.reserve(1, "ghost", keys=[1], prefill_tokens=10)
    await router_a.reserve(2, "a", keys=[1, 2], prefill_tokens=10, block_size=16)  # not a's chain: keys ignored
    await router_a.query()
    answer = await router_b.query([1, 2])
    assert blocks(answer) == {"a": (0, 0)} and reserved(answer) == {"a": (1, 10)}
    assert reservation_events(server, "unknown_worker") == 1
    assert reservation_events(server, "block_size_mismatch") == 1


@pytest.mark.parametrize(
    "bad,message",
    [
        (pb.RouterMessage(), "no body"),
        (pb.RouterMessage(hello=pb.RouterHello(router_id="again")), "only be sent once"),
        (pb.RouterMessage(reserve=pb.Reservation(reservation_id=1, worker_id="a")), "already live"),
        (pb.RouterMessage(reserve=pb.Reservation(reservation_id=2)), "needs a worker_id"),
        (pb.RouterMessage(query=pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_keys=[1])])), "block_size"),
    ],
)
async def test_malformed_router_message_ends_only_that_stream(control_plane, bad, message) -> None:
    _, stub = control_plane
    await AgentStream(stub).register("a")
    faulty, other = RouterStream(stub), RouterStream(stub)
    await faulty.hello("faulty")
    await other.hello("other")
    await faulty.reserve(1, "a", prefill_tokens=3)
    await other.reserve(1, "a", prefill_tokens=4)
    await faulty.query()
    await faulty.outbox.put(bad)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await faulty.recv()
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert message in err.value.details()
    # The other router's stream and reservation are untouched; the faulty one's are gone with its stream.
    assert reserved(await other.query()) == {"a": (0, 0)}
    assert {w.worker_id: w.reserved_requests for w in (await stub.Query(query([]))).workers} == {"a": 1}


async def test_bytes_that_are_no_request_are_invalid_argument_and_counted(control_plane) -> None:
    """grpc's generated registration deserialized before any kvroute code: bytes that are not the message
    (corrupt, or a string that is not UTF-8) were UNKNOWN "Unexpected DecodeError" (kvroute/grpc_requests.py)."""
    server, _ = control_plane
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    bad_requests = server.service.metrics.bad_requests
    for method, payload in (
        ("Query", b"\xff\xff\xff"),
        ("GetWorkerKeys", b"\x0a\x03\xed\xa0\x80"),
        ("ListWorkers", b"\x0a\x05ab"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary(f"/kvroute.v1.ControlPlane/{method}")(payload, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "kvroute.v1." in err.value.details() and "does not" not in err.value.details(), err.value.details()
        assert bad_requests.labels(method, "unparseable")._value.get() == 1
    for method in ("Connect", "RouterSession"):
        # register.worker_id / hello.router_id (field 1 in field 1) holding U+D800 as (invalid) UTF-8
        call = channel.stream_stream(f"/kvroute.v1.ControlPlane/{method}")(iter([b"\x0a\x05\x0a\x03\xed\xa0\x80"]), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details(), err.value
    assert server.service.metrics.stream_errors.labels("unparseable")._value.get() == 1
    assert bad_requests.labels("RouterSession", "unparseable")._value.get() == 1
    await channel.close()
