"""A local HA fleet as processes: control-plane replicas over one Redis, sim engines with agents and
routers that know every replica, plus the chaos scenario run by `tests/e2e/test_replica_chaos.py` and
`kvroute bench replicas --chaos-s`.

Each replica reaches Redis through a `TcpProxy` of its own, so one replica can be cut off while the
others keep their connections. Agents and routers get the replicas' addresses in a rotated order
(`--control-plane B,C,A`), so they spread over the replicas as they would behind a headless Service.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

from kvroute.control_plane.audit import FleetAudit, audit_fleet
from kvroute.prom_text import sums_by_label
from kvroute.tools.local_cluster import (
    EngineHandle,
    LocalCluster,
    ManagedProcess,
    engine_prefix_counters,
    free_port,
    http_get,
    http_post_json,
    kvroute_argv,
    long_text,
    wait_until,
)
from kvroute.tools.redis_harness import TcpProxy


@dataclass
class Replica:
    name: str
    address: str
    metrics_port: int
    proxy: TcpProxy | None  # None: the replica talks to Redis directly (a Cluster) and cannot be cut off
    process: ManagedProcess
    down: bool = False  # killed on purpose


@dataclass
class ReplicaCluster(LocalCluster):
    replicas: list[Replica] = field(default_factory=list)
    redis_port: int = 0
    redis_shards: int = 16
    _rotation: int = 0

    # -------------------------------------------------------------- replicas

    def start_replicas(self, redis_port: int, count: int = 3, *extra: str, redis_url: str = "") -> str:
        """`count` replicas, each through a proxy of its own to the Redis on `redis_port`; or, with
        `redis_url` (e.g. a Cluster's), straight to it."""
        self.redis_port = redis_port
        for i in range(count):
            proxy = None if redis_url else TcpProxy(redis_port).start()
            metrics = free_port()  # known before start: a restarted replica keeps its /metrics address
            name = f"r{i}"
            port_file = self.workdir / f"replica-{name}.ports"
            process = ManagedProcess(
                f"replica-{name}",
                kvroute_argv(
                    "control-plane",
                    "--listen",
                    "127.0.0.1:0",
                    "--port-file",
                    str(port_file),
                    "--metrics-port",
                    str(metrics),
                    "--redis",
                    redis_url or proxy.url,
                    "--redis-shards",
                    str(self.redis_shards),
                    "--replica-id",
                    name,
                    "--heartbeat-timeout",
                    str(self.heartbeat_timeout_s),
                    *extra,
                ),
                self.workdir / f"replica-{name}.log",
                port_file=port_file,
            )
            self.replicas.append(Replica(name, "", metrics, proxy, process))
        for replica in self.replicas:
            replica.process.start()
        for replica in self.replicas:  # the gRPC port each bound, kept for its restarts
            replica.address = f"127.0.0.1:{replica.process.wait_ports()['grpc']}"
            replica.process.pin("--listen", replica.address)
        for i in range(count):
            self.wait_replica_ready(i, 30)
        self.control_plane_addr = ",".join(r.address for r in self.replicas)
        return self.control_plane_addr

    def replica_ready(self, i: int) -> bool:
        try:
            return http_get(f"http://127.0.0.1:{self.replicas[i].metrics_port}/ready", timeout=0.5)[0] == 200
        except OSError:
            return False

    def wait_replica_ready(self, i: int, timeout: float = 10.0) -> float:
        started = time.monotonic()
        wait_until(
            lambda: self.replica_ready(i),
            timeout,
            f"replica {self.replicas[i].name} ready",
            [self.replicas[i].process],
            interval=0.01,
        )
        return time.monotonic() - started

    def kill_replica(self, i: int) -> None:
        self.replicas[i].down = True
        self.replicas[i].process.kill()

    def restart_replica(self, i: int) -> None:
        self.replicas[i].down = False
        self.replicas[i].process.start()

    def cut_redis(self, i: int) -> None:
        proxy = self.replicas[i].proxy
        if proxy is None:
            raise RuntimeError(f"replica {self.replicas[i].name} talks to Redis directly: it cannot be cut off")
        proxy.cut()

    def restore_redis(self, i: int) -> None:
        proxy = self.replicas[i].proxy
        if proxy is not None:
            proxy.restore()

    def live_replicas(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if not r.down]

    def rotated_addresses(self) -> str:
        """Every replica's address, starting at the next one in turn."""
        n = len(self.replicas)
        start, self._rotation = self._rotation % n, self._rotation + 1
        return ",".join(self.replicas[(start + k) % n].address for k in range(n))

    # -------------------------------------------------------------- LocalCluster, over replicas

    def all_processes(self) -> list[ManagedProcess]:
        procs = [r.process for r in self.replicas if not r.down]
        for e in self.engines:
            procs.append(e.engine)
            if e.agent:
                procs.append(e.agent)
        return procs + list(self.routers.values())

    def start_agent(self, handle: EngineHandle, *extra: str) -> ManagedProcess:
        every = self.control_plane_addr
        self.control_plane_addr = self.rotated_addresses()
        try:
            return super().start_agent(handle, *extra)
        finally:
            self.control_plane_addr = every

    def start_router(self, name: str, policy: str, *extra: str, env: dict[str, str] | None = None, ready: bool = False) -> str:
        every = self.control_plane_addr
        self.control_plane_addr = self.rotated_addresses()
        try:
            return super().start_router(name, policy, *extra, env=env, ready=ready)
        finally:
            self.control_plane_addr = every

    def list_workers(self) -> list:
        import grpc

        from kvroute.v1 import kvroute_pb2 as pb
        from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

        for i in self.live_replicas():
            try:
                with grpc.insecure_channel(self.replicas[i].address) as channel:
                    return list(pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=1).workers)
            except grpc.RpcError:
                continue
        return []

    def audit_replica(self, i: int, settle_s: float = 0.2) -> FleetAudit:
        return asyncio.run(
            audit_fleet(self.replicas[i].address, [e.worker_id for e in self.engines], settle_s=settle_s, timeout_s=2.0)
        )

    def wait_replicas_audit_clean(self, replicas: list[int], timeout: float = 2.0) -> tuple[float, dict]:
        """Poll until every one of `replicas` audits clean for every engine; (seconds it took, last audits)."""
        started = time.monotonic()
        last: dict[str, dict] = {}

        def clean() -> bool:
            ok = True
            for i in replicas:
                if i in last and last[i].get("clean"):
                    continue
                audit = self.audit_replica(i)
                good = not audit.errors and len(audit.audits) == len(self.engines) and audit.divergence == 0
                last[i] = {"clean": good, "audit": audit.to_json()}
                ok &= good
            return ok

        wait_until(clean, timeout, f"audits of replicas {replicas} clean", self.all_processes(), interval=0.02)
        return time.monotonic() - started, last

    def stop(self) -> None:
        super().stop()
        for replica in self.replicas:
            replica.process.stop()
            if replica.proxy is not None:
                replica.proxy.stop()


# ------------------------------------------------------------------ load and the chaos scenario


@dataclass
class LoadRecord:
    sent_at: float
    status: int
    worker: str
    error: str = ""


class SharedPrefixLoad:
    """Open-loop chat requests at `rate` per second over `routers`, each a shared system prompt (one of
    `groups`) plus a new question, in a thread with its own event loop."""

    def __init__(self, cluster: LocalCluster, router_urls: list[str], rate: float, groups: int = 16, seed: int = 0) -> None:
        self.cluster, self.router_urls, self.rate, self.groups = cluster, router_urls, rate, groups
        self.seed = seed
        self.records: list[LoadRecord] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="shared-prefix-load", daemon=True)
        self._thread.start()

    def stop(self) -> list[LoadRecord]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        return self.records

    async def _run(self) -> None:
        import aiohttp

        rng = random.Random(self.seed)
        systems = [long_text(1000 + g, 300) for g in range(self.groups)]
        tasks: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            loop = asyncio.get_running_loop()
            next_at = loop.time()
            i = 0
            while not self._stop.is_set():
                body = self.cluster.chat_request(rng.choice(systems), f"question {i}: {long_text(i, 12)}")
                url = self.router_urls[i % len(self.router_urls)] + "/v1/chat/completions"
                task = asyncio.create_task(self._one(session, url, body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                next_at += rng.expovariate(self.rate)
                await asyncio.sleep(max(0.0, next_at - loop.time()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)

    async def _one(self, session, url: str, body: dict) -> None:
        sent = time.monotonic()
        try:
            async with session.post(url, json=body) as response:
                await response.read()
                self.records.append(LoadRecord(sent, response.status, response.headers.get("x-kvroute-worker", "")))
        except Exception as exc:  # noqa: BLE001 - a failed request is what we count
            self.records.append(LoadRecord(sent, 0, "", f"{type(exc).__name__}: {exc}"))


class FailOpenWatch:
    """Polls every router's `kvroute_router_fail_open_total` every `interval_s`: (time, totals by
    reason) samples."""

    def __init__(self, router_urls: list[str], interval_s: float = 0.02) -> None:
        self.router_urls, self.interval_s = router_urls, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fail-open-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for url in self.router_urls:
            status, body = http_get(url + "/metrics", timeout=1.0)
            if status == 200:
                for reason, value in sums_by_label(body.decode(), "kvroute_router_fail_open_total", "reason").items():
                    out[reason] = out.get(reason, 0.0) + value
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.totals()))
            except OSError:
                pass
            self._stop.wait(self.interval_s)

    def increments(self) -> list[tuple[float, float, str, float]]:
        """(previous poll, this poll, reason, how many) for every poll that saw a reason's total grow."""
        out = []
        for (t0, a), (t1, b) in zip(self.samples, self.samples[1:]):
            out += [(t0, t1, reason, n - a.get(reason, 0.0)) for reason, n in b.items() if n > a.get(reason, 0.0)]
        return out


def fleet_hit_counters(cluster: LocalCluster) -> tuple[float, float]:
    queries = hits = 0.0
    for engine in cluster.engines:
        q, h = engine_prefix_counters(engine.url)
        queries, hits = queries + q, hits + h
    return queries, hits


def reset_caches(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    for engine in cluster.engines:
        wait_until(
            lambda url=engine.url: http_post_json(url + "/reset_prefix_cache")[0] == 200,
            timeout_s,
            f"{engine.url} reset_prefix_cache",
            interval=0.2,
        )


@dataclass
class ChaosResult:
    faults: bool
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    hit_rate: float = 0.0
    fail_open: dict[str, int] = field(default_factory=dict)  # by reason
    fail_open_outside_deadline: dict[str, int] = field(default_factory=dict)  # by reason: not within a fault's deadline
    fault_times: dict[str, float] = field(default_factory=dict)
    audit_clean_s: dict[str, float] = field(default_factory=dict)
    restart_ready_s: float = 0.0
    wall_s: float = 0.0
    started_unix: float = 0.0
    outside: list[tuple[float, str, int]] = field(default_factory=list)  # (s after start, reason, count)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "errors"} | {"errors": self.errors[:5]}


def run_chaos(
    cluster: ReplicaCluster,
    router_urls: list[str],
    *,
    faults: bool,
    cut: bool = True,
    rate: float = 100.0,
    warm_s: float = 4.0,
    cut_s: float = 5.0,
    gap_s: float = 4.0,
    tail_s: float = 3.0,
    query_deadline_s: float = 0.005,
    poll_s: float = 0.02,
    seed: int = 0,
    audit_within_s: float = 2.0,
) -> ChaosResult:
    """One run of the shared-prefix load; with `faults`: kill -9 replica 0, later cut replica 1 from
    Redis for `cut_s`, then restart replica 0. After each fault's effect (the kill; the end of the cut;
    the restarted replica ready) every live replica must audit clean within `audit_within_s`. Fail-open decisions are
    counted by reason from the routers' counters, polled every `poll_s`; one is "outside" when no fault
    happened between one query deadline before the poll that preceded it and the poll that saw it."""
    result = ChaosResult(faults)
    reset_caches(cluster)
    q0, h0 = fleet_hit_counters(cluster)
    watch = FailOpenWatch(router_urls, poll_s)
    watch.start()
    load = SharedPrefixLoad(cluster, router_urls, rate, seed=seed)
    started = time.monotonic()
    result.started_unix = time.time()
    load.start()
    try:
        time.sleep(warm_s)
        if faults:
            result.fault_times["kill"] = time.monotonic() - started
            cluster.kill_replica(0)
            result.audit_clean_s["kill"] = cluster.wait_replicas_audit_clean(cluster.live_replicas(), audit_within_s)[0]
            time.sleep(max(0.0, gap_s - result.audit_clean_s["kill"]))
            if cut:
                result.fault_times["cut"] = time.monotonic() - started
                cluster.cut_redis(1)
                time.sleep(cut_s)
                cluster.restore_redis(1)
                result.fault_times["cut_end"] = time.monotonic() - started
                result.audit_clean_s["cut_end"] = cluster.wait_replicas_audit_clean(cluster.live_replicas(), audit_within_s)[0]
                time.sleep(max(0.0, gap_s - result.audit_clean_s["cut_end"]))
            result.fault_times["restart"] = time.monotonic() - started
            cluster.restart_replica(0)
            result.restart_ready_s = cluster.wait_replica_ready(0, 30)
            result.audit_clean_s["restart"] = cluster.wait_replicas_audit_clean(cluster.live_replicas(), audit_within_s)[0]
        else:
            time.sleep(2 * gap_s + (cut_s if cut else 0.0))
        time.sleep(tail_s)
    finally:
        records = load.stop()
        watch.stop()
    result.wall_s = time.monotonic() - started
    result.requests = len(records)
    bad = [r for r in records if r.status != 200]
    result.failed = len(bad)
    result.errors = [r.error or f"HTTP {r.status}" for r in bad]
    q1, h1 = fleet_hit_counters(cluster)
    result.hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    fault_at = [started + t for t in result.fault_times.values()]
    for before, after, reason, n in watch.increments():  # the decisions happened in (before, after]
        result.fail_open[reason] = result.fail_open.get(reason, 0) + int(n)
        if not any(before <= at + query_deadline_s and after >= at for at in fault_at):
            result.fail_open_outside_deadline[reason] = result.fail_open_outside_deadline.get(reason, 0) + int(n)
            result.outside.append((round(after - started, 3), reason, int(n)))
    return result
