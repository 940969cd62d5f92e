"""Router process: W3C trace context reaches the backend, static fallback fleet while the control
plane was never reachable, and the gRPC Route service."""

from __future__ import annotations

import asyncio

import grpc
from aiohttp import web

from kvroute.tools.local_cluster import LocalCluster, free_port, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc


async def test_traceparent_reaches_backend_and_grpc_route_fails_open(tmp_path, tiny_model_dir) -> None:
    seen_headers: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen_headers.append(dict(request.headers))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    backend_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", backend_port).start()

    cluster = LocalCluster(workdir=tmp_path, tokenizer_dir=tiny_model_dir)
    cluster.control_plane_addr = f"127.0.0.1:{free_port()}"  # nothing listens: never reachable
    grpc_port = free_port()
    try:
        url = await asyncio.to_thread(
            cluster.start_router,
            "r",
            "kv_aware",
            "--static-workers",
            f"fake=http://127.0.0.1:{backend_port}",
            "--grpc-port",
            str(grpc_port),
            env={"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"},
        )
        import aiohttp

        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny-llama", "prompt": "the cache router worker", "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-worker"] == "fake"
                text = await resp.text()
            assert "[DONE]" in text
            async with session.post(url + "/v1/route", json=body) as resp:
                decision = await resp.json()
            assert decision["worker_id"] == "fake" and decision["fail_open"] is True
            async with session.post(url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
            async with session.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
                assert resp.status == 404
        traceparent = seen_headers[0].get("traceparent", "")
        assert traceparent.startswith("00-") and len(traceparent.split("-")) == 4

        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            answer = await stub.Route(
                pb.RouteRequest(
                    model="tiny-llama", messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")])
                ),
                timeout=5,
            )
            assert answer.worker_id == "fake" and answer.fail_open and answer.prompt_tokens > 0
            try:
                await stub.Route(pb.RouteRequest(model="tiny-llama"), timeout=5)
                raise AssertionError("empty RouteRequest must be rejected")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT

        def spans_logged() -> str | None:  # the batch span processor flushes to stderr every 100 ms
            log = (tmp_path / "router-r.log").read_text()
            return log if '"name": "kvroute.route"' in log and '"name": "kvroute.proxy"' in log else None

        log = wait_until(spans_logged, 10, "the router's spans on stderr")
        cluster.stop()
        assert traceparent.split("-")[1] in log  # the backend got the router's trace id
    finally:
        cluster.stop()
        await runner.cleanup()
