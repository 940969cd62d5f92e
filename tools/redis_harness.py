"""Real Redis servers for tests and benches: a single server, a 3-master Cluster, and a TCP proxy
that can cut one client off.

Each server is its own `redis-server` process on a free loopback port, with nothing persisted
(`--save "" --appendonly no`) and its files in a directory of its own, so runs are isolated from
the shared Redis on 6379 and from each other. `redis-server` must be installed (CI's `.ci/run`
installs it); its absence is an error, never a skip.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.tools.local_cluster import ManagedProcess, _bindable, free_port, wait_until


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server); the replica tests need it")
    return path


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port` (a free one unless given)."""

    workdir: Path
    port: int = 0
    cluster: bool = False
    process: ManagedProcess | None = None

    def start(self) -> RedisServer:
        if not self.port:
            self.port = _free_port_with_bus() if self.cluster else free_port()
        data = self.workdir / f"redis-{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
            "--protected-mode",
            "no",
        ]
        if self.cluster:
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(data / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        self.process = ManagedProcess(f"redis-{self.port}", argv, self.workdir / f"redis-{self.port}.log")
        self.process.start()
        wait_until(lambda: _ping(self.port), 10, f"redis-server on {self.port}", [self.process], interval=0.02)
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        out = subprocess.run(
            [redis_binary("redis-cli"), "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        return out.stdout

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _free_port_with_bus() -> int:
    """A free port whose Cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class RedisClusterHarness:
    """A local Redis Cluster of `masters` masters and no replicas, all slots assigned."""

    workdir: Path
    masters: int = 3
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self) -> RedisClusterHarness:
        self.nodes = [RedisServer(self.workdir, cluster=True).start() for _ in range(self.masters)]
        subprocess.run(
            [
                redis_binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        wait_until(
            lambda: all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes),
            30,
            "redis cluster state ok",
            [n.process for n in self.nodes if n.process],
            interval=0.1,
        )
        return self

    @property
    def url(self) -> str:
        """The cluster URL form kvroute takes (any node is a seed)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class TcpProxy:
    """A loopback TCP proxy in a thread of its own: clients connect to `port`, bytes go to `target`.

    `cut()` closes every open connection and refuses new ones (a Redis that went away for this
    client alone); `restore()` accepts again. Runs its own event loop so a test's synchronous code
    and a live fleet can both use it."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._cut = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._conns: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{self.port}", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.connections = 0

    def start(self) -> TcpProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut.is_set():
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._conns.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns.difference_update((writer, up_writer))

    def cut(self) -> None:
        """Drop every connection now and refuse new ones until `restore()`."""
        self._cut.set()

        def abort_all() -> None:
            for writer in list(self._conns):
                writer.transport.abort()
            self._conns.clear()

        self._loop.call_soon_threadsafe(abort_all)
        time.sleep(0.05)

    def restore(self) -> None:
        self._cut.clear()

    def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def temp_workdir(prefix: str = "kvroute-redis-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
