"""The proxy's upstream client against real sockets: keep-alive reuse, chunked bodies, engines that
close idle connections, malformed answers and silent engines."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from kvroute.data_plane.http.upstream import UpstreamPool


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_keep_alive_connections_are_reused_and_chunked_bodies_undone() -> None:
    peers: set = set()

    async def plain(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))
        return web.json_response({"got": (await request.read()).decode(), "ct": request.headers["Content-Type"]})

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/plain", plain)
    app.router.add_post("/sse", chunked)
    runner, url = await _serve(app)
    pool = UpstreamPool()
    try:
        for i in range(5):
            response = await pool.post(url + "/plain", f"body {i}".encode(), {"Content-Type": "application/json"})
            assert response.status == 200 and response.content_length is not None
            assert await response.read() == f'{{"got": "body {i}", "ct": "application/json"}}'.encode()
            response.release()
        assert len(peers) == 1  # one connection, kept alive
        response = await pool.post(url + "/sse", b"{}", {})
        assert response.content_length is None and await response.read() == b"data: 1\n\ndata: 2\n\n"
        response.release()
    finally:
        await pool.close()
        await runner.cleanup()


async def _raw_server(answer: bytes | None, per_connection: int = 0) -> tuple[asyncio.Server, str, list[int]]:
    """Answers requests with `answer` (None: never answers); with `per_connection`, a connection that
    gets one request more than that is closed without an answer (a keep-alive timer that fired as
    the request arrived)."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        served = 0
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                await reader.read(64 * 1024)  # the small body (tests send a few bytes)
                if per_connection and served == per_connection:
                    break
                if answer is None:
                    await asyncio.sleep(3600)
                writer.write(answer)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections


async def test_an_idle_connection_the_engine_closed_is_retried_on_a_new_one() -> None:
    server, url, connections = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", per_connection=1)
    pool = UpstreamPool()
    try:
        for _ in range(3):  # each pooled connection is closed on its second request, before any answer
            response = await pool.post(url + "/x", b"{}", {})
            assert response.status == 200 and await response.read() == b"ok"
            response.release()
        assert len(connections) == 3
    finally:
        await pool.close()
        server.close()


async def test_malformed_and_silent_engines_raise_what_the_proxy_retries_on() -> None:
    server, url, _ = await _raw_server(b"NOT HTTP AT ALL\r\n\r\n")
    pool = UpstreamPool(read_timeout_s=0.2)
    try:
        with pytest.raises(ConnectionResetError):
            await pool.post(url + "/x", b"{}", {})
    finally:
        server.close()
    server, url, _ = await _raw_server(None)
    try:
        with pytest.raises(TimeoutError):
            await pool.post(url + "/x", b"{}", {})
        with pytest.raises(OSError):  # nothing listens there any more
            await UpstreamPool(connect_timeout_s=0.5).post("http://127.0.0.1:1/x", b"", {})
    finally:
        await pool.close()
        server.close()


async def test_the_control_plane_hears_one_message_for_a_whole_answer_and_two_for_a_stream() -> None:
    from kvroute.data_plane.cp_link.inflight import RouterInflight
    from kvroute.data_plane.decision.policies import Candidate
    from kvroute.data_plane.engines.backend_health import BackendHealth
    from kvroute.data_plane.http.proxy import BackendProxy
    from kvroute.data_plane.ops.metrics import RouterMetrics
    from kvroute.data_plane.service.routing import RouteDecision

    class Session:  # what RouterInflight tells the router session
        def __init__(self) -> None:
            self.sent: list[str] = []

        def reserve(self, *args) -> int:
            self.sent.append("reserve")
            return len(self.sent)

        def prefill_done(self, reservation_id: int) -> None:
            self.sent.append("prefill_done")

        def release(self, reservation_id: int) -> None:
            self.sent.append("release")

    async def engine(request: web.Request) -> web.StreamResponse:
        if request.path == "/json":
            return web.json_response({"ok": True})
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await response.write_eof()
        return response

    engine_app = web.Application()
    engine_app.router.add_post("/{kind}", engine)
    engine_runner, engine_url = await _serve(engine_app)
    session = Session()
    proxy = BackendProxy(RouterInflight(session), BackendHealth(), RouterMetrics())  # type: ignore[arg-type]
    decision = RouteDecision("w", engine_url, 10, 0, "kv_aware", False, [Candidate("w", engine_url, 16)])

    async def forward(request: web.Request) -> web.StreamResponse:
        return await proxy.forward(request, request.path, await request.read(), decision, 10)

    app = web.Application()
    app.router.add_post("/{kind}", forward)
    app.on_startup.append(lambda _app: proxy.open())
    app.on_cleanup.append(lambda _app: proxy.close())
    runner, url = await _serve(app)
    pool = UpstreamPool()
    try:
        for kind, expected in (("json", ["reserve", "release"]), ("sse", ["reserve", "prefill_done", "release"])):
            session.sent.clear()
            response = await pool.post(f"{url}/{kind}", b"{}", {})
            assert response.status == 200 and await response.read()
            response.release()
            assert session.sent == expected, kind
    finally:
        await pool.close()
        await runner.cleanup()
        await engine_runner.cleanup()
