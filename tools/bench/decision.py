"""Routing decision latency end to end: tokenize + hash + control-plane Query over gRPC + score.

The control plane runs as its own process; the benchmark registers `workers` fake agents over
real Connect streams and fills the index (each worker holds part of the prompt's prefix plus
unrelated blocks), has a second router put 128 requests in flight (speculative claims on other
prompts' tails, as in a serving fleet), then times the router's own decision path (chat template +
tokenizer, then `Router.decide`) in-process. Each request is a chat with one long shared system prompt and a new
user turn. `p50_ms`/`p99_ms` use the router's tokenizer (its segment cache knows the system
prompt after the first request); `cold_*` is the same path with the cache off, i.e. what a
never-seen prompt costs. `grpc_echo_p50_ms` is the floor under the query: a bare gRPC stream round
trip with messages of the query's and the answer's sizes, between this process and another one in
the control plane's place (`kvroute.tools.bench.grpc_echo`), timed after the decisions;
`control_plane_answer_mean_ms` is the control plane's own time per answer (its query histogram).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvroute import aio
from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.control_plane_client import ControlPlaneClient, query_message
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.inflight import RouterInflight
from kvroute.data_plane.routing import Router
from kvroute.data_plane.tokenization import load_tokenizer
from kvroute.prom_text import sample_sums
from kvroute.tools.bench.grpc_echo import round_trips_ms
from kvroute.tools.local_cluster import LocalCluster, ManagedProcess, free_port, http_get
from kvroute.tools.stats import percentile
from kvroute.tools.tiny_model import build_model_dir
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

MODEL = "tiny-llama"
WORDS = ["cache", "token", "prefix", "router", "worker", "model", "request", "latency", "block", "memory", "engine", "query", "index", "policy"]


def prompt_text(tokenizer, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode_prompt(" ".join(words))) < n_tokens:
        words.extend(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(256))
    ids = tokenizer.encode_prompt(" ".join(words))[:n_tokens]
    return tokenizer.decode(ids)


async def populate(address: str, workers: int, block_size: int, prompt_keys: list[int], other_blocks: int,
                   seed: int) -> list:
    rng = random.Random(seed)
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)])
    stub = pb_grpc.ControlPlaneStub(channel)
    calls = []
    for w in range(workers):
        held = prompt_keys[: rng.randrange(len(prompt_keys) + 1)] + [rng.getrandbits(64) for _ in range(other_blocks)]
        messages = [
            pb.AgentMessage(register=pb.RegisterWorker(worker_id=f"w{w}", model=MODEL, engine="sim", block_size=block_size,
                                                       endpoint=f"http://127.0.0.1:{20000 + w}")),
            pb.AgentMessage(batch=pb.EventBatch(seq=1, snapshot=True, events=[
                pb.BlockEvent(stored=pb.BlocksStored(block_keys=held, tier=pb.TIER_GPU))])),
        ]
        queue: asyncio.Queue = asyncio.Queue()
        for m in messages:
            queue.put_nowait(m)

        async def outgoing(q=queue):
            while True:
                yield await q.get()

        call = stub.Connect(outgoing())
        await call.read()  # registered
        await call.read()  # snapshot acked
        calls.append((call, queue))
    return [channel, calls]


def chat_messages(system_text: str, i: int) -> list[dict]:
    """A long shared system prompt and a new user turn: the repeated-chat-prefix case."""
    return [{"role": "system", "content": system_text},
            {"role": "user", "content": f"question {i}: which worker holds this prefix, and why?"}]


async def in_flight_elsewhere(address: str, worker_ids: list[str], block_size: int, requests: int,
                              seed: int) -> ControlPlaneClient:
    """Another router with `requests` requests in flight (new 256-token tails of other prompts), as
    in a serving fleet: the control plane then holds speculative claims while we query."""
    rng = random.Random(seed + 1)
    other = ControlPlaneClient(address, query_timeout_s=1.0)
    other.start()
    if not await other.session.wait_connected(10):
        raise RuntimeError("second router session did not open")
    for _ in range(requests):
        tail = [rng.getrandbits(64) for _ in range(256 // block_size)]
        other.session.reserve(rng.choice(worker_ids), block_size, tail, prefill_tokens=256, prompt_tokens=8192)
    await asyncio.sleep(0.2)  # the reservations reach the control plane before the first query
    return other


async def measure(address: str, tokenizer_dir: Path, prompt_tokens: int, workers: int, block_size: int,
                  iterations: int, other_blocks: int, seed: int, inflight_requests: int = 128) -> dict:
    tokenizer = load_tokenizer(tokenizer_dir)
    uncached = load_tokenizer(tokenizer_dir, cache_tokens=0)  # what a never-seen prompt costs
    system_text = prompt_text(uncached, prompt_tokens - 24, seed)
    ids = uncached.encode_chat(chat_messages(system_text, 0))
    keep_alive = await populate(address, workers, block_size, prompt_block_keys(ids, block_size, MODEL), other_blocks, seed)
    client = ControlPlaneClient(address, query_timeout_s=1.0)
    await client.refresh()
    client.start()  # the refresher and the router session stream, as the router runs them
    if not await client.session.wait_connected(10):
        raise RuntimeError("router session to the control plane did not open")
    other_router = await in_flight_elsewhere(address, [f"w{w}" for w in range(workers)], block_size,
                                             inflight_requests, seed)
    query_ms: list[float] = []
    query = client.query
    sizes: dict[str, int] = {}

    async def timed_query(model, chains, lora_name=""):
        t0 = time.perf_counter()
        try:
            columns = await query(model, chains, lora_name)
        finally:
            query_ms.append((time.perf_counter() - t0) * 1000)
        if not sizes:
            sizes.update(query_message_sizes(model, chains, columns))
        return columns

    client.query = timed_query  # type: ignore[method-assign]
    router = Router(client, make_policy("kv_aware", seed=seed), RouterInflight(client.session))
    result: dict = {}
    fail_open = 0
    for label, tok in (("", tokenizer), ("cold_", uncached)):
        samples, tokenize_ms = [], []
        for i in range(iterations + 20):
            messages = chat_messages(system_text, i + 1)
            started = time.perf_counter()
            tokens = tok.encode_chat(messages)
            tokenized = time.perf_counter()
            decision = await router.decide(MODEL, tokens)
            elapsed = time.perf_counter() - started
            if i >= 20:  # warm-up
                samples.append(elapsed * 1000)
                tokenize_ms.append((tokenized - started) * 1000)
                fail_open += decision.fail_open
        result[f"{label}p50_ms"] = round(percentile(samples, 50), 3)
        result[f"{label}p99_ms"] = round(percentile(samples, 99), 3)
        result[f"{label}tokenize_p50_ms"] = round(percentile(tokenize_ms, 50), 3)
        result[f"{label}query_p50_ms"] = round(percentile(query_ms[-iterations:], 50), 3)
    await client.close()
    await other_router.close()
    await keep_alive[0].close()
    return {**result, "prompt_tokens": len(ids), "workers": workers, "iterations": iterations,
            "inflight_elsewhere": inflight_requests, "fail_open": fail_open, **sizes}


def query_message_sizes(model: str, chains: dict[int, list[int]], columns: pb.WorkerColumns) -> dict[str, int]:
    """Bytes on the wire of one query on the router session and of its answer."""
    message = query_message(model, chains)
    message.query.query_id = 1 << 20
    reply = pb.RouterReply(result=pb.QueryResponse(query_id=1 << 20, columns=columns))
    return {"query_bytes": message.ByteSize(), "answer_bytes": reply.ByteSize()}


def control_plane_answer_mean_ms(metrics_url: str) -> float:
    """Mean time the control plane spent answering a query (its own histogram: the work between
    receiving the message and handing the reply to gRPC), over every query of the run."""
    status, body = http_get(metrics_url)
    if status != 200:
        raise RuntimeError(f"control plane /metrics answered {status}")
    total, count = "kvroute_cp_query_seconds_sum", "kvroute_cp_query_seconds_count"
    values = sample_sums(body.decode(), {total, count})
    return round(values[total] / values[count] * 1000, 3) if values.get(count) else 0.0


def measure_echo_floor(request_bytes: int, reply_bytes: int, iterations: int, core: int | None,
                       workdir: Path) -> float:
    """p50 ms of a bare gRPC stream round trip to a `kvroute.tools.bench.grpc_echo` process (on `core` if given)."""
    return round(percentile(echo_round_trips_ms(request_bytes, reply_bytes, iterations, core, workdir), 50), 3)


def echo_round_trips_ms(request_bytes: int, reply_bytes: int, iterations: int, core: int | None,
                        workdir: Path) -> list[float]:
    """Bare gRPC stream round trips (ms) to a `kvroute.tools.bench.grpc_echo` process (on `core` if given)."""
    port = free_port()
    server = ManagedProcess("grpc-echo", [sys.executable, "-m", "kvroute.tools.bench.grpc_echo", "--port", str(port),
                                          "--reply-bytes", str(reply_bytes)], workdir / "grpc-echo.log")
    server.start()
    try:
        if core is not None:
            os.sched_setaffinity(server.popen.pid, {core})
        return aio.run_value(round_trips_ms(f"127.0.0.1:{port}", request_bytes, iterations))
    finally:
        server.stop()


def pin_apart(control_plane_pid: int) -> int | None:
    """This process on one core, the control plane on another; the control plane's core (None where
    that is not possible)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None
    os.sched_setaffinity(control_plane_pid, {cores[1]})
    os.sched_setaffinity(0, {cores[0]})
    return cores[1]


def run_decision(prompt_tokens: int = 8192, workers: int = 64, block_size: int = 16, iterations: int = 300,
                 other_blocks: int = 2000, seed: int = 0, pin_cores: bool = False, max_index_entries: int = 0) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / MODEL),
                           heartbeat_timeout_s=3600)
    try:
        # Claims of the other router's in-flight requests stay for the whole run (no engine confirms them).
        metrics_port = free_port()
        bound = ("--max-index-entries", str(max_index_entries)) if max_index_entries else ()
        address = cluster.start_control_plane(extra_args=("--speculative-ttl-ms", "3600000",
                                                          "--metrics-port", str(metrics_port), *bound))
        control_plane_core = pin_apart(cluster.control_plane.popen.pid) if pin_cores else None
        result = aio.run_value(measure(address, cluster.tokenizer_dir, prompt_tokens, workers, block_size, iterations,
                                       other_blocks, seed))
        result["control_plane_answer_mean_ms"] = control_plane_answer_mean_ms(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        cluster.stop()
    # After the control plane has stopped, in its place (its core when pinned).
    echo = measure_echo_floor(result["query_bytes"], result["answer_bytes"], iterations, control_plane_core, workdir)
    return {**result, "grpc_echo_p50_ms": echo, "pinned_cores": control_plane_core is not None,
            "max_index_entries": max_index_entries}
