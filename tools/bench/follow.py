"""`kvroute bench follow`: how fresh, how fast to sync, how big and how fast to apply a router's own view
of the fleet (`--index local`: `ControlPlane.Follow` into a `FleetView`).

    kvroute bench follow [--modes embedded,redis] [--repeat 3] [--index-backend auto] \
        [--taskset-control-plane 1 --taskset-agents 1 --taskset-follower 0] --json

Every process is real and on this machine: a control plane (`kvroute control-plane`), synthetic agents
sending EventBatches over Connect with each batch's send time stamped (`synthetic_agents.py`), a
follower (`FleetView` + `ControlPlaneClient`, `follower.py`) stamping when each change became visible
in its view, and this process as router A (a RouterSession reserving). One host, so the wall clocks
of the processes are one clock.

- view_lag_*: an agent batch written to the Connect stream -> the follower's view has applied it.
  Embedded (one control plane: agents and follower on it) and `view_lag_redis_*` over Redis (two
  replicas over a redis-server of the bench's own: the agents on replica A, the follower on B).
- placement_visible_*: router A's `reserve()` -> the follower's view holds the reservation (embedded;
  `placement_visible_redis_*`: router A on replica A).
- router_catchup_s_1m: a new follower process against a control plane holding >= 1M (key, worker, tier)
  entries: from its Follow call to the snapshot applied (median of `catchup_runs`; `_max` too;
  `router_catchup_process_s_1m` from the process's start, imports included; `router_catchup_cpu_s_1m`
  the follower's CPU time for it and `control_plane_catchup_cpu_s_1m` the control plane's, which say
  what it takes on cores of their own).
- bytes_per_entry: what a view built from a 1M-entry snapshot allocated, per entry (tracemalloc, in
  this process, after the snapshot's messages are gone); `rss_bytes_per_entry`: the catch-up
  follower process's RSS growth per entry (allocator overhead and freed garbage included).
- cpu_us_per_batch_*: the control plane(s)' and the follower's CPU time over the freshness run per
  agent batch: the work on the path, against which the lag is mostly waiting for a CPU on a busy host.
- grpc_echo_*: the floor under a lag, a bare gRPC stream round trip of a batch's size between this
  process and another (two one-way hops, as agent -> control plane -> follower), in the same run.
- ingest_events_per_s: block events (keys stored + removed) per second a view applies from
  FollowUpdates recorded from a real feed (`FollowFeed` over a real state): parse -> apply_change ->
  index, in this process, on top of the 1M-entry view; `ingest_events_per_cpu_s`: per second of this
  process's CPU time (on a shared machine the wall-clock rate also says how much of a core it got).

On a shared machine: `--taskset-*` pin the processes (nothing is pinned unless asked) and `--repeat`
runs the process measurements several times, embedded and Redis in turn (the figures are the medians,
every run's are in `runs`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import statistics
import time
import tracemalloc
from functools import partial
from pathlib import Path

from kvroute import aio
from kvroute.control_plane.follow import FollowFeed
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.fleet.entries import BlockOp, Op, RegisterBody
from kvroute.fleet.state import FleetState
from kvroute.prefix_index.backends import make_index, resolve_backend
from kvroute.tools.bench.children import pid_of_managed, pin, start_agents, start_follower
from kvroute.tools.bench.decision import echo_round_trips
from kvroute.tools.bench.replicas import ReplicaProcess
from kvroute.tools.disturbance import DisturbanceMonitor, process_cpu_s
from kvroute.tools.redis_harness import RedisServer, temp_workdir
from kvroute.tools.stats import percentile
from kvroute.v1 import kvroute_pb2 as pb

MODEL = "bench-model"


def _ms_stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{prefix}_p50_ms": float("nan"), f"{prefix}_p99_ms": float("nan")}
    return {
        f"{prefix}_p50_ms": round(percentile(values, 50), 3),
        f"{prefix}_p99_ms": round(percentile(values, 99), 3),
        f"{prefix}_max_ms": round(max(values), 3),
    }


def _lags_ms(sent_ns: dict[str, int], seen_ns: dict[str, int]) -> tuple[list[float], int]:
    """Per key sent: ms until seen; and how many were never seen."""
    lags = [(seen_ns[k] - t) / 1e6 for k, t in sent_ns.items() if k in seen_ns]
    return lags, len(sent_ns) - len(lags)


# ------------------------------------------------------------------ freshness, as processes


async def _reserve_trials(address: str, worker_ids: list[str], trials: int, interval_s: float) -> dict[str, int]:
    """Router A: `trials` reservations (8 keys each), each released `interval_s` later; send ns by
    "router_id/reservation_id"."""
    rng = random.Random(5)
    client = ControlPlaneClient(address, use_session=True)
    client.start()
    session = client.session
    assert session is not None
    sent: dict[str, int] = {}
    try:
        if not await session.wait_connected(30):
            raise RuntimeError(f"router A's session to {address} did not open")
        previous = 0
        for i in range(trials):
            keys = [rng.getrandbits(64) for _ in range(8)]
            stamp = time.time_ns()
            rid = session.reserve(worker_ids[i % len(worker_ids)], 16, keys, prefill_tokens=128, prompt_tokens=128)
            sent[f"{session.router_id}/{rid}"] = stamp
            if previous:
                session.release(previous)
            previous = rid
            await asyncio.sleep(interval_s)
        await asyncio.sleep(0.5)  # the last ones reach the view before it is stopped
    finally:
        await client.close()
    return sent


async def freshness(
    workdir: Path, agents_at: str, follower_at: str, label: str, args, control_planes: list[int], others: tuple[int, ...] = ()
) -> dict:
    """Agents on `agents_at` at args.rate batches/s, the follower on `follower_at`, router A reserving on
    `agents_at`. The CPU that processes other than ours (`control_planes`, `others`, the agents, the
    follower, this one) took meanwhile, and how long the control planes' and the follower's event loops
    waited for a CPU, are reported as `disturbance` (tools/disturbance.py)."""
    workers = args.workers
    agents = start_agents(
        workdir,
        f"agents-{label}",
        agents_at,
        "--workers",
        str(workers),
        "--model",
        MODEL,
        "--rate",
        str(args.rate * args.batch_keys * 2),
        "--batch-keys",
        str(args.batch_keys),
        "--wait-signal",
        taskset=args.taskset_agents,
    )
    follower = None
    try:
        agents.wait_ready(60)
        follower = start_follower(
            workdir, f"follower-{label}", follower_at, "--index-backend", args.index_backend, taskset=args.taskset_follower
        )
        follower.wait_ready(60)
        loops = [*control_planes, follower.pid]
        monitor = DisturbanceMonitor([os.getpid(), agents.pid, *loops, *others], loops)
        monitor.start()
        cpu_before = {pid: process_cpu_s(pid) for pid in loops}
        agents.signal(signal.SIGUSR1)
        duration = args.batches / args.rate
        trials = max(1, int(duration / args.reserve_interval_s))
        reserved = await _reserve_trials(agents_at, [f"synthetic-{i}" for i in range(workers)], trials, args.reserve_interval_s)
        sent = agents.finish()
        disturbance = monitor.stop()
        await asyncio.sleep(0.5)  # the last batches reach the view
        cpu = {pid: process_cpu_s(pid) - cpu_before[pid] for pid in loops}
        seen = follower.finish()
    finally:
        agents.process.stop()
        if follower is not None:
            follower.process.stop()
    lags, unseen = _lags_ms(sent["sent_ns"], seen["batches"])
    placed, unplaced = _lags_ms(reserved, seen["reserved"])
    suffix = "" if label == "embedded" else f"_{label}"
    # The work on the path, per batch (heartbeats, reservations and keepalives included): what a lag
    # would be with a CPU always free; the rest of the lag is waiting.
    batches = max(1, len(sent["sent_ns"]))
    work = {
        f"cpu_us_per_batch{suffix}": {
            "control_planes": round(sum(cpu[p] for p in control_planes) / batches * 1e6, 1),
            "follower": round(cpu[follower.pid] / batches * 1e6, 1),
        }
    }
    return {
        **_ms_stats(f"view_lag{suffix}", lags),
        f"view_lag{suffix}_samples": len(lags),
        **work,
        f"view_lag{suffix}_unseen": unseen,
        f"agent_events_per_s{suffix}": sent["events_per_s"],
        **_ms_stats(f"placement_visible{suffix}", placed),
        f"placement_visible{suffix}_samples": len(placed),
        f"placement_visible{suffix}_unseen": unplaced,
        f"disturbance{suffix}": disturbance.to_json(),
    }


def catchup(workdir: Path, address: str, cp_pid: int, entries: int, runs: int, args) -> dict:
    """Fill the control plane at `address` (process `cp_pid`) to >= `entries` entries (8 workers), then
    time `runs` new followers."""
    per_worker = -(-entries // 8)
    agents = start_agents(
        workdir,
        "agents-catchup",
        address,
        "--workers",
        "8",
        "--worker-prefix",
        "catchup-",
        "--model",
        MODEL,
        "--snapshot-keys",
        str(per_worker),
        "--seed",
        "9",
        taskset=args.taskset_agents,
    )
    out: dict = {}
    try:
        filled = agents.wait_ready(600)
        stream, process, cpu, cp_cpu, rss = [], [], [], [], []
        for run in range(runs):
            cp_before = process_cpu_s(cp_pid)
            follower = start_follower(
                workdir, f"follower-catchup-{run}", address, "--index-backend", args.index_backend, taskset=args.taskset_follower
            )
            try:
                ready = follower.wait_ready(600)
                cp_cpu.append(process_cpu_s(cp_pid) - cp_before)  # the snapshot's share, and the process start's wait
            finally:
                follower.process.stop()
            if ready["entries"] < entries:
                raise RuntimeError(f"the follower synced {ready['entries']} entries, fewer than {entries}")
            stream.append(ready["stream_to_synced_s"])
            process.append(ready["process_to_synced_s"])
            cpu.append(ready["sync_cpu_s"])
            rss.append((ready["rss_synced_bytes"] - ready["rss_before_bytes"]) / ready["entries"])
        out = {
            "router_catchup_s_1m": round(statistics.median(stream), 3),
            "router_catchup_s_1m_max": max(stream),
            "router_catchup_runs_s": stream,
            "router_catchup_process_s_1m": round(statistics.median(process), 3),
            "router_catchup_cpu_s_1m": round(statistics.median(cpu), 3),
            "control_plane_catchup_cpu_s_1m": round(statistics.median(cp_cpu), 3),
            "catchup_entries": ready["entries"],
            "catchup_agent_entries": filled["entries"],
            "rss_bytes_per_entry": round(statistics.median(rss), 1),
        }
    finally:
        agents.process.stop()
    return out


async def embedded(workdir: Path, args) -> dict:
    cp = ReplicaProcess(workdir, "", "cp-embedded", extra=("--speculative-ttl-ms", "600000"))
    cp.start()
    try:
        if args.taskset_control_plane:
            pin(pid_of(cp), args.taskset_control_plane)
        out = await freshness(workdir, cp.address, cp.address, "embedded", args, [pid_of(cp)])
        if args.catchup_entries:
            out.update(catchup(workdir, cp.address, pid_of(cp), args.catchup_entries, args.catchup_runs, args))
    finally:
        cp.stop()
    return out


def pid_of(cp: ReplicaProcess) -> int:
    return pid_of_managed(cp.process)


async def over_redis(workdir: Path, args) -> dict:
    redis = RedisServer(workdir).start()
    a = ReplicaProcess(workdir, redis.url, "replica-a")
    b = ReplicaProcess(workdir, redis.url, "replica-b")
    try:
        a.start()
        b.start()
        for replica in (a, b):
            if args.taskset_control_plane:
                pin(pid_of(replica), args.taskset_control_plane)
        assert redis.process is not None
        return await freshness(
            workdir, a.address, b.address, "redis", args, [pid_of(a), pid_of(b)], (pid_of_managed(redis.process),)
        )
    finally:
        a.stop()
        b.stop()
        redis.stop()


# ------------------------------------------------------------------ memory and ingest, in process


def fleet_state(workers: int, keys_per_worker: int, seed: int = 1) -> FleetState:
    """A control plane's state: `workers` workers of MODEL, each holding its own random keys."""
    rng = random.Random(seed)
    state = FleetState.build()
    for w in range(workers):
        record = state.applier.register(
            f"w{w}", RegisterBody(MODEL, "sim", 16, f"http://127.0.0.1:{20000 + w}", "", [], None, f"i{w}", ""), resume=False
        )
        state.applier.apply_batch(record, 1, True, [BlockOp(Op.STORED, 0, [rng.getrandbits(64) for _ in range(keys_per_worker)])])
    return state


async def recorded_updates(
    state: FleetState, batches: int, batch_keys: int, batches_per_message: int, seed: int = 2
) -> tuple[list[bytes], list[bytes], int]:
    """(the snapshot's messages, then `batches` agent batches as the feed sends them, block events in
    those). Each batch stores `batch_keys` new keys on a worker and removes as many of its oldest."""
    feed = FollowFeed(state, "bench", window_changes=batches + 16, window_bytes=1 << 40)
    stream = feed.follow(pb.FollowRequest(router_id="bench"))
    snapshot = []
    while True:
        message = await anext(stream)
        snapshot.append(message)
        if pb.FollowUpdate.FromString(message).snapshot_end:
            break
    rng = random.Random(seed)
    records = state.registry.workers()
    fifo = {r.slot: list(state.index.worker_keys(r.slot, 0)) for r in records}
    deltas, events = [], 0
    seqs = {r.slot: r.last_seq for r in records}
    for i in range(batches):
        record = records[i % len(records)]
        new = [rng.getrandbits(64) for _ in range(batch_keys)]
        old = fifo[record.slot][:batch_keys]
        del fifo[record.slot][:batch_keys]
        fifo[record.slot].extend(new)
        seqs[record.slot] += 1
        state.applier.apply_batch(record, seqs[record.slot], False, [BlockOp(Op.STORED, 0, new), BlockOp(Op.REMOVED, 0, old)])
        events += len(new) + len(old)
        if (i + 1) % batches_per_message == 0 or i == batches - 1:
            deltas.append(await anext(stream))
    await stream.aclose()
    return snapshot, deltas, events


async def view_memory_and_ingest(
    entries: int, workers: int, batches: int, batch_keys: int, batches_per_message: int, index_backend: str
) -> dict:
    state = fleet_state(workers, -(-entries // workers))
    snapshot, deltas, events = await recorded_updates(state, batches, batch_keys, batches_per_message)
    del state
    factory = partial(make_index, index_backend)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    view = FleetView("bench", index_factory=factory)
    for message in snapshot:
        view.apply_update(pb.FollowUpdate.FromString(message))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert view.state is not None
    held = view.state.index.entry_count()
    allocated = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del before, after
    parse = pb.FollowUpdate.FromString
    apply = view.apply_update
    started, cpu_started = time.perf_counter(), time.process_time()
    for message in deltas:
        apply(parse(message))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    # Per CPU second too: on a shared machine the wall-clock rate is also how much of a core this got.
    return {
        "bytes_per_entry": round(allocated / held, 1),
        "view_entries": held,
        "ingest_events_per_s": round(events / elapsed),
        "ingest_events_per_cpu_s": round(events / max(cpu, 1e-9)),
        "ingest_block_events": events,
        "ingest_seconds": round(elapsed, 3),
        "ingest_cpu_seconds": round(cpu, 3),
        "ingest_batches_per_message": batches_per_message,
        "ingest_batch_keys": batch_keys,
    }


# ------------------------------------------------------------------ the whole bench


def run_follow(args) -> dict:
    """`args`: the `kvroute bench follow` flags (tools/bench/cli.py). One event loop for every async part
    of this process (grpc.aio keeps to the first loop a process runs); the waits on the processes
    block it, with nothing else on it meanwhile."""
    return aio.run_value(_run_follow(args))


async def _run_follow(args) -> dict:
    workdir = Path(args.workdir) if args.workdir else temp_workdir("kvroute-bench-follow-")
    result: dict = {
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        "index_backend": resolve_backend(args.index_backend),
        "rate_batches_per_s": args.rate,
        "workers": args.workers,
        "batch_keys": args.batch_keys,
    }
    runs: list[dict] = []
    for _ in range(args.repeat):
        run: dict = {}
        modes = {m for m in args.modes.split(",") if m}
        if modes - {"embedded", "redis"}:
            raise SystemExit(f"kvroute bench follow: error: --modes takes embedded and redis, got {args.modes!r}")
        if "embedded" in modes:
            run.update(await embedded(workdir, args))
        if "redis" in modes:
            run.update(await over_redis(workdir, args))
        # The floor under a lag: a bare gRPC round trip (two one-way hops, as agent -> control plane ->
        # follower) of a batch's size between two processes, on this machine at this time.
        echo = await echo_round_trips(200, 200, 500, None, workdir)
        run.update({"grpc_echo_p50_ms": round(percentile(echo, 50), 3), "grpc_echo_p99_ms": round(percentile(echo, 99), 3)})
        runs.append(run)
    result.update(_median_of(runs))
    if args.repeat > 1:
        result["runs"] = runs
    if args.memory_entries:
        result.update(
            await view_memory_and_ingest(
                args.memory_entries, 64, args.ingest_batches, args.batch_keys, args.ingest_batches_per_message, args.index_backend
            )
        )
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return result


def _median_of(runs: list[dict]) -> dict:
    """Per key, the median over runs of the numbers, of a dict's numbers key by key (the first run's
    value for anything else)."""
    out: dict = {}
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if len(runs) > 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = round(statistics.median(values), 3)
        elif len(runs) > 1 and all(isinstance(v, dict) for v in values):
            out[key] = _median_of(values)
        else:
            out[key] = value
    return out
