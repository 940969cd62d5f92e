"""The whole agent in-process against real sockets: a fake engine (XPUB + replay ROUTER + HTTP
/v1/models, /metrics), the real control plane, the agent's /metrics and /health; plus the CLI."""

from __future__ import annotations

import argparse
import asyncio
import socket

import aiohttp
import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.block_keys import prompt_block_keys
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from worker_agent import cli
from worker_agent.agent import AgentConfig, WorkerAgent, default_worker_id

MODEL = "tiny-llama"
TOKENS = list(range(1, 129))


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


class FakeEngine:
    """vLLM's outside: OpenAI HTTP (/v1/models, /version, /metrics), KV-event XPUB, replay ROUTER."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.kv_endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: dict[int, bytes] = {}
        self.seq = 0
        self.running = 2
        self._tasks = [asyncio.create_task(self._serve_replay())]
        self.runner: web.AppRunner | None = None
        self.url = ""

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
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                                 'vllm:num_requests_waiting{engine="0"} 1\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n')

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start8 = await self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start8, "big")):
                await self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])

    async def publish(self, *events: dict, live: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer[seq] = msgspec.msgpack.encode([1.0, list(events), 0])
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.buffer[seq]])
        return seq

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.runner:
            await self.runner.cleanup()
        self.ctx.destroy(linger=0)


async def until(predicate, timeout: float = 8.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


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
    agent, task = await start_agent(AgentConfig(
        control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, replay_endpoint=engine.replay_endpoint,
        engine_url=engine.url, worker_id="gpu-0", metrics_port=0, engine_poll_interval_s=0.05))
    try:
        await until(lambda: agent.link.connected and agent.counters["batches"] == 1)
        assert agent.identity.model == MODEL and agent.identity.engine_version == "0.32.0"  # learned from the engine
        await asyncio.wait_for(engine.pub.recv(), 5)  # the SUB's subscription reached the engine
        await engine.publish(stored([13, 14], 12, TOKENS[32:64], 16))
        await until(lambda: agent.counters["batches"] == 2 and agent.link.acked_seq >= 2)
        assert await matched(stub, keys, 16) == {"gpu-0": 4}
        await engine.publish(removed([14]), removed([13]))
        await until(lambda: agent.link.acked_seq >= 3)
        assert await matched(stub, keys, 16) == {"gpu-0": 2}
        await until(lambda: (w := cp.registry.get("gpu-0")) is not None and w.load.running_requests == 2)
        (info,) = (await stub.ListWorkers(pb.ListWorkersRequest(model=MODEL))).workers
        assert (info.endpoint, info.block_size, info.cached_blocks) == (engine.url, 16, 2)
        assert agent.counters["blocks"] == 2 and agent.counters["control_plane_connected"] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_metrics_and_health_endpoints(fleet) -> None:
    engine, _cp, port, _stub = fleet
    metrics_port = socket.socket()
    metrics_port.bind(("127.0.0.1", 0))
    mport = metrics_port.getsockname()[1]
    metrics_port.close()
    agent, task = await start_agent(AgentConfig(
        control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, engine_url=engine.url, model=MODEL,
        worker_id="gpu-0", metrics_port=mport))
    try:
        await until(lambda: agent.link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([11], None, TOKENS[:16], 16), stored([99], 12345, TOKENS[16:32], 16))  # 2nd: orphan
        await engine.pub.send_multipart([b"", b"\x00", b"x"])  # malformed frame
        await until(lambda: agent.counters["batches"] == 1 and agent.counters["malformed_frames"] == 1)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{mport}/metrics") as resp:
                text = await resp.text()
            async with session.get(f"http://127.0.0.1:{mport}/health") as resp:
                health = await resp.json()
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("kvroute_")}
        for name in ("batches", "malformed_frames", "malformed_events", "unknown_events", "gaps", "replays",
                     "sequence_resets", "orphan_blocks"):
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
    agent, task = await start_agent(AgentConfig(
        control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, engine_url=engine.url, model=MODEL,
        worker_id="gpu-0", block_size=16))
    try:
        await until(lambda: agent.link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([1, 2], None, TOKENS[:64], 32))  # the engine really uses 32-token blocks
        await until(lambda: cp.registry.get("gpu-0") is not None and cp.registry.get("gpu-0").block_size == 32
                    and agent.link.connected)
        await until(lambda: agent.link.acked_seq >= 1)
        assert await matched(stub, prompt_block_keys(TOKENS[:64], 32, MODEL), 32) == {"gpu-0": 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_engine_restart_resyncs_the_control_plane(fleet) -> None:
    engine, _cp, port, stub = fleet
    keys = prompt_block_keys(TOKENS[:32], 16, MODEL)
    agent, task = await start_agent(AgentConfig(
        control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, replay_endpoint=engine.replay_endpoint,
        engine_url=engine.url, model=MODEL, worker_id="gpu-0"))
    try:
        await until(lambda: agent.link.connected)
        await asyncio.wait_for(engine.pub.recv(), 5)
        for i in range(3):
            await engine.publish(stored([100 + i], None, [i] * 16, 16))
        await until(lambda: agent.counters["batches"] == 3 and agent.link.acked_seq >= 2)
        engine.seq, engine.buffer = 0, {}  # restart: the counter and the replay buffer start over
        await engine.publish(stored([1, 2], None, TOKENS[:32], 16))
        await until(lambda: agent.counters["sequence_resets"] == 1 and agent.counters["batches"] == 4)
        await until(lambda: agent.link.counters.snapshots_sent >= 2 and agent.link.acked_seq == agent.link.last_sent_seq)
        assert sorted(agent.resolver.held_keys()) == sorted(keys)
        assert await matched(stub, keys, 16) == {"gpu-0": 2}
        assert await matched(stub, prompt_block_keys([0] * 16, 16, MODEL), 16) == {"gpu-0": 0}  # old state gone
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_control_plane_down_then_up(fleet) -> None:
    engine, cp, port, stub = fleet
    await cp.stop(0)
    agent, task = await start_agent(AgentConfig(
        control_plane=f"127.0.0.1:{port}", kv_events=engine.kv_endpoint, engine_url=engine.url, model=MODEL,
        worker_id="gpu-0"))
    cp2 = ControlPlaneServer(ControlPlaneConfig(listen=f"127.0.0.1:{port}", heartbeat_timeout_s=1.0))
    try:
        await asyncio.wait_for(engine.pub.recv(), 5)
        await engine.publish(stored([1, 2], None, TOKENS[:32], 16))  # arrives while the control plane is down
        await until(lambda: agent.counters["batches"] == 1)
        await asyncio.sleep(0.3)
        assert agent.counters["control_plane_connected"] == 0 and agent.counters["control_plane_failures"] >= 1
        assert not task.done()
        await cp2.start()
        await until(lambda: agent.link.connected and agent.link.acked_seq >= 1, timeout=15)
        assert await matched(stub, prompt_block_keys(TOKENS[:32], 16, MODEL), 16) == {"gpu-0": 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await cp2.stop(0)


# ----------------------------------------------------------------------------- CLI


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_defaults_and_config() -> None:
    args = parse()
    assert (args.control_plane, args.engine, args.kv_events, args.kv_events_bind, args.replay_endpoint) == (
        "127.0.0.1:50051", "vllm", "tcp://127.0.0.1:5557", False, None)
    assert (args.engine_url, args.worker_id, args.model, args.block_size, args.metrics_port, args.topic) == (
        "http://127.0.0.1:8000", None, None, 16, 0, "")
    config = cli.config_from_args(parse("--kv-events", "tcp://0.0.0.0:5557", "--kv-events-bind", "--replay-endpoint",
                                        "tcp://10.0.0.7:5558", "--engine-url", "http://10.0.0.7:8000", "--model", "m",
                                        "--block-size", "32", "--metrics-port", "9400", "--log-level", "debug"))
    assert config.kv_events_bind and config.block_size == 32 and config.metrics_port == 9400
    assert WorkerAgent(config).identity.worker_id == "10.0.0.7:8000"


def test_cli_rejects_other_engines_clearly(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--engine", "sglang")
    assert info.value.code == 2
    assert "engine 'sglang' is not supported yet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--block-size", "0")
    with pytest.raises(ValueError, match="unsupported engine"):
        WorkerAgent(AgentConfig(engine="trtllm"))


def test_default_worker_id() -> None:
    assert default_worker_id("http://10.0.0.7:8000/") == "10.0.0.7:8000"
    assert default_worker_id("https://gpu-3.internal") == "gpu-3.internal:443"
    assert default_worker_id("http://127.0.0.1:8001") == f"{socket.gethostname()}:8001"


def test_kvroute_agent_subcommand_is_wired() -> None:
    from kvroute.cli import build_parser

    args = build_parser().parse_args(["agent", "--engine", "vllm", "--model", "m"])
    assert args._run is cli.run and args.model == "m"
