"""ControlPlane gRPC service over a real socket: register, events per tier, acks, query, adapters,
data-parallel ranks, GetWorkerKeys, liveness."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.block_keys import prompt_block_keys
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

MODEL = "tiny"


@pytest.fixture
async def control_plane():
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=0.6))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield server, pb_grpc.ControlPlaneStub(channel)
    await channel.close()
    await server.stop(0)


class AgentStream:
    """Drives one Connect stream the way an agent does."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub) -> None:
        self.outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self.call = stub.Connect(self._messages())

    async def _messages(self):
        while (message := await self.outbox.get()) is not None:
            yield message

    async def send(self, **body) -> None:
        await self.outbox.put(pb.AgentMessage(**body))

    async def recv(self) -> pb.ControlMessage:
        return await asyncio.wait_for(self.call.read(), 5)

    async def register(self, worker_id: str, block_size: int = 4, **fields) -> pb.ControlMessage:
        await self.send(register=pb.RegisterWorker(worker_id=worker_id, model=MODEL, engine="sim",
                                                   block_size=block_size, endpoint=f"http://{worker_id}", **fields))
        return await self.recv()

    async def batch(self, seq: int, *events: pb.BlockEvent, snapshot: bool = False) -> pb.ControlMessage:
        await self.send(batch=pb.EventBatch(seq=seq, snapshot=snapshot, events=list(events)))
        return await self.recv()


def stored(keys: list[int], medium: str = "gpu") -> pb.BlockEvent:
    return pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, medium=medium))


def removed(keys: list[int], medium: str = "gpu") -> pb.BlockEvent:
    return pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=keys, medium=medium))


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
    await asyncio.sleep(0.05)
    listed = await stub.ListWorkers(pb.ListWorkersRequest(model=MODEL))
    by_id = {w.worker_id: w for w in listed.workers}
    assert by_id["a"].load.running_requests == 3 and by_id["a"].load.waiting_requests == 2
    assert by_id["a"].cached_blocks == 3 and by_id["b"].cached_blocks == 0


async def test_block_size_chains_are_matched_per_worker(control_plane) -> None:
    _, stub = control_plane
    tokens = list(range(64))
    small, large = AgentStream(stub), AgentStream(stub)
    await small.register("small", block_size=4)
    await large.register("large", block_size=16)
    await small.batch(1, stored(prompt_block_keys(tokens, 4, MODEL)))
    await large.batch(1, stored(prompt_block_keys(tokens, 16, MODEL)[:2]))
    response = await stub.Query(pb.QueryRequest(model=MODEL, chains=[
        pb.KeyChain(block_size=4, block_keys=prompt_block_keys(tokens, 4, MODEL)),
        pb.KeyChain(block_size=16, block_keys=prompt_block_keys(tokens, 16, MODEL)),
    ]))
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


async def test_reconnect_snapshot_replaces_and_old_stream_is_superseded(control_plane) -> None:
    _, stub = control_plane
    old = AgentStream(stub)
    await old.register("a")
    await old.batch(1, stored([1, 2, 3]))
    new = AgentStream(stub)
    await new.register("a")
    # Blocks are kept until the snapshot arrives, so routers never see a blank worker in between.
    assert (await stub.Query(query([1, 2, 3]))).workers[0].matched_blocks == 3
    await new.batch(1, stored([1, 9]), snapshot=True)
    assert (await stub.Query(query([1, 2, 3]))).workers[0].matched_blocks == 1
    await old.send(batch=pb.EventBatch(seq=2, events=[stored([2])]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await old.recv()
    assert err.value.code() == grpc.StatusCode.ABORTED


async def test_silent_worker_is_dropped_with_its_blocks(control_plane) -> None:
    server, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    await agent.batch(1, stored([1, 2]))
    assert len((await stub.ListWorkers(pb.ListWorkersRequest())).workers) == 1
    await asyncio.sleep(1.0)  # > 0.6 s heartbeat timeout
    assert len((await stub.ListWorkers(pb.ListWorkersRequest())).workers) == 0
    assert server.registry.index.entry_count() == 0
    assert (await stub.Query(query([1, 2]))).workers == []


async def test_tiers_are_held_apart_and_matched_together(control_plane) -> None:
    _, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    # Snapshot: one BlocksStored per tier ("" is gpu).
    await agent.batch(1, stored([1, 2], ""), stored([3, 4], "cpu"), stored([4, 5], "disk"), snapshot=True)
    assert matches(await stub.Query(query([1, 2, 3, 4, 5, 6]))) == {"a": (5, 2, 1)}
    # An offload: removed from gpu, stored on cpu. Removing a key on one tier keeps the others.
    await agent.batch(2, removed([2]), stored([2], "cpu"), removed([4], "cpu"))
    assert matches(await stub.Query(query([1, 2, 3, 4, 5]))) == {"a": (5, 2, 2)}
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert keys.worker_id == "a" and keys.block_size == 4
    assert {t.medium: list(t.block_keys) for t in keys.tiers} == {"gpu": [1], "cpu": [2, 3], "disk": [4, 5]}
    listed = (await stub.ListWorkers(pb.ListWorkersRequest())).workers[0]
    assert listed.cached_blocks == 1  # the gpu tier
    # A snapshot replaces every tier, including ones it does not name.
    await agent.batch(3, stored([7], "cpu"), snapshot=True)
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert {t.medium: list(t.block_keys) for t in keys.tiers} == {"gpu": [], "cpu": [7], "disk": []}
    # AllBlocksCleared clears every tier.
    await agent.batch(4, stored([1], "gpu"), pb.BlockEvent(cleared=pb.AllBlocksCleared()))
    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="a"))
    assert all(not t.block_keys for t in keys.tiers)


async def test_unknown_medium_is_indexed_as_disk_and_counted(control_plane) -> None:
    server, stub = control_plane
    agent = AgentStream(stub)
    await agent.register("a")
    ack = await agent.batch(1, stored([1], "gpu"), stored([2], "tape"))
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
    await asyncio.sleep(0.05)
    assert await workers("sql") == {"b"}
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


@pytest.mark.parametrize("chains,message", [
    ([pb.KeyChain(block_size=0, block_keys=[1])], "block_size"),
    ([pb.KeyChain(block_size=4, block_keys=[1]), pb.KeyChain(block_size=4, block_keys=[2])], "one KeyChain per block size"),
])
async def test_malformed_query_is_invalid_argument(control_plane, chains, message) -> None:
    _, stub = control_plane
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Query(pb.QueryRequest(model=MODEL, chains=chains))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
