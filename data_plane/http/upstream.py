"""The proxy's HTTP/1.1 client to engines: pooled keep-alive connections, parsed by httptools.

    pool = UpstreamPool(connect_timeout_s=2.0, read_timeout_s=1800.0)
    response = await pool.post("http://engine:8000/v1/completions", body, headers)
    response.status, response.reason, response.headers, response.content_length
    chunk = await response.readany()    # b"" at the end of the body (chunked encoding already undone)
    rest = await response.read()        # everything left
    response.release()                  # the connection goes back to the pool if the body was read whole

Why not aiohttp's client: per request it cost ~0.2 ms more than this on the same event loop (a
pass-through measured both, docs/benchmarks/2026-12-03-router-overhead.md), as much as everything
else the router does for a round_robin request. httptools (llhttp, the parser uvloop's authors
maintain) does the HTTP parsing; this module only writes the request and keeps connections.

Errors are OSError (refused, reset, the engine closing before the end of its answer; a malformed
answer is a ConnectionResetError too, and its connection is closed) or TimeoutError (connecting,
or no byte for `read_timeout_s`), as the proxy expects. An idle pooled connection the engine has
closed meanwhile is retried once on a new connection when it fails before any byte of the
answer (the engine never saw that request); idle connections older than `keepalive_s` are not
reused (engines close theirs after some idle time). `https://` endpoints use `ssl_context` (the
router's --engine-tls-ca), else the default TLS context. A body the client reads slower than the engine sends pauses the engine's socket past
`high_water` buffered bytes.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

_Key = tuple[str, int, bool]  # host, port, TLS


class BadEndpoint(ValueError):
    """A worker's endpoint that is no http(s) URL (workers register it themselves): that worker fails."""


class _Connection(asyncio.Protocol):
    def __init__(self, high_water: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.high_water = high_water
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[str, str]] = []
        self.keep_alive = False
        self.got_bytes = False  # any byte of the current answer arrived
        self.headers_done: asyncio.Future | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            self._fail(ConnectionResetError(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionResetError(f"malformed answer from the engine: {exc}"))
            self.close()

    # ------------------------------------------------------------ httptools callbacks

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > self.high_water and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ------------------------------------------------------------ helpers

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self._wake()

    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.error is None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        return data


class UpstreamResponse:
    def __init__(self, pool: UpstreamPool, key: _Key, conn: _Connection) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status = conn.status
        self.reason = conn.reason.decode("latin-1")
        self.headers = conn.headers
        length = next((v for k, v in conn.headers if k.lower() == "content-length"), None)
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._released = False

    async def readany(self) -> bytes:
        """The next part of the body as it arrives; b"" once it is all read."""
        conn = self._conn
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            conn.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(self._pool.read_timeout_s):
                    await conn.waiter
            finally:
                conn.waiter = None
        return conn.take()

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool if the answer was read whole on a keep-alive connection, else closed."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.complete and not conn.chunks and conn.keep_alive and conn.usable():
            self._pool._put(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 1800.0,
        keepalive_s: float = 15.0,
        max_idle_per_engine: int = 256,
        high_water: int = 1 << 20,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.keepalive_s, self.max_idle, self.high_water = keepalive_s, max_idle_per_engine, high_water
        self._idle: dict[_Key, list[_Connection]] = {}
        self._targets: dict[str, tuple[_Key, bytes, bytes]] = {}  # url -> (key, path, Host header value)
        self._ssl: ssl.SSLContext | None = ssl_context  # None: the default context, made at the first https://

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        key, path, host = self._target(url)
        head = [b"POST ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
        for name, value in headers.items():  # as the client sent them: aiohttp decoded UTF-8, with surrogate escapes
            head += (name.encode("utf-8", "surrogateescape"), b": ", value.encode("utf-8", "surrogateescape"), b"\r\n")
        head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n")
        request = b"".join(head) + body
        conn, reused = self._get(key), True
        if conn is None:
            conn, reused = await self._connect(key), False
        try:
            return await self._exchange(key, conn, request)
        except OSError as exc:
            if isinstance(exc, TimeoutError) or not reused or conn.got_bytes:
                raise
        # A pooled connection the engine had closed: the request never reached it, try a new one.
        return await self._exchange(key, await self._connect(key), request)

    async def _exchange(self, key: _Key, conn: _Connection, request: bytes) -> UpstreamResponse:
        conn._reset()
        conn.headers_done = asyncio.get_running_loop().create_future()
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            async with asyncio.timeout(self.read_timeout_s):
                await conn.headers_done
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, key, conn)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _target(self, url: str) -> tuple[_Key, bytes, bytes]:
        target = self._targets.get(url)
        if target is None:
            try:
                parts = urlsplit(url)
                port = parts.port  # ValueError when it is not a number in 0..65535
            except ValueError as exc:
                raise BadEndpoint(f"not an http(s) URL: {url!r} ({exc})") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise BadEndpoint(f"not an http(s) URL: {url!r}")
            tls = parts.scheme == "https"
            port = port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = self._targets[url] = ((parts.hostname, port, tls), path.encode(), parts.netloc.encode())
        return target

    def _get(self, key: _Key) -> _Connection | None:
        conns = self._idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if conn.usable() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _put(self, key: _Key, conn: _Connection) -> None:
        conns = self._idle.setdefault(key, [])
        if len(conns) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conns.append(conn)

    async def _connect(self, key: _Key) -> _Connection:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Connection(self.high_water), host, port, ssl=self._ssl if tls else None
            )
        return conn
