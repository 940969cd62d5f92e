"""Helpers shared by test modules (fixtures live in the conftest.py files; test modules never import
one another)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from packaging.requirements import Requirement

from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json_headers, kvroute_argv
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".kvroute-cache"  # what tests build once and keep (git ignores it)
FAKE_AGENT_BLOCK_SIZE = 16


async def eventually(
    predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01, what: str = "condition"
) -> object:
    """Poll `predicate()` on the running event loop until it is truthy (a coroutine function's result
    is awaited each time) and return that value; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert loop.time() < deadline, f"{what} not reached in time"
        await asyncio.sleep(interval)


def get_ready(url: str) -> tuple[int, dict]:
    """A process's GET /ready at base `url`: (status, JSON body); (0, {}) while nothing answers yet."""
    try:
        status, raw = http_get(url + "/ready")
    except OSError:
        return 0, {}
    return status, json.loads(raw)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements(lines: list[str]) -> dict[str, Requirement]:
    return {r.name.lower(): r for r in map(Requirement, lines)}


def floor(req: Requirement) -> str:
    """The version of the requirement's `>=` (or `==`) clause."""
    bounds = [s.version for s in req.specifier if s.operator in (">=", "==")]
    assert len(bounds) == 1, f"{req}: expected one lower bound"
    return bounds[0]


def floor_venv(deps: list[str], floors: dict[str, str]) -> Path:
    """A virtualenv with the declared dependencies and exactly `floors`, built once per pyproject
    and interpreter under .kvroute-cache/ (pip's own cache keeps the wheels)."""
    key = hashlib.sha256(f"{sys.version}\n{deps}\n{floors}".encode()).hexdigest()[:12]
    venv = CACHE / f"floor-venv-{key}"
    ready = venv / ".kvroute-ready"
    if ready.exists():
        return venv
    for stale in CACHE.glob("floor-venv-*"):  # built for another pyproject or interpreter
        shutil.rmtree(stale, ignore_errors=True)
    venv.parent.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "floors.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in floors.items()))
    install = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(constraints),
            *deps,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert install.returncode == 0, f"the floors do not install with the other dependencies:\n{install.stderr[-3000:]}"
    ready.touch()
    return venv


@dataclass(frozen=True)
class InstalledKvroute:
    venv: Path
    site_packages: Path
    added: frozenset[str]  # top-level site-packages entries the install added
    removed: frozenset[str]  # ... and took away

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


async def run_audit(cluster: LocalCluster, *args: str) -> tuple[int, dict, str]:
    proc = await asyncio.create_subprocess_exec(
        *kvroute_argv("audit", "--control-plane", cluster.control_plane_addr, *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    lines = out.decode().strip().splitlines()
    return proc.returncode, json.loads(lines[-1]), out.decode() + err.decode()


class FakeAgent:
    """A Connect stream that tells the control plane whatever the test wants, heartbeating meanwhile."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = pb_grpc.ControlPlaneStub(self.channel).Connect(self._messages())
        self.heartbeats: asyncio.Task | None = None

    async def _messages(self):
        while (message := await self.outbox.get()) is not None:
            yield message

    async def claim(self, worker_id: str, endpoint: str, tiers: dict[str, list[int]]) -> None:
        await self.outbox.put(
            pb.AgentMessage(
                register=pb.RegisterWorker(
                    worker_id=worker_id, model="tiny-llama", engine="sim", block_size=FAKE_AGENT_BLOCK_SIZE, endpoint=endpoint
                )
            )
        )
        await self.call.read()
        await self.outbox.put(
            pb.AgentMessage(
                batch=pb.EventBatch(
                    seq=1,
                    snapshot=True,
                    events=[
                        pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, tier=pb.Tier.Value(f"TIER_{tier.upper()}")))
                        for tier, keys in tiers.items()
                    ],
                )
            )
        )
        await self.call.read()
        self.heartbeats = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            await self.outbox.put(pb.AgentMessage(heartbeat=pb.Heartbeat(load=pb.WorkerLoad())))
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.heartbeats:
            self.heartbeats.cancel()
        await self.outbox.put(None)
        await self.channel.close()


def served_by(router: str, request: dict, n: int) -> set[str]:
    """The workers (x-kvroute-worker) that answered `n` chat requests through `router`, each a success."""
    chosen = set()
    for _ in range(n):
        status, headers, body = http_post_json_headers(router + "/v1/chat/completions", request)
        assert status == 200, body
        chosen.add(headers["x-kvroute-worker"])
    return chosen


# ---------------------------------------------------------------- documented blocks run as written


def doc_sh_blocks(document: str, heading: str, count: int = 1) -> list[str]:
    """The first `count` ```sh blocks after `heading` in `document` (a path from the repository's root,
    e.g. "README.md" or "docs/operations.md")."""
    text = (REPO / document).read_text()
    section = text[text.index(f"\n{heading}\n") :]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert len(blocks) >= count, f"fewer than {count} sh blocks under {heading} in {document}"
    return blocks[:count]


def doc_commands(block: str, *prefixes: str) -> str:
    """The commands of `block` that start with one of `prefixes`, each with its continuation lines
    (a block that says "after the X lines of another block" runs those first)."""
    picked, taking = [], False
    for line in block.splitlines():
        if not taking and line.startswith(prefixes):
            taking = True
        if taking:
            picked.append(line)
            taking = line.rstrip().endswith("\\")
    return "\n".join(picked) + "\n"


def doc_env() -> dict[str, str]:
    """The environment a documented block runs in: this test run's `kvroute` first on PATH (as after
    `. .venv/bin/activate`), and none of the machine's KVROUTE_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def with_free_ports(block: str, block_ports: tuple[int, ...]) -> tuple[str, dict[int, int]]:
    """`block` with each of `block_ports` (which it must use) replaced by a free port, and the mapping."""
    ports = {port: free_port() for port in block_ports}
    for port in block_ports:
        assert re.search(rf"\b{port}\b", block), f"the documented block no longer uses port {port}: update the test"
    return re.sub(r"\b(" + "|".join(map(str, block_ports)) + r")\b", lambda m: str(ports[int(m.group(1))]), block), ports


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- driving a control plane's gRPC streams

MODEL = "tiny"  # the model the streams below register workers for


class BidiStream:
    """One client stream of a bidi RPC, fed from a queue (None ends it)."""

    def __init__(self, rpc, message_type) -> None:
        self.message_type = message_type
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = rpc(self._messages())

    async def _messages(self):
        while (message := await self.outbox.get()) is not None:
            yield message

    async def send(self, **body) -> None:
        await self.outbox.put(self.message_type(**body))

    async def recv(self):
        return await asyncio.wait_for(self.call.read(), 5)

    async def close(self) -> None:
        await self.outbox.put(None)


class AgentStream(BidiStream):
    """Drives one Connect stream the way an agent does."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub) -> None:
        super().__init__(stub.Connect, pb.AgentMessage)

    async def register(self, worker_id: str, block_size: int = 4, **fields) -> pb.ControlMessage:
        await self.send(
            register=pb.RegisterWorker(
                worker_id=worker_id, model=MODEL, engine="sim", block_size=block_size, endpoint=f"http://{worker_id}", **fields
            )
        )
        return await self.recv()

    async def batch(self, seq: int, *events: pb.BlockEvent, snapshot: bool = False) -> pb.ControlMessage:
        await self.send(batch=pb.EventBatch(seq=seq, snapshot=snapshot, events=list(events)))
        return await self.recv()


def stored(keys: list[int], tier: int = pb.TIER_GPU) -> pb.BlockEvent:
    return pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, tier=tier))


def removed(keys: list[int], tier: int = pb.TIER_GPU) -> pb.BlockEvent:
    return pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=keys, tier=tier))
