"""Liveness (/health) and readiness (/ready, grpc.health.v1) that go red when something is wrong:
the control plane in-process, and a router, an agent and a sim engine as processes whose
control plane and engine come and go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json
from tests.helpers import get_ready

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_control_plane_is_ready_while_serving_and_says_so_over_grpc_health() -> None:
    metrics_port = free_port()
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", metrics_port=metrics_port))
    port = await server.start()
    stopped = False
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{metrics_port}/ready") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ready"
            async with http.get(f"http://127.0.0.1:{metrics_port}/health") as resp:
                assert resp.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvroute.v1.ControlPlane"):
                assert (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            watch = health.Watch(health_pb2.HealthCheckRequest(service="kvroute.v1.ControlPlane"))
            assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
            stopping = asyncio.create_task(server.stop(grace_s=2.0))
            assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING  # before the server goes away
            watch.cancel()
            await stopping
            stopped = True
    finally:
        if not stopped:
            await server.stop(0)


async def test_a_trtllm_agent_is_ready_only_while_its_polls_are_answered() -> None:
    """The pull path has no connection to watch: the agent is following while POST /kv_cache_events answers."""
    from aiohttp import web

    from kvroute.worker_agent.agent import AgentConfig, WorkerAgent

    async def events(request: web.Request) -> web.Response:
        return web.json_response([])

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/kv_cache_events", events)
    app.router.add_get("/v1/models", models)
    engine = web.AppRunner(app)
    await engine.setup()
    engine_port = free_port()
    await web.TCPSite(engine, "127.0.0.1", engine_port).start()
    cp = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    cp_port = await cp.start()
    metrics_port = free_port()
    agent = WorkerAgent(
        AgentConfig(
            control_plane=f"127.0.0.1:{cp_port}",
            engine="trtllm",
            engine_url=f"http://127.0.0.1:{engine_port}",
            worker_id="trt-0",
            model="tiny",
            block_size=32,
            metrics_port=metrics_port,
            kv_events_poll_interval_s=0.05,
        )
    )
    assert agent.poller is not None
    agent.poller.timeout_s = 0.25  # following = a poll answered within two timeouts: 0.5 s here
    task = asyncio.create_task(agent.run())

    async def ready() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{metrics_port}/ready") as resp:
            return resp.status, await resp.json()

    async def until_status(want: int) -> dict:
        for _ in range(100):
            try:
                status, body = await ready()
            except aiohttp.ClientConnectionError:
                status, body = 0, {}
            if status == want:
                return body
            await asyncio.sleep(0.1)
        raise AssertionError(f"/ready never answered {want}: {body}")

    try:
        body = await until_status(200)
        assert body["workers"][0]["following_events"] is True
        await engine.cleanup()  # the engine goes away
        body = await until_status(503)
        assert any(
            f"not receiving KV events: no POST http://127.0.0.1:{engine_port}/kv_cache_events answered" in p
            for p in body["problems"]
        ), body
        assert not any("control plane" in p for p in body["problems"])  # still connected there
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await cp.stop(0)
        await engine.cleanup()


def _grpc_health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _eventually(check: Callable[[], object], timeout: float, what: str, every: Callable[[], object] = lambda: None):
    """Poll `check()` until truthy (calling `every()` before each try); the last value on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        every()
        result = check()
        if result or time.monotonic() > deadline:
            assert result, f"timed out waiting for {what}"
            return result
        time.sleep(0.1)


@pytest.fixture
def cluster(local_fleet):
    return local_fleet("readiness", heartbeat_timeout_s=3.0)


def test_router_and_agent_readiness_follow_control_plane_and_engines(cluster: LocalCluster) -> None:
    cp_port, grpc_port = free_port(), free_port()
    cluster.control_plane_addr = f"127.0.0.1:{cp_port}"  # nothing listens there yet
    router = cluster.start_router("r", "kv_aware", "--grpc-port", str(grpc_port))
    router_grpc = f"127.0.0.1:{grpc_port}"
    engine = cluster.add_sim_engine("engine-0")
    cluster.wait_engines_healthy()

    # 1. No control plane, no static fleet: alive, not ready, and both say why.
    assert http_get(router + "/health")[0] == 200
    status, body = get_ready(router)
    assert status == 503 and body["status"] == "not_ready" and body["fleet"] == "none"
    assert any(f"control plane {cluster.control_plane_addr} not reached" in p for p in body["problems"]), body
    assert _grpc_health(router_grpc) == NOT_SERVING and _grpc_health(router_grpc, "kvroute.v1.Router") == NOT_SERVING
    status, body = _eventually(
        lambda: (r := get_ready(engine.agent_metrics_url))[0] and r[1]["workers"][0]["control_plane"] != "connecting" and r,
        20,
        "the agent's first connection attempt",
    )
    assert status == 503 and any(
        f"engine-0: not connected to the control plane: control plane {cluster.control_plane_addr} unreachable" in p
        for p in body["problems"]
    ), body
    assert http_get(engine.agent_metrics_url + "/health")[0] == 200

    # 2. The control plane comes: all ready.
    cluster.start_control_plane(cp_port)
    cluster.wait_workers_registered()
    _eventually(lambda: get_ready(router)[0] == 200, 10, "router ready")
    _eventually(lambda: _grpc_health(router_grpc) == SERVING, 5, "router gRPC health SERVING")
    assert _grpc_health(cluster.control_plane_addr, "kvroute.v1.ControlPlane") == SERVING
    status, body = _eventually(lambda: (r := get_ready(engine.agent_metrics_url))[0] == 200 and r, 10, "agent ready")
    assert body["problems"] == [] and body["workers"][0]["following_events"] is True

    # 3. The control plane dies: the router fails open (ready, degraded), the agent is not ready.
    cluster.control_plane.stop()
    status, body = _eventually(lambda: (r := get_ready(router))[1]["status"] == "degraded" and r, 10, "router degraded")
    assert status == 200 and body["fleet"] == "view" and body["workers"] == 1  # its last view of the fleet
    assert any("unreachable" in p for p in body["problems"]) and body["control_plane"]["reachable"] is False
    assert _grpc_health(router_grpc) == SERVING
    status, body = _eventually(lambda: (r := get_ready(engine.agent_metrics_url))[0] == 503 and r, 10, "agent not ready")
    assert any("not connected to the control plane" in p for p in body["problems"]), body

    # 4. Every engine down: once requests failed on it, the router is not ready (gRPC health too).
    cluster.restart_control_plane()
    cluster.wait_workers_registered()
    _eventually(lambda: get_ready(router)[1]["status"] == "ready", 10, "router ready again")
    engine.engine.stop()
    request = cluster.chat_request("You are terse.", "Say hi.")

    def fail_a_request() -> None:  # each failure restarts the proxy's 2 s cooldown for the worker
        assert http_post_json(router + "/v1/chat/completions", request)[0] == 502

    status, body = _eventually(lambda: (r := get_ready(router))[0] == 503 and r, 10, "router not ready", every=fail_a_request)
    assert body["cooling_down"] == ["engine-0"] and body["healthy_workers"] == 0
    assert any("every worker of model 'tiny-llama' failed" in p for p in body["problems"]), body
    _eventually(
        lambda: _grpc_health(router_grpc, "kvroute.v1.Router") == NOT_SERVING,
        10,
        "router gRPC health NOT_SERVING",
        every=fail_a_request,
    )
    # The agent of the dead engine: its publisher connection went away.
    status, body = _eventually(lambda: (r := get_ready(engine.agent_metrics_url))[0] == 503 and r, 10, "agent not ready")
    assert any("engine-0: not receiving KV events" in p for p in body["problems"]), body


async def test_a_router_says_listening_at_bind_and_ready_only_once_its_ready_answers_200(tmp_path, tiny_model_dir) -> None:
    """ "router ready" while GET /ready answers 503 sends operators (and scripts that grep logs) the wrong way."""
    from kvroute.tools.local_cluster import ManagedProcess, kvroute_argv, wait_until
    from tests.helpers import FakeAgent, eventually

    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    cp_port = await server.start()
    port_file = tmp_path / "router.ports"
    router = ManagedProcess(
        "router",
        kvroute_argv(
            "router",
            "--control-plane",
            f"127.0.0.1:{cp_port}",
            "--tokenizer",
            str(tiny_model_dir),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--grpc-port",
            "off",
        ),
        tmp_path / "router.log",
        port_file=port_file,
    )
    agent = None
    try:
        router.start()
        url = f"http://127.0.0.1:{router.wait_ports()['http']}"
        log = tmp_path / "router.log"
        wait_until(lambda: "router listening: http://127.0.0.1:" in log.read_text(), 30, "the listening line", [router])
        assert "decisions on this router's own view of the fleet" in log.read_text(), log.read_text()
        await eventually(lambda: http_get(url + "/ready")[0] == 503, 30)  # the control plane lists no worker
        assert "router ready" not in log.read_text(), log.read_text()
        agent = FakeAgent(f"127.0.0.1:{cp_port}")
        await agent.claim("w0", "http://127.0.0.1:1", {"gpu": [1]})
        await eventually(lambda: http_get(url + "/ready")[0] == 200, 30)
        await eventually(lambda: "router ready: 1 of 1 workers of model tiny-llama healthy" in log.read_text(), 10)
        text = log.read_text()
        assert text.index("router listening") < text.index("router ready"), text
    finally:
        router.stop()
        if agent is not None:
            await agent.close()
        await server.stop(0)
