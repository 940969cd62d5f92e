"""Starts a local kvroute fleet as separate OS processes on loopback ports.

Used by `kvroute demo`, the end-to-end tests and the live benchmarks, so all three exercise
exactly what a user deploys: one control plane, N engines (sim or real vLLM) each with its
own agent, and routers, talking over real gRPC/ZMQ/HTTP sockets.

Ports: the control plane, sim engines (HTTP and ZMQ) and routers listen on port 0 and write the
ports they bound to their `--port-file`, which `ManagedProcess.wait_ports` reads: no port is picked
before its process binds it, so two fleets (or two test runs) cannot race for one. Once known, a
process's ports are written into its argv, so a restart (kill -9 benches, the soak) comes back on
the same address its peers were given (`replica_cluster.py` does the same for control-plane
replicas, as `bench/replicas.py` does). The agents' and replicas' /metrics ports are still picked by `free_port` before they start
(their addresses are in the tests' expectations from the first start on).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.control_plane.audit import FleetAudit, audit_fleet
from kvroute.prom_text import sample_sums, samples
from kvroute.tools.sim_engine.dialects import DEFAULT_DIALECT, get_dialect

_WORDS = (
    "cache",
    "token",
    "prefix",
    "router",
    "worker",
    "model",
    "request",
    "latency",
    "block",
    "memory",
    "engine",
    "query",
    "index",
)


def long_text(seed: int, n_words: int = 400) -> str:
    """A deterministic document of about `n_words` tokens (tiny model) whose first word already differs
    between nearby seeds, so each seed is its own prefix from the first block on."""
    return " ".join(_WORDS[(seed * 7 + i * 3 + i // 5) % len(_WORDS)] for i in range(n_words)) + f" seed {seed}."


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


class PortAllocator:
    """Ports for processes that bind them later. A port the kernel picked with bind(0) sits in the
    ephemeral range, where any outgoing connection may take it before our engine binds it (seen in
    CI: ZMQ "Address already in use"). These come from below that range, each handed out once per
    allocator, from a random start so that two test processes rarely walk the same ports, and only
    after a bind on every interface succeeded just now."""

    def __init__(self, low: int = 20000, high: int | None = None, seed: int | None = None) -> None:
        self.low, self.high = low, min(high or 65536, _ephemeral_low())
        if self.high - self.low < 100:
            raise ValueError(f"no room for ports between {self.low} and {self.high}")
        self._next = random.Random(seed).randrange(self.low, self.high)
        self._handed_out: set[int] = set()

    def take(self) -> int:
        for _ in range(self.high - self.low):
            port, self._next = self._next, self._next + 1 if self._next + 1 < self.high else self.low
            if port not in self._handed_out and _bindable(port):
                self._handed_out.add(port)
                return port
        raise RuntimeError(f"no free port between {self.low} and {self.high}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # engines bind "*" (every interface), not only loopback
        except OSError:
            return False
    return True


# One per process: ports are a process-wide resource, and two clusters in one test run must not
# be handed the same one.
_PORTS = PortAllocator()


def free_port() -> int:
    return _PORTS.take()


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"


def engine_prefix_counters(url: str) -> tuple[float, float]:
    """An engine's vLLM prefix-cache counters (queries, hits), summed over label sets."""
    status, body = http_get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    sums = sample_sums(body.decode(), {PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS})
    return sums.get(PREFIX_CACHE_QUERIES, 0.0), sums.get(PREFIX_CACHE_HITS, 0.0)


def http_post_json(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    status, _, raw = http_post_json_headers(url, body, timeout)
    return status, raw


def http_post_json_headers(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """POST a JSON body: (status, response headers with lower-case names, body)."""
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    port_file: Path | None = None  # the child's --port-file: the ports it bound, written once it listens

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)  # what the last run bound says nothing of this one
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 5.0, sig: int = signal.SIGTERM) -> None:
        if not self.popen or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def kill(self) -> None:
        self.stop(sig=signal.SIGKILL)

    def wait_ports(self, timeout: float = 30.0) -> dict[str, int]:
        """The ports the child reported (listener name -> port), once it has; fails if it exits first."""
        assert self.port_file is not None, f"{self.name} has no port file"
        return wait_until(lambda: _read_ports(self.port_file), timeout, f"{self.name}'s ports", [self], interval=0.02)

    def pin(self, flag: str, value: str) -> None:
        """Give `flag` the value `value` in the argv of the next start (the ports this run bound)."""
        self.argv[self.argv.index(flag) + 1] = value

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def _read_ports(path: Path) -> dict[str, int] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def kvroute_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroute.cli", *args]


def wait_until(predicate, timeout: float, what: str, procs: list[ManagedProcess] = (), interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}")
        time.sleep(interval)
    tails = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in procs)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


def http_ok(url: str) -> bool:
    try:
        return http_get(url, timeout=1.0)[0] == 200
    except OSError:
        return False


@dataclass
class EngineHandle:
    worker_id: str
    url: str
    kv_events_port: int
    replay_port: int
    engine: ManagedProcess
    agent: ManagedProcess | None = None
    dialect: str = DEFAULT_DIALECT
    block_size: int = 16
    agent_metrics_url: str = ""  # the agent's own /metrics and /health (set by start_agent)

    @property
    def engine_family(self) -> str:
        """vllm, sglang or trtllm: the dialect's engine."""
        return get_dialect(self.dialect).engine


@dataclass
class LocalCluster:
    """A control plane, sim engines with agents, and routers, each its own process."""

    workdir: Path
    tokenizer_dir: Path
    model: str = "tiny-llama"
    block_size: int = 16
    heartbeat_timeout_s: float = 3.0
    control_plane: ManagedProcess | None = None
    control_plane_addr: str = ""
    engines: list[EngineHandle] = field(default_factory=list)
    routers: dict[str, ManagedProcess] = field(default_factory=dict)
    router_urls: dict[str, str] = field(default_factory=dict)

    def all_processes(self) -> list[ManagedProcess]:
        procs = [self.control_plane] if self.control_plane else []
        for e in self.engines:
            procs.append(e.engine)
            if e.agent:
                procs.append(e.agent)
        return procs + list(self.routers.values())

    # -------------------------------------------------------------- control plane

    def start_control_plane(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> str:
        """`extra_args` go to `kvroute control-plane` as they are (e.g. --audit-interval-s 1). Without
        `port` it listens on one the kernel picks."""
        self.control_plane = ManagedProcess(
            "control-plane",
            kvroute_argv(
                "control-plane",
                "--listen",
                f"127.0.0.1:{port or 0}",
                "--port-file",
                str(self.workdir / "control-plane.ports"),
                "--heartbeat-timeout",
                str(self.heartbeat_timeout_s),
                *extra_args,
            ),
            self.workdir / "control-plane.log",
            port_file=self.workdir / "control-plane.ports",
        )
        self.control_plane.start()
        self.control_plane_addr = f"127.0.0.1:{self.control_plane.wait_ports()['grpc']}"
        self.control_plane.pin("--listen", self.control_plane_addr)  # a restart comes back where agents look
        return self.control_plane_addr

    def restart_control_plane(self, while_down: Callable[[], object] | None = None, kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with `kill`) and start the control plane on the same port,
        calling `while_down()` in between."""
        assert self.control_plane is not None
        if kill:
            self.control_plane.kill()
        else:
            self.control_plane.stop()
        if while_down is not None:
            while_down()
        self.control_plane.start()
        self.control_plane.wait_ports()

    # -------------------------------------------------------------- engines + agents

    def add_sim_engine(
        self,
        worker_id: str,
        *extra_engine_args: str,
        start_agent: bool = True,
        agent_args: tuple[str, ...] = (),
        dialect: str | None = None,
        block_size: int | None = None,
        lora_adapters: tuple[str, ...] = (),
        cpu_offload_blocks: int = 0,
    ) -> EngineHandle:
        """A sim engine process (and its agent). `dialect` picks the engine/version it imitates
        (kvroute.tools.sim_engine.dialects; None = its default); `block_size` overrides the cluster's."""
        handle = self._launch_sim_engine(
            worker_id,
            *extra_engine_args,
            dialect=dialect,
            block_size=block_size,
            lora_adapters=lora_adapters,
            cpu_offload_blocks=cpu_offload_blocks,
        )()
        if start_agent:
            self.start_agent(handle, *agent_args)
        return handle

    def _launch_sim_engine(
        self,
        worker_id: str,
        *extra_engine_args: str,
        dialect: str | None = None,
        block_size: int | None = None,
        lora_adapters: tuple[str, ...] = (),
        cpu_offload_blocks: int = 0,
    ) -> Callable[[], EngineHandle]:
        """Start a sim engine on ports of its choosing; the function returned waits for them and
        gives its handle (so a fleet's engines start side by side)."""
        block_size = block_size or self.block_size
        args = ["--block-size", str(block_size)]
        if dialect is not None:
            args += ["--dialect", dialect]
        zmq_events = get_dialect(dialect or DEFAULT_DIALECT).transport == "zmq"  # TRT-LLM's pull path has none

        def events_config(ev_port: int, replay_port: int) -> str:
            return json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{ev_port}",
                    "replay_endpoint": f"tcp://*:{replay_port}",
                    "topic": "",
                }
            )

        if zmq_events:
            args += ["--kv-events-config", events_config(0, 0)]
        if lora_adapters:
            args += ["--lora-adapters", ",".join(lora_adapters)]
        if cpu_offload_blocks:
            args += ["--cpu-offload-blocks", str(cpu_offload_blocks)]
        port_file = self.workdir / f"{worker_id}.ports"
        engine = ManagedProcess(
            worker_id,
            kvroute_argv(
                "sim-engine",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--model",
                self.model,
                "--tokenizer",
                str(self.tokenizer_dir),
                *args,
                *extra_engine_args,
            ),
            self.workdir / f"{worker_id}.log",
            port_file=port_file,
        )
        engine.start()

        def bound() -> EngineHandle:
            ports = engine.wait_ports(60)
            port, ev_port, replay_port = ports["http"], ports.get("kv_events", 0), ports.get("replay", 0)
            engine.pin("--port", str(port))  # a restarted engine comes back where its agent and the routers look
            if zmq_events:
                engine.pin("--kv-events-config", events_config(ev_port, replay_port))
            handle = EngineHandle(
                worker_id,
                f"http://127.0.0.1:{port}",
                ev_port,
                replay_port,
                engine,
                dialect=dialect or DEFAULT_DIALECT,
                block_size=block_size,
            )
            self.engines.append(handle)
            return handle

        return bound

    def start_sim_fleet(self, engines: int, *engine_args: str, **engine_options) -> list[EngineHandle]:
        """The usual local fleet: the control plane (unless started), then sim engines engine-0,
        engine-1, ... each with its agent, returning once all are healthy and registered.
        `engine_options` go to every engine (dialect, block_size, lora_adapters, ...)."""
        if self.control_plane is None:
            self.start_control_plane()
        launched = [self._launch_sim_engine(f"engine-{i}", *engine_args, **engine_options) for i in range(engines)]
        handles = [bound() for bound in launched]
        for handle in handles:
            self.start_agent(handle)
        self.wait_engines_healthy()
        self.wait_workers_registered()
        return handles

    def start_agent(self, handle: EngineHandle, *extra: str) -> ManagedProcess:
        metrics_port = free_port()
        if get_dialect(handle.dialect).transport == "zmq":
            # Named explicitly: TensorRT-LLM's default transport is its pull path even for trtllm-zmq.
            events = (
                "--kv-events-transport",
                "zmq",
                "--kv-events",
                f"tcp://127.0.0.1:{handle.kv_events_port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{handle.replay_port}",
            )
        else:  # trtllm-pull: POST /kv_cache_events, no sockets and no replay
            events = ("--kv-events-transport", "http")
        agent = ManagedProcess(
            f"agent-{handle.worker_id}",
            kvroute_argv(
                "agent",
                "--control-plane",
                self.control_plane_addr,
                "--engine",
                handle.engine_family,
                *events,
                "--engine-url",
                handle.url,
                "--worker-id",
                handle.worker_id,
                "--model",
                self.model,
                "--block-size",
                str(handle.block_size),
                "--metrics-port",
                str(metrics_port),
                *extra,
            ),
            self.workdir / f"agent-{handle.worker_id}.log",
        )
        agent.start()
        handle.agent = agent
        handle.agent_metrics_url = f"http://127.0.0.1:{metrics_port}"
        return agent

    def agent_counters(self, handle: EngineHandle) -> dict[str, float]:
        """The agent's counters (`kvroute_agent_<name>_total` on its /metrics) by name; {} while it is down."""
        try:
            status, body = http_get(handle.agent_metrics_url + "/metrics")
        except OSError:
            return {}
        if status != 200:
            return {}
        return {
            s.name[len("kvroute_agent_") : -len("_total")]: s.value
            for s in samples(body.decode())
            if s.name.startswith("kvroute_agent_") and s.name.endswith("_total")
        }

    def wait_engines_healthy(self, timeout: float = 60.0) -> None:
        for e in self.engines:
            wait_until(lambda e=e: http_ok(e.url + "/health"), timeout, f"{e.worker_id} /health", [e.engine])

    def wait_workers_registered(self, count: int | None = None, timeout: float = 30.0) -> None:
        want = len(self.engines) if count is None else count
        wait_until(lambda: len(self.list_workers()) >= want, timeout, f"{want} workers registered", self.all_processes())

    def list_workers(self) -> list:
        import grpc

        from kvroute.v1 import kvroute_pb2 as pb
        from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

        try:
            with grpc.insecure_channel(self.control_plane_addr) as channel:
                return list(pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=1).workers)
        except grpc.RpcError:
            return []

    # -------------------------------------------------------------- audit

    def audit(self, workers: Sequence[str] = (), settle_s: float = 0.0, timeout_s: float = 2.0) -> FleetAudit:
        """`kvroute audit` in this process (kvroute.control_plane.audit.audit_fleet): the control plane's keys per
        worker against each engine's `GET /kvroute/blocks`. One comparison unless `settle_s` > 0."""
        return asyncio.run(audit_fleet(self.control_plane_addr, workers, settle_s=settle_s, timeout_s=timeout_s))

    def wait_audit_clean(self, timeout: float = 2.0, workers: Sequence[str] = ()) -> FleetAudit:
        """Poll the audit until every one of `workers` (default: every engine) is registered, compared
        and without divergence; on timeout the error carries the last audit."""
        wanted = list(workers) or [e.worker_id for e in self.engines]
        last: FleetAudit | None = None

        def clean() -> FleetAudit | None:
            nonlocal last
            last = self.audit(wanted)
            ok = (
                not last.errors
                and len(last.audits) == len(wanted)
                and all(a.status == "ok" and a.divergence == 0 for a in last.audits)
            )
            return last if ok else None

        try:
            return wait_until(
                clean, timeout, f"zero audit divergence for {', '.join(wanted)}", self.all_processes(), interval=0.05
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\nlast audit: {json.dumps(last.to_json() if last else None)}") from None

    # -------------------------------------------------------------- routers

    def start_router(self, name: str, policy: str, *extra: str, env: dict[str, str] | None = None, ready: bool = False) -> str:
        """`kvroute router` on this fleet's control plane: its URL, once /health answers. `ready`: also
        wait for /ready, i.e. its first view of the fleet; a request before that is a 503 no_workers
        (routers meant never to be ready, with no control plane or static workers, leave it off)."""
        port_file = self.workdir / f"router-{name}.ports"
        router = ManagedProcess(
            f"router-{name}",
            kvroute_argv(
                "router",
                "--control-plane",
                self.control_plane_addr,
                "--policy",
                policy,
                "--tokenizer",
                str(self.tokenizer_dir),
                "--model",
                self.model,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--grpc-port",
                "off",
                *extra,
            ),
            self.workdir / f"router-{name}.log",
            port_file=port_file,
        )
        router.start(env=env)
        port = router.wait_ports()["http"]
        router.pin("--port", str(port))  # a restarted router comes back at the URL its clients were given
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(url + "/health"), 30, f"router {name}", [router])
        self.routers[name] = router
        self.router_urls[name] = url
        if ready:
            wait_until(lambda: http_ok(url + "/ready"), 30, f"router {name} ready", self.all_processes())
        return url

    def start_epp(self, name: str, policy: str, *extra: str) -> str:
        """`kvroute epp` (the endpoint picker) on this fleet's control plane: its gRPC HOST:PORT. It
        is kept with the routers (as `epp-NAME`), so `stop()` ends it too."""
        port = free_port()
        epp = ManagedProcess(
            f"epp-{name}",
            kvroute_argv(
                "epp",
                "--control-plane",
                self.control_plane_addr,
                "--policy",
                policy,
                "--tokenizer",
                str(self.tokenizer_dir),
                "--model",
                self.model,
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(port),
                *extra,
            ),
            self.workdir / f"epp-{name}.log",
        )
        epp.start()
        address = f"127.0.0.1:{port}"
        wait_until(lambda: _tcp_open(address), 30, f"epp {name}", [epp])
        self.routers[f"epp-{name}"] = epp
        return address

    def chat_request(self, system: str, user: str, max_tokens: int = 4) -> dict:
        """An OpenAI chat body for the cluster's model: one system and one user message."""
        return {
            "model": self.model,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }

    def stop_router(self, name: str) -> None:
        self.routers.pop(name).stop()
        self.router_urls.pop(name, None)

    def stop(self) -> None:
        for proc in reversed(self.all_processes()):
            proc.stop()


def grpc_health_serving(address: str, service: str) -> bool:
    """Whether the gRPC health service at HOST:PORT answers SERVING for `service` (e.g. "readiness");
    False while nothing answers there (as `http_ok`), any other error raised (e.g. an unknown service)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return False
        raise
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def _tcp_open(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
