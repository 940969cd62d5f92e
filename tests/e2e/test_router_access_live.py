"""The router's access control against live router processes over real sockets (issue 17, items 3-4):
API keys on HTTP and on the gRPC Router API (401 / 403 / 200, OpenAI error JSON, probes open, the
keys file reloaded), whether the client's Authorization reaches the engine, an https:// engine
verified with --engine-tls-ca, and --max-concurrent-requests answering 429 with Retry-After
instead of queueing. The engine is a small recording HTTP(S) server in the test process; the
control-plane address has nothing behind it, so the routers use their --static-workers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from kvroute.tools.local_cluster import ManagedProcess, free_port, http_ok, kvroute_argv, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.tls_certs import TestCA

MODEL = "tiny"
FULL_KEY, ROUTE_KEY, ENV_KEY, LATE_KEY = "sk-full-0123", "sk-route-4567", "sk-env-89ab", "sk-late-cdef"


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class RecordingEngine:
    """An OpenAI-ish engine that records the headers it was sent and can hold requests open."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.delay_s = 0.0
        self.in_progress = 0
        self.most_in_progress = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def complete(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        self.in_progress += 1
        self.most_in_progress = max(self.most_in_progress, self.in_progress)
        try:
            await request.read()
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_progress -= 1
        return web.json_response({"id": "x", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=ssl_context).start()
        self.url = f"{'https' if ssl_context else 'http'}://{'localhost' if ssl_context else '127.0.0.1'}:{port}"
        return self.url


def start_router(
    workdir: Path, model_dir: Path, name: str, engine_url: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[ManagedProcess, str, int]:
    port, grpc_port = free_port(), free_port()
    router = ManagedProcess(
        f"router-{name}",
        kvroute_argv(
            "router",
            "--control-plane",
            f"127.0.0.1:{free_port()}",
            "--policy",
            "round_robin",
            "--static-workers",
            f"engine={engine_url}",
            "--tokenizer",
            str(model_dir),
            "--model",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            *extra,
        ),
        workdir / f"{name}.log",
    )
    router.start(env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(url + "/health"), 30, f"router {name}", [router])
    return router, url, grpc_port


def completion(authorization: str | None = None) -> tuple[dict, dict[str, str]]:
    headers = {"Authorization": authorization} if authorization else {}
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 2}, headers


async def post(
    session: aiohttp.ClientSession, url: str, authorization: str | None = None, path: str = "/v1/completions"
) -> tuple[int, dict, dict[str, str]]:
    body, headers = completion(authorization)
    async with session.post(url + path, json=body, headers=headers) as response:
        return response.status, json.loads(await response.read() or b"{}"), dict(response.headers)


def assert_openai_error(body: dict, code: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error", body


async def test_api_keys_scopes_reload_and_authorization_not_forwarded(tmp_path, tiny_model_dir):
    engine = RecordingEngine()
    engine_url = await engine.start()
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"# router keys\n{sha(FULL_KEY)} ci-full\n{sha(ROUTE_KEY)} app scope=route\n")
    router, url, grpc_port = start_router(
        tmp_path, tiny_model_dir, "keys", engine_url, "--api-keys-file", str(keys_file), env={"KVROUTE_API_KEYS": ENV_KEY}
    )
    try:
        async with aiohttp.ClientSession() as session:
            status, body, headers = await post(session, url)
            assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")
            assert_openai_error(body, "invalid_api_key")
            assert "didn't provide an API key" in body["error"]["message"]
            status, body, _ = await post(session, url, "Bearer sk-wrong")
            assert status == 401 and body["error"]["message"] == "Incorrect API key provided."
            status, body, _ = await post(session, url, f"Basic {FULL_KEY}")
            assert status == 401
            assert engine.seen == []  # nothing refused reached the engine

            status, body, headers = await post(session, url, f"Bearer {FULL_KEY}")
            assert status == 200 and headers["x-kvroute-worker"] == "engine", body
            assert "Authorization" not in engine.seen[-1] and "authorization" not in {k.lower() for k in engine.seen[-1]}
            status, _, _ = await post(session, url, f"Bearer {ENV_KEY}")
            assert status == 200

            # A route-only key: decisions yes, proxied requests no.
            status, body, _ = await post(session, url, f"Bearer {ROUTE_KEY}")
            assert status == 403
            assert_openai_error(body, "permission_denied")
            status, body, _ = await post(session, url, f"Bearer {ROUTE_KEY}", path="/v1/route")
            assert status == 200 and body["worker_id"] == "engine", body

            for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
                async with session.get(url + path) as response:
                    assert response.status != 401, path
            async with session.get(url + "/metrics") as response:
                metrics = await response.text()
            assert 'kvroute_router_refused_requests_total{reason="unauthenticated"} 3.0' in metrics
            assert 'kvroute_router_refused_requests_total{reason="forbidden"} 1.0' in metrics

            # The keys file is read again when it changes.
            status, _, _ = await post(session, url, f"Bearer {LATE_KEY}")
            assert status == 401
            keys_file.write_text(keys_file.read_text() + f"{sha(LATE_KEY)} late\n")
            deadline = time.monotonic() + 5
            while (status := (await post(session, url, f"Bearer {LATE_KEY}"))[0]) != 200:
                assert time.monotonic() < deadline, "the new key was not picked up"
                await asyncio.sleep(0.2)

        # gRPC Router API: metadata `authorization`; health stays open.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            route = pb_grpc.RouterStub(channel).Route
            request = pb.RouteRequest(model=MODEL, prompt="hello there")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await route(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await route(request, metadata=(("authorization", "Bearer sk-wrong"),), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = await route(request, metadata=(("authorization", f"Bearer {ROUTE_KEY}"),), timeout=5)
            assert answer.worker_id == "engine"
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        router.stop()
        await engine.runner.cleanup()


async def test_forward_authorization_to_an_https_engine(tmp_path, tiny_model_dir):
    ca = TestCA(tmp_path / "pki")
    engine_cert = ca.issue("engine")
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(engine_cert.cert, engine_cert.key)
    engine = RecordingEngine()
    engine_url = await engine.start(server_ssl)
    # Without the engine's CA the router cannot verify it: every attempt fails (502), nothing is sent.
    router, url, _ = start_router(tmp_path, tiny_model_dir, "no-ca", engine_url, "--forward-authorization")
    try:
        async with aiohttp.ClientSession() as session:
            status, body, _ = await post(session, url, "Bearer engine-token")
            assert status == 502 and body["error"]["code"] == "backend_unavailable"
            assert engine.seen == []
    finally:
        router.stop()
    router, url, _ = start_router(
        tmp_path, tiny_model_dir, "forward", engine_url, "--forward-authorization", "--engine-tls-ca", str(ca.ca_path)
    )
    try:
        async with aiohttp.ClientSession() as session:
            status, body, _ = await post(session, url, "Bearer engine-token")
            assert status == 200, body
            assert engine.seen[-1].get("Authorization") == "Bearer engine-token"
    finally:
        router.stop()
        await engine.runner.cleanup()


async def test_concurrency_limit_answers_429_with_retry_after(tmp_path, tiny_model_dir):
    engine = RecordingEngine()
    engine_url = await engine.start()
    engine.delay_s = 2.0
    router, url, _ = start_router(tmp_path, tiny_model_dir, "limit", engine_url, "--max-concurrent-requests", "2")
    try:
        async with aiohttp.ClientSession() as session:
            held = [asyncio.create_task(post(session, url)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while engine.in_progress < 2:
                assert time.monotonic() < deadline, "the first two requests did not reach the engine"
                await asyncio.sleep(0.02)
            started = time.monotonic()
            refused = await asyncio.gather(*(post(session, url) for _ in range(3)))
            assert time.monotonic() - started < 1.0  # answered at once, not queued behind the held ones
            for status, body, headers in refused:
                assert status == 429 and headers["Retry-After"] == "1", (status, body)
                assert body["error"]["code"] == "too_many_requests" and body["error"]["type"] == "invalid_request_error"
            assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
            assert engine.most_in_progress == 2
            engine.delay_s = 0.0
            assert (await post(session, url))[0] == 200  # capacity is back once they finished
            async with session.get(url + "/metrics") as response:
                assert 'kvroute_router_refused_requests_total{reason="over_capacity"} 3.0' in await response.text()
    finally:
        router.stop()
        await engine.runner.cleanup()
