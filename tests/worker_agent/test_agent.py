"""The whole agent in-process against real sockets: a fake engine (XPUB + replay ROUTER + HTTP
/v1/models, /metrics), the real control plane, the agent's /metrics and /health; plus the CLI."""

from __future__ import annotations

import argparse
import asyncio
import random
import socket

import aiohttp
import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from kvroute.block_keys import prompt_block_keys
from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.prom_text import samples as prom_samples
from kvroute.tools.local_cluster import free_port
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent import cli
from kvroute.worker_agent.agent import AgentConfig, WorkerAgent, default_worker_id
from tests.helpers import eventually

MODEL = "tiny-llama"
TOKENS = list(range(1, 129))


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


class RankPublisher:
    """One engine rank's KV-event publisher: XPUB (a PUB that also reports subscriptions) + replay ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context, rank: int, kv_port: int = 0, replay_port: int = 0) -> None:
        self.rank = rank
        self.pub, self.kv_endpoint = _bind(ctx, zmq.XPUB, kv_port)
        self.router, self.replay_endpoint = _bind(ctx, zmq.ROUTER, replay_port)
        self.buffer: dict[int, bytes] = {}
        self.seq = 0
        self.task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start8 = await self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start8, "big")):
                await self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])

    async def publish(self, *events: dict, live: bool = True, rank: int | None = None) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer[seq] = msgspec.msgpack.encode([1.0, list(events), self.rank if rank is None else rank])
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.buffer[seq]])
        return seq

    def restart(self) -> None:
        """The engine restarted: the counter and the replay buffer start over."""
        self.seq, self.buffer = 0, {}


def _bind(ctx: zmq.asyncio.Context, kind: int, port: int) -> tuple[zmq.asyncio.Socket, str]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if port:
        sock.bind(f"tcp://127.0.0.1:{port}")
    else:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


class FakeEngine:
    """vLLM's outside: OpenAI HTTP (/v1/models with LoRA adapters, /version, /metrics) and, per data-parallel
    rank, a KV-event publisher. With several ranks they sit on consecutive ports
    (docs/wire-formats.md#data-parallel-endpoints): live base..base+n-1, replay base+n..base+2n-1."""

    def __init__(self, ranks: int = 1) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ranks = [RankPublisher(self.ctx, 0)] if ranks == 1 else self._consecutive(ranks)
        first = self.ranks[0]
        self.pub, self.kv_endpoint, self.replay_endpoint = first.pub, first.kv_endpoint, first.replay_endpoint
        self.running = 2
        self.adapters: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _consecutive(self, n: int) -> list[RankPublisher]:
        for _ in range(50):
            base = random.randint(20000, 60000)
            made: list[RankPublisher] = []
            try:
                for r in range(n):
                    made.append(RankPublisher(self.ctx, r, base + r, base + n + r))
                return made
            except zmq.ZMQError:  # a port in the run is taken: another run
                for m in made:
                    m.task.cancel()
                    m.pub.close(0)
                    m.router.close(0)
        raise RuntimeError("no run of free ports")

    async def start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _models(self, request: web.Request) -> web.Response:
        adapters = [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": MODEL} for a in self.adapters]
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "root": "/models/tiny", "parent": None}, *adapters]}
        )

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
            'vllm:num_requests_waiting{engine="0"} 1\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        )

    async def publish(self, *events: dict, live: bool = True) -> int:
        return await self.ranks[0].publish(*events, live=live)

    async def close(self) -> None:
        for r in self.ranks:
            r.task.cancel()
        if self.runner:
            await self.runner.cleanup()
        self.ctx.destroy(linger=0)


@pytest.fixture
async def fleet():
    engine = FakeEngine()
    await engine.start_http()
    cp = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=1.0))
    port = await cp.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine, cp, port, pb_grpc.ControlPlaneStub(channel)
    await channel.close()
    await cp.stop(0)
    await engine.close()


async def start_agent(config: AgentConfig) -> tuple[WorkerAgent, asyncio.Task]:
    agent = WorkerAgent(config)
    return agent, asyncio.create_task(agent.run())


async def matched(stub: pb_grpc.ControlPlaneStub, keys: list[int], block_size: int) -> dict[str, int]:
    response = await stub.Query(pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=block_size, block_keys=keys)]))
    return {w.worker_id: w.matched_blocks for w in response.workers}


async def test_events_flow_from_engine_to_control_plane(fleet) -> None:
    engine, cp, port, stub = fleet
    keys = prompt_block_keys(TOKENS[:64], 16, MODEL)
    await engine.publish(stored([11, 12], None, TOKENS[:32], 16), live=False)  # before the agent: replayed at start
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            kv_events=engine.kv_endpoint,
            replay_endpoint=engine.replay_endpoint,
            engine_url=engine.url,
            worker_id="gpu-0",
            metrics_port=None,
            engine_poll_interval_s=0.05,
        )
    )
    try:
        await eventually(lambda: agent.workers[0].link.connected and agent.counters["batches"] == 1)
        assert (
            agent.workers[0].identity.model == MODEL and agent.workers[0].identity.engine_version == "0.32.0"
        )  # learned from the engine
        await asyncio.wait_for(engine.pub.recv(), 5)  # the SUB's subscription reached the engine
        await engine.publish(stored([13, 14], 12, TOKENS[32:64], 16))
        await eventually(lambda: agent.counters["batches"] == 2 and agent.workers[0].link.acked_seq >= 2)
        assert await matched(stub, keys, 16) == {"gpu-0": 4}
        await engine.publish(removed([14]), removed([13]))
        await eventually(lambda: agent.workers[0].link.acked_seq >= 3)
        assert await matched(stub, keys, 16) == {"gpu-0": 2}
        await eventually(lambda: (w := cp.registry.get("gpu-0")) is not None and w.load.running_requests == 2)
        (info,) = (await stub.ListWorkers(pb.ListWorkersRequest(model=MODEL))).workers
        assert (info.endpoint, info.block_size, info.cached_blocks) == (engine.url, 16, 2)
        assert agent.counters["blocks"] == 2 and agent.counters["control_plane_connected"] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_metrics_and_health_endpoints(fleet) -> None:
    engine, _cp, port, _stub = fleet
    mport = free_port()
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            kv_events=engine.kv_endpoint,
            engine_url=engine.url,
            model=MODEL,
            worker_id="gpu-0",
            metrics_port=mport,
        )
    )
    try:
        await eventually(lambda: agent.workers[0].link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([11], None, TOKENS[:16], 16), stored([99], 12345, TOKENS[16:32], 16))  # 2nd: orphan
        await engine.pub.send_multipart([b"", b"\x00", b"x"])  # malformed frame
        await eventually(lambda: agent.counters["batches"] == 1 and agent.counters["malformed_frames"] == 1)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{mport}/metrics") as resp:
                text = await resp.text()
            async with session.get(f"http://127.0.0.1:{mport}/health") as resp:
                health = await resp.json()
        samples = {s.name: s.value for s in prom_samples(text) if s.name.startswith("kvroute_") and not s.labels}
        for name in (
            "batches",
            "malformed_frames",
            "malformed_events",
            "unknown_events",
            "gaps",
            "replays",
            "sequence_resets",
            "orphan_blocks",
        ):
            assert f"kvroute_agent_{name}_total" in samples, name
        assert samples["kvroute_agent_batches_total"] == 1 and samples["kvroute_agent_malformed_frames_total"] == 1
        assert samples["kvroute_agent_orphan_blocks_total"] == 1
        assert samples["kvroute_agent_blocks"] == 1 and samples["kvroute_agent_control_plane_connected"] == 1
        assert "# TYPE kvroute_agent_batches_total counter" in text and "# TYPE kvroute_agent_blocks gauge" in text
        assert health["status"] == "ok" and health["blocks"] == 1 and health["control_plane_connected"] is True
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_engine_block_size_wins_over_the_flag(fleet) -> None:
    engine, cp, port, stub = fleet
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            kv_events=engine.kv_endpoint,
            engine_url=engine.url,
            model=MODEL,
            worker_id="gpu-0",
            block_size=16,
        )
    )
    try:
        await eventually(lambda: agent.workers[0].link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([1, 2], None, TOKENS[:64], 32))  # the engine really uses 32-token blocks
        await eventually(
            lambda: (
                cp.registry.get("gpu-0") is not None
                and cp.registry.get("gpu-0").block_size == 32
                and agent.workers[0].link.connected
            )
        )
        await eventually(lambda: agent.workers[0].link.acked_seq >= 1)
        assert await matched(stub, prompt_block_keys(TOKENS[:64], 32, MODEL), 32) == {"gpu-0": 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_engine_restart_resyncs_the_control_plane(fleet) -> None:
    engine, _cp, port, stub = fleet
    keys = prompt_block_keys(TOKENS[:32], 16, MODEL)
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            kv_events=engine.kv_endpoint,
            replay_endpoint=engine.replay_endpoint,
            engine_url=engine.url,
            model=MODEL,
            worker_id="gpu-0",
        )
    )
    try:
        await eventually(lambda: agent.workers[0].link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        for i in range(3):
            await engine.publish(stored([100 + i], None, [i] * 16, 16))
        await eventually(lambda: agent.counters["batches"] == 3 and agent.workers[0].link.acked_seq >= 2)
        engine.ranks[0].restart()
        await engine.publish(stored([1, 2], None, TOKENS[:32], 16))
        await eventually(lambda: agent.counters["sequence_resets"] == 1 and agent.counters["batches"] == 4)
        await eventually(
            lambda: (
                agent.workers[0].link.counters.snapshots_sent >= 2
                and agent.workers[0].link.acked_seq == agent.workers[0].link.last_sent_seq
            )
        )
        assert sorted(agent.workers[0].resolver.held_keys()) == sorted(keys)
        assert await matched(stub, keys, 16) == {"gpu-0": 2}
        assert await matched(stub, prompt_block_keys([0] * 16, 16, MODEL), 16) == {"gpu-0": 0}  # old state gone
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_control_plane_down_then_up(fleet) -> None:
    engine, cp, port, stub = fleet
    await cp.stop(0)
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, engine_url=engine.url, model=MODEL, worker_id="gpu-0"
        )
    )
    cp2 = ControlPlaneServer(ControlPlaneConfig(listen=f"127.0.0.1:{port}", heartbeat_timeout_s=1.0))
    try:
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([1, 2], None, TOKENS[:32], 16))  # arrives while the control plane is down
        await eventually(lambda: agent.counters["batches"] == 1)
        await eventually(
            lambda: agent.counters["control_plane_failures"] >= 1, what="a failed connect to the stopped control plane"
        )
        assert agent.counters["control_plane_connected"] == 0
        assert not task.done()
        await cp2.start()
        await eventually(lambda: agent.workers[0].link.connected and agent.workers[0].link.acked_seq >= 1, timeout=15)
        assert await matched(stub, prompt_block_keys(TOKENS[:32], 16, MODEL), 16) == {"gpu-0": 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await cp2.stop(0)


async def test_data_parallel_engine_is_one_worker_per_rank_on_offset_ports() -> None:
    engine = FakeEngine(ranks=2)
    await engine.start_http()
    cp = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=1.0))
    port = await cp.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ControlPlaneStub(channel)
    rank0, rank1 = engine.ranks
    assert int(rank1.kv_endpoint.rsplit(":", 1)[1]) == int(rank0.kv_endpoint.rsplit(":", 1)[1]) + 1
    await rank1.publish(stored([7], None, TOKENS[64:80], 16), live=False)  # before the agent: rank 1's replay has it
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            kv_events=rank0.kv_endpoint,
            replay_endpoint=rank0.replay_endpoint,
            engine_url=engine.url,
            model=MODEL,
            worker_id="gpu-0",
            data_parallel_size=2,
        )
    )
    try:
        w0, w1 = agent.workers
        assert (w0.identity.worker_id, w1.identity.worker_id) == ("gpu-0-dp0", "gpu-0-dp1")
        await eventually(lambda: w0.link.connected and w1.link.connected and w1.resolver.held_keys())
        await asyncio.wait_for(rank0.pub.recv(), 5)
        await asyncio.wait_for(rank1.pub.recv(), 5)
        await rank0.publish(stored([1, 2], None, TOKENS[:32], 16))
        await rank1.publish(stored([8], 7, TOKENS[80:96], 16), live=False)  # lost on the live path: a gap on rank 1 only
        await rank1.publish(stored([1], None, TOKENS[32:48], 16))
        await rank1.publish(stored([9], None, TOKENS[96:112], 16), rank=0)  # names rank 0 on rank 1's socket
        await eventually(lambda: w1.source.counters.rank_mismatches == 1 and w1.link.acked_seq >= 2 and w0.link.acked_seq >= 2)
        assert await matched(stub, prompt_block_keys(TOKENS[:32], 16, MODEL), 16) == {"gpu-0-dp0": 2, "gpu-0-dp1": 0}
        assert await matched(stub, prompt_block_keys(TOKENS[64:96], 16, MODEL), 16) == {"gpu-0-dp0": 0, "gpu-0-dp1": 2}
        assert await matched(stub, prompt_block_keys(TOKENS[96:112], 16, MODEL), 16) == {"gpu-0-dp0": 0, "gpu-0-dp1": 0}
        assert (w0.source.last_seq, w1.source.last_seq) == (0, 3)  # one sequence per rank
        assert (w0.source.counters.gaps, w1.source.counters.gaps, w1.source.counters.replayed_batches) == (0, 1, 2)
        assert w0.identity.register_message().register.data_parallel_rank == 0
        assert w1.identity.register_message().register.data_parallel_rank == 1
        assert agent.counters["rank_mismatches"] == 1 and agent.counters["state_resets"] == 0
        text = generate_latest(agent.metrics_registry).decode()
        assert 'kvroute_agent_last_seq{worker="gpu-0-dp1"} 3.0' in text
        assert 'kvroute_agent_tier_blocks{medium="gpu",worker="gpu-0-dp0"} 2.0' in text
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await cp.stop(0)
        await engine.close()


async def test_lora_adapters_follow_the_engine(fleet) -> None:
    engine, _cp, port, _stub = fleet
    engine.adapters = ["sql"]
    agent, task = await start_agent(
        AgentConfig(control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, engine_url=engine.url, worker_id="gpu-0")
    )
    agent.models.interval_s = 0.05
    try:
        (w,) = agent.workers
        await eventually(lambda: w.link.connected and w.identity.model == MODEL and w.identity.lora_adapters == ["sql"])
        engine.adapters = ["sql", "chat-v2"]  # loaded at run time (vLLM dynamic LoRA)
        await eventually(lambda: w.identity.lora_adapters == ["chat-v2", "sql"])
        engine.adapters = []
        await eventually(lambda: w.identity.lora_adapters == [])
        assert agent.counters["engine_models_failures"] == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class FakeTrtllmServe:
    """trtllm-serve's outside: POST /kv_cache_events drains canned JSON bodies (then answers []), GET /metrics
    returns iteration stats, GET /v1/models the model."""

    def __init__(self) -> None:
        self.bodies: list[list[dict]] = []
        self.posts = 0
        self.server: TestServer | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self._events)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")

    async def _events(self, request: web.Request) -> web.Response:
        self.posts += 1
        return web.json_response(self.bodies.pop(0) if self.bodies else [])

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "numActiveRequests": 4,
                    "numQueuedRequests": 1,
                    "kvCacheStats": {"maxNumBlocks": 64, "usedNumBlocks": 16, "tokensPerBlock": 4},
                }
            ]
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def trt_stored(event_id: int, parent: int | None, blocks: list[tuple[int, list[int]]], window: int = 64) -> dict:
    return {
        "event_id": event_id,
        "window_size": window,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": h,
                    "cache_level": 0,
                    "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
                }
                for h, tokens in blocks
            ],
        },
    }


async def test_trtllm_pull_path_end_to_end() -> None:
    engine = FakeTrtllmServe()
    await engine.start()
    cp = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=1.0))
    port = await cp.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ControlPlaneStub(channel)
    created = [
        {"event_id": i, "window_size": w, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}
        for i, w in enumerate((64, 16))
    ]
    engine.bodies = [
        created
        + [
            trt_stored(2, None, [(2**64 - 1, TOKENS[:4]), (2**63, TOKENS[4:8]), (3, TOKENS[8:10])]),  # + partial
            trt_stored(3, None, [(9, TOKENS[:4])], window=16),
        ],  # sliding window
        [
            {"event_id": 4, "window_size": 64, "data": {"type": "removed", "block_hashes": [3]}},  # the partial
            trt_stored(5, 2**63, [(4, TOKENS[8:12])]),
        ],
    ]
    agent, task = await start_agent(
        AgentConfig(
            control_plane=f"127.0.0.1:{port}",
            engine="trtllm",
            engine_url=engine.url,
            worker_id="trt-0",
            block_size=4,
            kv_events_poll_interval_s=0.02,
            engine_poll_interval_s=0.05,
        )
    )
    try:
        (w,) = agent.workers
        assert agent.config.transport == "http" and w.source is None
        await eventually(lambda: w.link.connected and not engine.bodies and w.link.acked_seq >= 2 and len(w.resolver) == 3)
        assert await matched(stub, prompt_block_keys(TOKENS[:12], 4, MODEL), 4) == {"trt-0": 3}
        c = agent.counters
        assert (c["window_filtered_events"], c["partial_blocks"], c["unknown_removes"], c["gaps"]) == (1, 1, 0, 0)
        engine.bodies = [[trt_stored(7, None, [(5, TOKENS[100:104])])]]  # event 6 never arrives: state unknown
        await eventually(
            lambda: (
                agent.counters["state_resets"] == 1
                and w.link.acked_seq == w.link.last_sent_seq
                and w.resolver.held_keys() == prompt_block_keys(TOKENS[100:104], 4, MODEL)
            )
        )
        assert await matched(stub, prompt_block_keys(TOKENS[:12], 4, MODEL), 4) == {"trt-0": 0}
        assert await matched(stub, prompt_block_keys(TOKENS[100:104], 4, MODEL), 4) == {"trt-0": 1}
        assert (agent.counters["gaps"], agent.counters["unrecoverable_gaps"]) == (1, 1)
        assert agent.last_seq(w) == 7 and agent.counters["polls"] >= 3
        await eventually(lambda: (r := cp.registry.get("trt-0")) is not None and r.load.running_requests == 4)
        assert cp.registry.get("trt-0").load.kv_usage == pytest.approx(0.25)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await cp.stop(0)
        await engine.server.close()


# ----------------------------------------------------------------------------- CLI


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_defaults_and_config() -> None:
    args = parse()
    assert (args.control_plane, args.engine, args.kv_events, args.kv_events_bind, args.replay_endpoint) == (
        "127.0.0.1:50051",
        "vllm",
        "tcp://127.0.0.1:5557",
        False,
        None,
    )
    assert (args.engine_url, args.worker_id, args.model, args.block_size, args.metrics_port, args.topic) == (
        "http://127.0.0.1:8000",
        None,
        None,
        16,
        None,
        "",
    )
    assert (args.kv_events_transport, args.data_parallel_size, args.data_parallel_rank_start) == ("auto", None, 0)
    config = cli.config_from_args(
        parse(
            "--kv-events",
            "tcp://0.0.0.0:5557",
            "--kv-events-bind",
            "--replay-endpoint",
            "tcp://10.0.0.7:5558",
            "--engine-url",
            "http://10.0.0.7:8000",
            "--model",
            "m",
            "--block-size",
            "32",
            "--metrics-port",
            "9400",
            "--log-level",
            "debug",
        )
    )
    assert config.kv_events_bind and config.block_size == 32 and config.metrics_port == 9400
    assert config.transport == "zmq" and config.ranks is None
    (worker,) = WorkerAgent(config).workers
    assert worker.identity.worker_id == "10.0.0.7:8000" and worker.identity.data_parallel_rank is None


def test_cli_role_is_registered_with_every_rank() -> None:
    assert cli.config_from_args(parse()).role == ""
    config = cli.config_from_args(parse("--role", "Decode", "--data-parallel-size", "2"))
    assert config.role == "decode"
    assert [w.identity.register_message().register.role for w in WorkerAgent(config).workers] == ["decode", "decode"]
    assert cli.config_from_args(parse("--role", "both")).role == ""  # whole requests: registered as ""
    with pytest.raises(SystemExit):
        parse("--role", "mixer")


def test_cli_engines_transports_and_data_parallel_ranks() -> None:
    config = cli.config_from_args(
        parse("--engine", "trtllm", "--engine-url", "http://10.0.0.9:8000", "--kv-events-poll-interval-ms", "20")
    )
    assert config.transport == "http" and config.kv_events_poll_interval_s == 0.02  # trtllm implies its pull path
    agent = WorkerAgent(config)
    assert agent.poller is not None and all(w.source is None for w in agent.workers)
    assert agent.poller.url == "http://10.0.0.9:8000/kv_cache_events"
    streaming = cli.config_from_args(parse("--engine", "trtllm", "--kv-events-transport", "zmq"))
    assert streaming.transport == "zmq" and WorkerAgent(streaming).poller is None
    dp = cli.config_from_args(
        parse(
            "--engine",
            "sglang",
            "--kv-events",
            "tcp://10.0.0.8:5557",
            "--replay-endpoint",
            "tcp://10.0.0.8:5567",
            "--data-parallel-size",
            "2",
            "--data-parallel-rank-start",
            "4",
            "--worker-id",
            "node-b",
        )
    )
    assert dp.ranks == [4, 5]
    workers = WorkerAgent(dp).workers
    assert [
        (w.identity.worker_id, w.rank, w.source.endpoint, w.source.replay_endpoint, w.source.expected_rank) for w in workers
    ] == [
        ("node-b-dp4", 4, "tcp://10.0.0.8:5561", "tcp://10.0.0.8:5571", 4),
        ("node-b-dp5", 5, "tcp://10.0.0.8:5562", "tcp://10.0.0.8:5572", 5),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--engine", "ollama"), "engine 'ollama' is not supported"),
        (("--kv-events-transport", "grpc"), "transport 'grpc' is not one of zmq, http, auto"),
        (("--block-size", "0"), "expected a positive integer"),
        (("--data-parallel-size", "0"), "expected a positive integer"),
        (("--data-parallel-size", "two"), "expected a positive integer, got 'two'"),
        (("--data-parallel-rank-start", "-1"), "expected an integer >= 0"),
        (("--metrics-port", "x"), "argument --metrics-port: port 'x' is not a number"),
        (("--kv-events", "udp://h:1"), "'udp://h:1' is not tcp://HOST:PORT, ipc://PATH or inproc://NAME"),
        (("--replay-endpoint", "tcp://h"), "argument --replay-endpoint: no port in 'h'"),
        (
            ("--engine", "trtllm", "--kv-events", "nonsense"),
            "argument --kv-events: 'nonsense' is not tcp://",
        ),  # unused, still checked
    ],
)
def test_cli_rejects_bad_values_clearly(capsys, argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--engine", "vllm", "--kv-events-transport", "http"), "vllm publishes KV events over ZMQ only"),
        (("--engine", "trtllm", "--replay-endpoint", "tcp://h:5558"), "pull path (http) has no replay endpoint"),
        (("--data-parallel-rank-start", "2"), "needs data_parallel_size"),
        (("--data-parallel-size", "2", "--kv-events", "ipc:///tmp/kv"), "vllm cannot publish KV events on ipc://"),
        (("--data-parallel-size", "2", "--kv-events", "tcp://h:0"), "port 0 cannot be offset"),
        (
            ("--data-parallel-size", "4", "--kv-events", "tcp://h:5557", "--replay-endpoint", "tcp://h:5559"),
            "replay endpoints overlap",
        ),
        (("--engine", "trtllm", "--kv-events", "tcp://*:5557"), None),  # the pull path does not use --kv-events
    ],
)
def test_cli_rejects_options_that_do_not_fit_together(capsys, argv: tuple[str, ...], message: str | None) -> None:
    config = cli.config_from_args(parse(*argv))
    if message is None:
        config.check()
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WorkerAgent(config)
    assert cli.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute agent: error: ") and message in err


def test_default_worker_id() -> None:
    assert default_worker_id("http://10.0.0.7:8000/") == "10.0.0.7:8000"
    assert default_worker_id("https://gpu-3.internal") == "gpu-3.internal:443"
    assert default_worker_id("http://127.0.0.1:8001") == f"{socket.gethostname()}:8001"


def test_kvroute_agent_subcommand_is_wired() -> None:
    from kvroute.cli import parse_args

    args = parse_args(["agent", "--engine", "vllm", "--model", "m"])
    assert args._run is cli.run and args.model == "m"
