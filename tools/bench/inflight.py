"""`kvroute bench inflight`: how stale is the in-flight state routers share through the control plane?

A control plane runs as its own process with one registered (fake) worker. Two RouterSession
clients, as two routers would be, each on its own gRPC channel, run in this process: per trial
router A sends `reserve` (with the prompt's block keys) and router B queries in a tight loop until
its answer shows the reservation (one reserved request and every block speculative); then A sends
`release` and B loops until the reservation is gone. The time from A's write to the first answer
of B that shows it is the visibility delay: the staleness bound of shared in-flight state (it
includes one query round trip, reported separately). The last stdout line is JSON.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import grpc

from kvroute.tools.local_cluster import LocalCluster
from kvroute.tools.stats import percentile
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

MODEL = "bench-model"
WORKER = "bench-worker"
BLOCK_SIZE = 16
WARMUP_TRIALS = 20


async def register_worker(stub: pb_grpc.ControlPlaneStub) -> grpc.aio.StreamStreamCall:
    call = stub.Connect()
    await call.write(
        pb.AgentMessage(
            register=pb.RegisterWorker(
                worker_id=WORKER, model=MODEL, engine="sim", block_size=BLOCK_SIZE, endpoint="http://127.0.0.1:9"
            )
        )
    )
    await call.read()
    return call


async def open_router(stub: pb_grpc.ControlPlaneStub, router_id: str) -> grpc.aio.StreamStreamCall:
    call = stub.RouterSession()
    await call.write(pb.RouterMessage(hello=pb.RouterHello(router_id=router_id)))
    await call.read()
    return call


async def poll_until(router: grpc.aio.StreamStreamCall, query: pb.QueryRequest, seen, rtts: list[float]) -> int:
    """Query until `seen(worker_match)` holds; returns how many queries it took."""
    polls = 0
    while True:
        polls += 1
        query.query_id += 1
        sent = time.perf_counter()
        await router.write(pb.RouterMessage(query=query))
        reply = await router.read()
        rtts.append(time.perf_counter() - sent)
        if seen(reply.result.workers[0]):
            return polls


async def measure(address: str, trials: int, block_keys: int, seed: int) -> dict:
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(address) for _ in range(3)]  # the worker, router A, router B
    try:
        agent = await register_worker(pb_grpc.ControlPlaneStub(channels[0]))
        router_a = await open_router(pb_grpc.ControlPlaneStub(channels[1]), "router-a")
        router_b = await open_router(pb_grpc.ControlPlaneStub(channels[2]), "router-b")
        reserve_ms, release_ms, rtts, polls = [], [], [], []
        for trial in range(trials + WARMUP_TRIALS):
            keys = [rng.getrandbits(64) for _ in range(block_keys)]
            query = pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=BLOCK_SIZE, block_keys=keys)])
            started = time.perf_counter()
            await router_a.write(
                pb.RouterMessage(
                    reserve=pb.Reservation(
                        reservation_id=trial,
                        worker_id=WORKER,
                        block_size=BLOCK_SIZE,
                        block_keys=keys,
                        prefill_tokens=block_keys * BLOCK_SIZE,
                        ttl_ms=60_000,
                    )
                )
            )
            reserve_polls = await poll_until(
                router_b, query, lambda w: w.reserved_requests == 1 and w.speculative_blocks == block_keys, rtts
            )
            reserved = time.perf_counter()
            await router_a.write(pb.RouterMessage(release=pb.ReservationDone(reservation_id=trial)))
            release_polls = await poll_until(router_b, query, lambda w: w.reserved_requests == 0 and w.matched_blocks == 0, rtts)
            released = time.perf_counter()
            if trial >= WARMUP_TRIALS:
                reserve_ms.append((reserved - started) * 1000)
                release_ms.append((released - reserved) * 1000)
                polls.append(reserve_polls + release_polls)
        for call in (router_a, router_b, agent):
            await call.done_writing()
    finally:
        for channel in channels:
            await channel.close()
    return {
        "reserve_visible_p50_ms": round(percentile(reserve_ms, 50), 3),
        "reserve_visible_p99_ms": round(percentile(reserve_ms, 99), 3),
        "release_visible_p50_ms": round(percentile(release_ms, 50), 3),
        "release_visible_p99_ms": round(percentile(release_ms, 99), 3),
        "query_rtt_p50_ms": round(percentile([r * 1000 for r in rtts], 50), 3),
        "polls_per_trial": round(sum(polls) / len(polls), 2),
        "trials": trials,
        "block_keys": block_keys,
    }


def run_inflight(trials: int = 200, block_keys: int = 64, seed: int = 0) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=workdir, heartbeat_timeout_s=3600)
    try:
        address = cluster.start_control_plane()
        return asyncio.run(measure(address, trials, block_keys, seed))
    finally:
        cluster.stop()
