"""`kvroute bench kill`: kill -9 at every process kind of one fleet, under steady load.

One control plane, 4 sim engines with their agents and 2 routers; clients send ~`rate` chat
requests per second over both routers and, as a load balancer does, try the other router when a
connection is refused (never after a request was sent: it may have been executed). Every `phase_s`
one process is killed with SIGKILL and started again `down_s` later, in turn: an engine, an agent,
a router, the control plane. For each fault: the requests that failed between it and the next,
and, for the router, how many were in flight on it when it died (those are the only ones that may
fail). The control-plane replicas over Redis are killed the same way by the chaos scenario
(`kvroute bench replicas --chaos-s`, tests/e2e/test_replica_chaos.py).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvroute.tools.local_cluster import LocalCluster, http_ok, long_text, wait_until

FAULTS = ("engine", "agent", "router", "control_plane")


@dataclass
class Sent:
    router: int  # the router the request was (last) sent to
    started: float
    ended: float = 0.0
    status: int = 0  # 0: failed without an HTTP answer
    error: str = ""
    retried: bool = False  # the first router refused the connection


@dataclass
class FaultResult:
    kind: str
    process: str
    killed_at: float
    restarted_at: float
    requests: int = 0
    failed: int = 0
    inflight_on_killed: int = 0  # requests in flight on the killed process's router at the kill (router only)
    retried: int = 0
    errors: list[str] = field(default_factory=list)


class RetryingLoad:
    """Open-loop chat requests at `rate`/s alternating over `router_urls`, in a thread of its own,
    as behind a load balancer: a router whose GET /ready failed 3 times in a row (polled every
    0.1 s) gets no new requests while the other is ready, and a refused connection is retried once on the other
    router; anything else counts as failed."""

    def __init__(self, cluster: LocalCluster, router_urls: list[str], rate: float, groups: int = 8) -> None:
        self.cluster, self.router_urls, self.rate, self.groups = cluster, router_urls, rate, groups
        self.sent: list[Sent] = []
        self.ready = [True] * len(router_urls)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="retrying-load", daemon=True)
        self._probe = threading.Thread(target=self._probe_ready, name="readiness-probe", daemon=True)

    def start(self) -> None:
        self._probe.start()
        self._thread.start()

    def stop(self) -> list[Sent]:
        self._stop.set()
        self._thread.join(60)
        self._probe.join(5)
        return self.sent

    def _probe_ready(self) -> None:
        """As a Kubernetes readiness probe: ready after one success, not ready after 3 failures in a
        row (a slow answer on a busy host is one failure, not a verdict)."""
        failures = [0] * len(self.router_urls)
        while not self._stop.wait(0.1):
            for i, url in enumerate(self.router_urls):
                try:
                    ok = http_ok(url + "/ready")
                except OSError:
                    ok = False
                failures[i] = 0 if ok else failures[i] + 1
                if ok or failures[i] >= 3:
                    self.ready[i] = ok

    def _pick(self, i: int) -> int:
        first = i % len(self.router_urls)
        return first if self.ready[first] or not self.ready[1 - first] else 1 - first

    async def _run(self) -> None:
        import aiohttp

        systems = [long_text(2000 + g, 200) for g in range(self.groups)]
        # A new connection per request: a load balancer's view of a dead router is a refused connect.
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        tasks: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            loop = asyncio.get_running_loop()
            next_at, i = loop.time(), 0
            while not self._stop.is_set():
                body = self.cluster.chat_request(systems[i % self.groups], f"question {i}", max_tokens=4)
                task = asyncio.create_task(self._one(session, self._pick(i), body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                next_at += 1.0 / self.rate
                await asyncio.sleep(max(0.0, next_at - loop.time()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)

    async def _one(self, session, first: int, body: dict) -> None:
        import aiohttp

        record = Sent(first, time.monotonic())
        self.sent.append(record)
        for attempt, router in enumerate((first, 1 - first)):
            record.router = router
            try:
                async with session.post(self.router_urls[router] + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    record.status = response.status
                    if response.status != 200:
                        record.error = f"HTTP {response.status} from router {router}"
                break
            except aiohttp.ClientConnectorError as exc:  # refused: nothing was sent, the other router may take it
                record.error = f"{type(exc).__name__}: {exc}"
                record.retried = attempt == 0
            except Exception as exc:  # noqa: BLE001 - anything after the request left counts as failed
                record.error = f"{type(exc).__name__}: {exc}"
                break
        record.ended = time.monotonic()


def run_kill(rate: float = 100.0, phase_s: float = 6.0, down_s: float = 2.0, workdir: Path | None = None) -> dict:
    from kvroute.tools.tiny_model import build_model_dir

    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvroute-kill-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / "tiny-llama"))
    results: list[FaultResult] = []
    try:
        engines = cluster.start_sim_fleet(4, "--speedup", "20", "--num-blocks", "2048")
        urls = [cluster.start_router(f"r{i}", "kv_aware") for i in range(2)]
        for url in urls:
            wait_until(lambda u=url: http_ok(u + "/ready"), 30, "router ready")
        load = RetryingLoad(cluster, urls, rate)
        load.start()
        time.sleep(phase_s)  # a calm stretch first: the baseline
        victims = {
            "engine": (engines[0].worker_id, engines[0].engine),
            "agent": (f"agent-{engines[1].worker_id}", engines[1].agent),
            "router": ("r1", cluster.routers["r1"]),
            "control_plane": ("control-plane", cluster.control_plane),
        }
        for kind in FAULTS:
            name, process = victims[kind]
            assert process is not None
            killed_at = time.monotonic()
            process.kill()  # SIGKILL, and reaped
            # In flight on it: sent to it before it was gone and not answered (accepted by the kernel counts).
            dead_at = time.monotonic()
            inflight = sum(
                1
                for s in list(load.sent)
                if s.router == 1 and s.started < dead_at and (not s.ended or s.ended >= killed_at) and not s.status
            )
            time.sleep(down_s)
            process.start()
            results.append(
                FaultResult(kind, name, killed_at, time.monotonic(), inflight_on_killed=inflight if kind == "router" else 0)
            )
            time.sleep(max(0.0, phase_s - down_s))
        sent = load.stop()
        baseline_failed = sum(1 for s in sent if s.ended < results[0].killed_at and s.status != 200)
        # A request belongs to the last fault before it ended (a failure shows when the request ends).
        for i, fault in enumerate(results):
            until = results[i + 1].killed_at if i + 1 < len(results) else float("inf")
            window = [s for s in sent if fault.killed_at <= s.ended < until]
            failed = [s for s in window if s.status != 200]
            fault.requests = len(window)
            fault.failed = len(failed)
            fault.retried = sum(1 for s in window if s.retried and s.status == 200)
            fault.errors = sorted({s.error for s in failed})[:5]
        return {
            "rate": rate,
            "phase_s": phase_s,
            "down_s": down_s,
            "requests": len(sent),
            "baseline_failed": baseline_failed,
            "failed_total": sum(1 for s in sent if s.status != 200),
            "faults": [asdict(f) for f in results],
        }
    finally:
        cluster.stop()


def format_table(result: dict) -> str:
    lines = [
        (
            f"kill -9 under {result['rate']:g} req/s over 2 routers ({result['requests']} requests, "
            f"{result['baseline_failed']} failed before the first fault)"
        ),
        "| process killed | requests ended until the next kill | failed | in flight on it at the kill | retried on the other router |",
        "|---|---|---|---|---|",
    ]
    for f in result["faults"]:
        inflight = str(f["inflight_on_killed"]) if f["kind"] == "router" else "-"
        lines.append(f"| {f['kind']} ({f['process']}) | {f['requests']} | {f['failed']} | {inflight} | {f['retried']} |")
    return "\n".join(lines)
