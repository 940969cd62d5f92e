"""Opening listeners, the one way every kvroute process does it.

A port in use, a host that does not resolve or an address that is not HOST:PORT raises
`ListenError`, whose message is one line naming the flag and the address; `run_service` prints it
to stderr as `kvroute COMMAND: error: ...` and exits with code 2, without a traceback.

gRPC sets SO_REUSEPORT on its listeners on Linux unless told not to, so a second server on a port
in use binds silently and the kernel spreads new connections over both: `GrpcListener` turns it
off (`grpc.so_reuseport` 0) and also serves standard gRPC health checking (`grpc.health.v1.Health`)
on every kvroute gRPC server. aiohttp and ZMQ listeners never set SO_REUSEPORT, so their bind fails
by itself; here it only becomes the same one line.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvroute import addresses, aio
from kvroute.addresses import HostPort

if TYPE_CHECKING:
    import ssl

    import grpc
    import zmq
    from aiohttp import web
    from grpc_health.v1.health import aio as health_aio

EXIT_CANNOT_LISTEN = 2
GRPC_NO_REUSEPORT = ("grpc.so_reuseport", 0)
Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]  # an aiohttp GET handler


class ListenError(Exception):
    """A listener could not be opened; str() is the one line to show (flag, address, why)."""

    def __init__(self, flag: str, address: str, reason: str) -> None:
        super().__init__(f"{flag} {address}: {reason}")
        self.flag, self.address, self.reason = flag, address, reason


def check_port(flag: str, host: str, port: int) -> HostPort:
    if not 0 <= port <= 65535:
        raise ListenError(flag, f"{host}:{port}", "port must be 0..65535")
    return HostPort(host, port)


def parse_host_port(flag: str, address: str) -> HostPort:
    """HOST:PORT, [IPv6]:PORT; port 0 = any free port (kvroute.addresses.listen_address, the flags' type)."""
    try:
        return addresses.parse_host_port(address, allow_zero=True)
    except argparse.ArgumentTypeError as exc:
        raise ListenError(flag, address, str(exc)) from None


def describe_os_error(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host ({exc.strerror or exc})"
    if exc.errno == errno.EADDRINUSE:
        return "address already in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "no such local address"
    if exc.errno == errno.EACCES:
        return "permission denied"
    return exc.strerror or str(exc)


def refuse_if_in_use(flag: str, address: HostPort) -> None:
    """Bind a throwaway socket on every address the host resolves to (with SO_REUSEADDR, as gRPC and
    aiohttp do): a listener already there fails it with EADDRINUSE. gRPC's own failure would also
    print several lines of C-core logging before its one-line exception."""
    if address.port == 0:
        return
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(flag, str(address), describe_os_error(exc)) from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise ListenError(flag, str(address), describe_os_error(exc)) from None
                # e.g. ::1 on a host without IPv6: gRPC skips such an address too


class GrpcListener:
    """A grpc.aio server bound without SO_REUSEPORT, with `grpc.health.v1.Health` for the server
    ("") and each of `services`: NOT_SERVING until `set_serving(True)`, NOT_SERVING for good after
    `stop()`; and server reflection listing `services`. Add the servicers to `server`, then `start()`.
    `credentials` (kvroute.tls.ServerTls.grpc_credentials()): serve TLS instead of plaintext;
    `interceptors`: grpc.aio server interceptors (e.g. API keys); `health_names`: more names whose
    health status follows the server's, that are no service (GAIE's "readiness")."""

    def __init__(
        self,
        flag: str,
        address: str,
        services: Sequence[str] = (),
        options: Iterable[tuple[str, Any]] = (),
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        health_names: Sequence[str] = (),
    ) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_health.v1.health import aio as health_aio
        from grpc_reflection.v1alpha import reflection

        where = parse_host_port(flag, address)
        refuse_if_in_use(flag, where)
        self.server: grpc.aio.Server = grpc.aio.server(
            options=[*options, GRPC_NO_REUSEPORT], interceptors=list(interceptors) or None
        )
        try:
            self.port = (
                self.server.add_secure_port(str(where), credentials)
                if credentials is not None
                else self.server.add_insecure_port(str(where))
            )
        except RuntimeError:  # what grpc.aio raises for any bind failure (older releases returned 0)
            self.port = 0
        if self.port == 0:
            raise ListenError(flag, address, "gRPC could not listen there")
        self.host = where.host
        self.services = ("", *services, *health_names)
        self.serving = False
        self.health: health_aio.HealthServicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Server reflection, so grpcurl and gRPC UIs can list and call the services without the .proto.
        reflection.enable_server_reflection(
            (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self.server
        )

    async def start(self, serving: bool = True) -> None:
        for service in self.services:  # the servicer starts with "" SERVING: not before we say so
            await self.health.set(service, _status(False))
        await self.server.start()
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            for service in self.services:
                await self.health.set(service, _status(serving))

    async def follow(self, ready: Callable[[], bool], interval_s: float = 0.5) -> None:
        """Keep the health status equal to `ready()`, checked every `interval_s` (until cancelled)."""
        while True:
            await self.set_serving(ready())
            await asyncio.sleep(interval_s)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        self.serving = False
        await self.server.stop(grace_s)


def _status(serving: bool) -> int:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


async def start_http_site(
    runner: web.AppRunner, flag: str, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> int:
    """Start an aiohttp site on host:port (0 = any free port), HTTPS with `ssl_context`; the bound port."""
    from aiohttp import web

    where = check_port(flag, host, port)
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        raise ListenError(flag, str(where), describe_os_error(exc)) from None
    server = site._server  # the listening sockets; the public `runner.addresses` mixes every site
    return server.sockets[0].getsockname()[1] if server is not None and server.sockets else port


async def start_status_site(flag: str, host: str, port: int, routes: dict[str, Handler]) -> tuple[web.AppRunner, int]:
    """A small HTTP app answering GET on each of `routes` (path -> handler), e.g. /metrics, /health and
    /ready on a process's --metrics-port: (its runner, to clean up; the bound port)."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        return runner, await start_http_site(runner, flag, host, port)
    except ListenError:
        await runner.cleanup()
        raise


def open_zmq(sock: zmq.Socket, flag: str, endpoint: str, *, bind: bool) -> str:
    """Bind or connect a ZMQ socket; the bound endpoint (port 0 resolved) or `endpoint`."""
    import zmq

    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
        raise ListenError(flag, endpoint, reason) from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def run_service(command: str, main: Coroutine[Any, Any, int | None]) -> int:
    """aio.run(main); a ListenError becomes one line on stderr and exit code 2."""
    try:
        return aio.run(main)
    except ListenError as exc:
        print(f"kvroute {command}: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LISTEN
