"""`kvroute bench replicas`: control-plane replicas over Redis, measured with real processes and a real Redis.

Everything runs on this machine: a `redis-server` of the bench's own, replicas as `kvroute
control-plane --redis` processes, and this process as the agent (the real `ControlPlaneLink`, fed
vLLM payloads through the real decoder and resolver) and as the router (gRPC queries).

- ingest: block events per second from the agent, through replica A and Redis, into replica B's
  index (until B's `kvroute_cp_block_events_total` counted them all), next to `bench ingest`'s
  in-process figure (decode -> resolve -> index) measured in the same run on the same payloads.
- freshness: a new block handed to the agent's link -> present in replica B's answer (B is queried
  back to back meanwhile), p50 / p99.
- catch-up: a replica process started over a log of 100k and 1M blocks (8 workers), until /ready,
  reading the whole log, and reading a snapshot plus the log after it.
- answers: queries per second one replica answers with p99 <= 5 ms (64 workers, a 256-key chain,
  columnar, open loop at rising rates), with 1 replica and spread over 2 (per replica).
- bytes per entry: the replica's RSS growth per index entry over the 1M-block catch-up.
- router sessions: a router on replica A holds 1000 live reservations, 200 of them with 256 claimed
  keys; B is killed -9 and restarted: seconds until its /ready and until its answers count all of
  them, and the bytes of A's state entry in the in-flight stream (control_plane.replication.inflight_sync).
- chaos (`--chaos-s`, 0 = skip): the chaos scenario of tests/e2e/test_replica_chaos.py with longer phases.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from kvroute.fleet.entries import BlockOp, Op
from kvroute.prom_text import sample_sums
from kvroute.tools.bench.ingest import make_payloads, run_ingest
from kvroute.tools.local_cluster import ManagedProcess, free_port, http_get, kvroute_argv, wait_until
from kvroute.tools.procfs import rss_bytes
from kvroute.tools.redis_harness import RedisServer, temp_workdir
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ReplicaProcess:
    """A `kvroute control-plane` process: a replica over Redis at `redis_url`, or ("") an embedded one."""

    def __init__(
        self, workdir: Path, redis_url: str, name: str, shards: int = 16, heartbeat_s: float = 600.0, extra: tuple[str, ...] = ()
    ) -> None:
        self.metrics_port = free_port()  # known before start: a restarted replica keeps its /metrics address
        self.address = ""  # its gRPC address once started (it listens on port 0)
        redis = ("--redis", redis_url, "--redis-shards", str(shards), "--snapshot-interval-s", "3600") if redis_url else ()
        self.process = ManagedProcess(
            name,
            kvroute_argv(
                "control-plane",
                "--listen",
                "127.0.0.1:0",
                "--port-file",
                str(workdir / f"{name}.ports"),
                "--metrics-port",
                str(self.metrics_port),
                *redis,
                "--replica-id",
                name,
                "--heartbeat-timeout",
                str(heartbeat_s),
                "--log-level",
                "WARNING",
                *extra,
            ),
            workdir / f"{name}.log",
            port_file=workdir / f"{name}.ports",
        )

    def start(self) -> float:
        """Start; seconds until /ready answered 200."""
        started = time.monotonic()
        self.process.start()
        self.address = f"127.0.0.1:{self.process.wait_ports(120)['grpc']}"
        self.process.pin("--listen", self.address)  # a restart comes back where its clients look
        wait_until(self.ready, 120, f"{self.process.name} ready", [self.process], interval=0.01)
        return time.monotonic() - started

    def ready(self) -> bool:
        try:
            return http_get(f"http://127.0.0.1:{self.metrics_port}/ready", timeout=0.5)[0] == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        status, body = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2.0)
        return sample_sums(body.decode(), {name}).get(name, 0.0) if status == 200 else 0.0

    def rss_bytes(self) -> int:
        assert self.process.popen is not None
        return rss_bytes(self.process.popen.pid)

    def stop(self) -> None:
        self.process.stop()


# ------------------------------------------------------------------ ingest and freshness


async def ingest_through_redis(a: ReplicaProcess, b: ReplicaProcess, payloads: list[bytes], workers: int) -> dict:
    from kvroute.worker_agent.block_resolver import BlockResolver
    from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
    from kvroute.worker_agent.vllm_wire import decode_payload

    resolvers = [BlockResolver("bench-model") for _ in range(workers)]
    links = [
        ControlPlaneLink(
            a.address,
            WorkerIdentity(f"ingest-{w}", "bench-model", "vllm", 16, f"http://w{w}"),
            resolvers[w].snapshot_events,
            pb.WorkerLoad,
            max_pending_events=10_000_000,
        )
        for w in range(workers)
    ]
    tasks = [asyncio.create_task(link.run()) for link in links]
    try:
        await _until(lambda: all(link.connected and link.acked_seq >= 1 for link in links), 30)
        before = b.metric("kvroute_cp_block_events_total")
        sent = 0
        started = time.perf_counter()
        for i, payload in enumerate(payloads):
            w = i % workers
            events = resolvers[w].apply(decode_payload(i, payload).events)
            sent += sum(len(d.keys) for d in events if d.kind != "cleared")
            links[w].send(events)
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the links write, as the agent's event loop does between batches
        while b.metric("kvroute_cp_block_events_total") - before < sent:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
        return {
            "ingest_events_per_s": round(sent / elapsed),
            "ingest_block_events": sent,
            "ingest_seconds": round(elapsed, 3),
            "ingest_batches_per_s": round(sum(link.counters.batches_sent for link in links) / elapsed),
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def freshness(a: ReplicaProcess, b: ReplicaProcess, trials: int) -> dict:
    import grpc

    from kvroute.worker_agent.block_resolver import BlockResolver
    from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
    from kvroute.worker_agent.vllm_wire import BlockStored

    resolver = BlockResolver("fresh-model")
    link = ControlPlaneLink(
        a.address, WorkerIdentity("fresh-0", "fresh-model", "vllm", 4, "http://fresh"), resolver.snapshot_events, pb.WorkerLoad
    )
    task = asyncio.create_task(link.run())
    rng = random.Random(7)
    samples = []
    try:
        await _until(lambda: link.connected and link.acked_seq >= 1, 30)
        async with grpc.aio.insecure_channel(b.address) as channel:
            stub = pb_grpc.ControlPlaneStub(channel)
            for i in range(trials):
                tokens = [rng.randrange(1, 50_000) for _ in range(4)]
                events = resolver.apply([BlockStored([10_000 + i], None, tokens, 4)])
                query = pb.QueryRequest(
                    model="fresh-model", chains=[pb.KeyChain(block_size=4, block_keys=[events[0].keys[0]])], columnar=True
                )
                started = time.perf_counter()
                link.send(events)
                while True:
                    reply = await stub.Query(query, timeout=5)
                    if reply.columns.matched_blocks and reply.columns.matched_blocks[0]:
                        break
                samples.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {
        "freshness_p50_ms": round(statistics.median(samples), 3),
        "freshness_p99_ms": round(percentile(samples, 0.99), 3),
        "freshness_trials": len(samples),
    }


async def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("bench: condition not reached")
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ catch-up


async def _fill(writer, blocks: int, workers: int, per_batch: int) -> int:
    rng = random.Random(blocks)

    async def one(w: int) -> int:
        session = await writer.register(
            pb.RegisterWorker(
                worker_id=f"catchup-{w}",
                model="m",
                engine="sim",
                block_size=16,
                endpoint=f"http://c{w}",
                agent_instance=f"bench-{w}",
            ),
            "bench",
        )
        written, seq = 0, 0
        while written < blocks // workers:
            seq += 1
            keys = [rng.getrandbits(63) for _ in range(per_batch)]
            await writer.append_batch(session, seq, seq == 1, [BlockOp(Op.STORED, 0, keys)])
            written += per_batch
        return written

    return sum(await asyncio.gather(*(one(w) for w in range(workers))))


async def catch_up(redis: RedisServer, workdir: Path, sizes: tuple[int, ...]) -> dict:
    """Per size: fill a flushed Redis through an in-process writer replica, start a replica process and
    time it to /ready (whole log); write a snapshot and time another (snapshot + log after it)."""
    from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer

    out: dict = {}
    for blocks in sizes:
        redis.cli("flushall")
        writer = ControlPlaneServer(
            ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis.url, replica_id="writer", heartbeat_timeout_s=600.0)
        )
        await writer.start()
        assert writer.redis_log is not None
        await writer.redis_log.wait_ready(30)
        try:
            written = await _fill(writer.redis_log, blocks, 8, 64)
            await _until(lambda w=writer, n=written: w.registry.index.entry_count() >= n, 300)
            label = f"{blocks // 1000}k" if blocks < 1_000_000 else f"{blocks // 1_000_000}m"
            fresh = ReplicaProcess(workdir, redis.url, f"catchup-log-{label}")
            baseline_rss = 0
            try:
                out[f"catchup_s_{label}"] = round(await asyncio.to_thread(fresh.start), 3)
                out[f"catchup_entries_{label}"] = int(fresh.metric("kvroute_cp_index_entries"))
                if blocks == max(sizes):  # memory per entry: against an empty replica, at the largest log
                    empty = ReplicaProcess(workdir, f"{redis.url}/1", "empty")  # same code, an empty db
                    await asyncio.to_thread(empty.start)
                    baseline_rss = empty.rss_bytes()
                    empty.stop()
                    out["bytes_per_entry"] = round((fresh.rss_bytes() - baseline_rss) / max(1, written), 1)
            finally:
                fresh.stop()
            await writer.redis_log.write_snapshots(token=1)
            snap = ReplicaProcess(workdir, redis.url, f"catchup-snap-{label}")
            try:
                out[f"catchup_s_{label}_from_snapshot"] = round(await asyncio.to_thread(snap.start), 3)
            finally:
                snap.stop()
        finally:
            await writer.stop(0)
    return out


# ------------------------------------------------------------------ answers per second


async def answers(
    replicas: list[ReplicaProcess],
    redis: RedisServer,
    workers: int = 64,
    chain: int = 256,
    rates: tuple[int, ...] = (250, 500, 1000, 1500, 2000, 3000),
    step_s: float = 3.0,
) -> dict:
    """Highest offered rate per replica whose p99 stays <= 5 ms (and all answered), open loop."""
    import grpc

    rng = random.Random(3)
    keys = [rng.getrandbits(63) for _ in range(chain)]
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    stubs = [pb_grpc.ControlPlaneStub(c) for c in channels]
    query = pb.QueryRequest(model="answer-model", chains=[pb.KeyChain(block_size=16, block_keys=keys)], columnar=True)
    best, table = 0, []
    try:
        for rate in rates:
            latencies: list[float] = []
            failures = 0

            async def one(stub, latencies: list[float] = latencies) -> None:
                nonlocal failures
                started = time.perf_counter()
                try:
                    await stub.Query(query, timeout=1.0)
                    latencies.append((time.perf_counter() - started) * 1000)
                except grpc.aio.AioRpcError:
                    failures += 1

            tasks = []
            total = rate * len(replicas)
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i in range(int(total * step_s)):
                at = start + i / total
                await asyncio.sleep(max(0.0, at - loop.time()))
                tasks.append(asyncio.create_task(one(stubs[i % len(stubs)])))
            await asyncio.gather(*tasks)
            achieved = len(latencies) / (loop.time() - start) / len(replicas)
            p99 = percentile(latencies, 0.99)
            table.append(
                {
                    "offered_per_replica": rate,
                    "answered_per_s_per_replica": round(achieved),
                    "p50_ms": round(statistics.median(latencies), 3) if latencies else None,
                    "p99_ms": round(p99, 3),
                    "failed": failures,
                }
            )
            if p99 <= 5.0 and not failures and achieved >= 0.95 * rate:
                best = rate
            else:
                break
    finally:
        for channel in channels:
            await channel.close()
    return {"answers_per_s": best, "steps": table}


async def router_sessions(
    a: ReplicaProcess, b: ReplicaProcess, redis_url: str, reservations: int = 1000, claiming: int = 200, keys: int = 256
) -> dict:
    """A router on A reserves `reservations` on the answer fleet's workers, the first `claiming` with
    `keys` claimed keys each (TTL 60 s); then B is killed -9 and restarted."""
    import grpc
    from redis.asyncio import Redis

    from kvroute.control_plane.replication.inflight_sync import STREAM
    from kvroute.tools.bench.inflight import open_router

    rng = random.Random(11)
    claims = claiming * keys
    redis = Redis.from_url(redis_url)
    try:
        async with grpc.aio.insecure_channel(a.address) as channel:
            router = await open_router(pb_grpc.ControlPlaneStub(channel), "bench-sessions")
            for i in range(reservations):
                chain = [rng.getrandbits(63) for _ in range(keys)] if i < claiming else []
                await router.write(
                    pb.RouterMessage(
                        reserve=pb.Reservation(
                            reservation_id=i + 1,
                            worker_id=f"answer-{i % 16}",
                            block_size=16,
                            block_keys=chain,
                            prefill_tokens=1000,
                            ttl_ms=60_000,
                        )
                    )
                )

            def counts_all() -> bool:
                return b.metric("kvroute_cp_reservations") >= reservations and b.metric("kvroute_cp_speculative_claims") >= claims

            await _until(counts_all, 60)

            async def state_bytes() -> int:
                for _, fields in await redis.xrevrange(STREAM, count=100):
                    if fields.get(b"r") == a.process.name.encode() and b"s" in fields:
                        return len(fields[b"s"])
                return 0

            size = 0
            deadline = time.monotonic() + 30
            while size < claims * 8:  # A's next state holds them all
                if time.monotonic() > deadline:
                    raise TimeoutError("bench: no state entry of A's holds the reservations")
                size = await state_bytes()
                await asyncio.sleep(0.1)
            b.process.kill()
            started = time.monotonic()
            ready_s = await asyncio.to_thread(b.start)
            await _until(counts_all, 60)
            visible_s = time.monotonic() - started
            router.cancel()
    finally:
        await redis.aclose()
    return {
        "sessions_state_bytes": size,
        "sessions_restart_ready_s": round(ready_s, 3),
        "sessions_restart_visible_s": round(visible_s, 3),
    }


async def prepare_answer_fleet(a: ReplicaProcess, workers: int, chain: int = 256) -> None:
    """`workers` workers of "answer-model", each holding a different prefix of the query's chain."""
    from kvroute.worker_agent.block_deltas import KeysStored
    from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
    from kvroute.worker_agent.tiers import Tier

    rng = random.Random(3)
    keys = [rng.getrandbits(63) for _ in range(chain)]
    links = []
    for w in range(workers):
        held = keys[: rng.randrange(1, chain)]
        events = [KeysStored(Tier.GPU, held)]
        links.append(
            ControlPlaneLink(
                a.address,
                WorkerIdentity(f"answer-{w}", "answer-model", "vllm", 16, f"http://a{w}"),
                lambda e=events: e,
                pb.WorkerLoad,
            )
        )
    tasks = [asyncio.create_task(link.run()) for link in links]
    await _until(lambda: all(link.acked_seq >= 1 for link in links), 60)
    for task in tasks:  # the workers stay registered (heartbeat timeout 600 s); their streams may go
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------ the whole bench


async def run_async(batches: int, trials: int, sizes: tuple[int, ...], workdir: Path, step_s: float = 3.0) -> dict:
    redis = RedisServer(workdir).start()
    result: dict = {}
    try:
        payloads = make_payloads(batches, 16, 16, seed=0)
        in_process = run_ingest(batches, 16, workers=8)
        result["ingest_in_process_events_per_s"] = in_process["block_events_per_s"]
        a, b = ReplicaProcess(workdir, redis.url, "replica-a"), ReplicaProcess(workdir, redis.url, "replica-b")
        a.start()
        b.start()
        try:
            result.update(await ingest_through_redis(a, b, payloads, 8))
            result["ingest_ratio"] = round(result["ingest_events_per_s"] / result["ingest_in_process_events_per_s"], 3)
            result.update(await freshness(a, b, trials))
            await prepare_answer_fleet(a, 64)
            await _until(lambda: b.metric("kvroute_cp_workers") >= 64 + 8 + 1, 30)
            one = await answers([a], redis, step_s=step_s)
            two = await answers([a, b], redis, step_s=step_s)
            result["answers_per_s_1_replica"] = one["answers_per_s"]
            result["answers_per_s_2_replicas"] = two["answers_per_s"]
            result["answers_steps_1_replica"] = one["steps"]
            result["answers_steps_2_replicas"] = two["steps"]
            result.update(await router_sessions(a, b, redis.url))
        finally:
            a.stop()
            b.stop()
        result.update(await catch_up(redis, workdir, sizes))
    finally:
        redis.stop()
    return result


def run_replicas(
    batches: int = 4000,
    trials: int = 200,
    sizes: tuple[int, ...] = (100_000, 1_000_000),
    workdir: str = "",
    chaos_s: float = 0.0,
    step_s: float = 3.0,
) -> dict:
    path = Path(workdir) if workdir else temp_workdir("kvroute-bench-replicas-")
    result = asyncio.run(run_async(batches, trials, sizes, path, step_s))
    if chaos_s > 0:
        result.update(run_chaos_bench(path, chaos_s))
    return result


def run_chaos_bench(workdir: Path, phase_s: float) -> dict:
    """The chaos scenario with phases of `phase_s` seconds (tests/e2e/test_replica_chaos.py uses ~4-5 s)."""
    from kvroute.tools.replica_cluster import ReplicaCluster, run_chaos
    from kvroute.tools.tiny_model import build_model_dir

    redis = RedisServer(workdir).start()
    cluster = ReplicaCluster(
        workdir=workdir / "chaos", tokenizer_dir=build_model_dir(workdir / "tiny-llama"), heartbeat_timeout_s=5.0
    )
    try:
        cluster.start_replicas(redis.port, 3)
        for i in range(8):
            cluster.add_sim_engine(f"engine-{i}", "--speedup", "20", "--num-blocks", "2048")
        cluster.wait_engines_healthy()
        cluster.wait_workers_registered()
        urls = [cluster.start_router(f"r{i}", "kv_aware") for i in range(2)]
        kwargs = {"warm_s": phase_s, "cut_s": 5.0, "gap_s": phase_s, "tail_s": phase_s}
        baseline = run_chaos(cluster, urls, faults=False, **kwargs)
        chaos = run_chaos(cluster, urls, faults=True, **kwargs)
        return {
            "chaos_requests": chaos.requests,
            "chaos_failed": chaos.failed,
            "chaos_hit_rate": round(chaos.hit_rate, 4),
            "chaos_baseline_hit_rate": round(baseline.hit_rate, 4),
            "chaos_fail_open": chaos.fail_open,
            "chaos_fail_open_outside_deadline": chaos.fail_open_outside_deadline,
            "chaos_baseline_fail_open": baseline.fail_open,
            "chaos_audit_clean_s": chaos.audit_clean_s,
            "chaos_restart_ready_s": round(chaos.restart_ready_s, 3),
        }
    finally:
        cluster.stop()
        redis.stop()
