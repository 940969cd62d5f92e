"""Routing decision latency end to end: tokenize + hash + the index's answer + score.

    kvroute bench decision [--index local|remote] [--follow-rate [N]] [--pin-cores]

The control plane runs as its own process; synthetic agents (`synthetic_agents.py`, a process of
their own) register `workers` workers over real Connect streams and fill the index (each worker holds
part of the prompt's prefix plus `other_blocks` unrelated blocks), a second router puts 128 requests
in flight (speculative claims on other prompts' tails, as in a serving fleet), then this process times
the router's own decision path (chat template + tokenizer, then `Router.decide`). Each request is a
chat with one long shared system prompt and a new user turn.

- `--index local` (the router's default): the decision reads this router's own view of the fleet
  (`FleetView`, following the control plane in this process); `--index remote`: it asks the control
  plane over the router session (`query_*` is then the query's round trip, `grpc_echo_p50_ms` the
  floor under it: a bare gRPC stream round trip with the query's and the answer's sizes to a process in
  the control plane's place, timed after the decisions; `control_plane_answer_mean_ms` the control
  plane's own time per answer, its query histogram). `query_*` is the index step in both.
- `--follow-rate N`: the agents store and remove N block events per second meanwhile (each batch
  stores 64 new keys and removes 64 old ones), so the index keeps its size (>= 1M entries: 16,384
  blocks per worker unless `--other-blocks` says otherwise) while the control plane, and with `--index
  local` this router's view, apply them; decisions are then spaced `--interval-ms` apart (a router
  between requests) so that the view's follower task runs between them, and timing starts after a
  second of the feed. `*_applied_events_per_s` say the rate achieved during the timed decisions;
  `view_lag_ms_end` how old the view's newest change was when it arrived, at the end (a view that
  cannot keep up grows it; `view_snapshots` > 1: it fell behind the feed's window). The timed
  decisions stop after `--max-seconds` with what they measured (`decisions`, `cold_decisions`).
- `p50_ms`/`p99_ms` use the router's tokenizer (its segment cache knows the system prompt after the
  first request); `cold_*` is the same path with the cache off, i.e. what a never-seen prompt costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvroute import aio
from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, query_message
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.prepare.tokenization import load_tokenizer
from kvroute.data_plane.service.routing import Router
from kvroute.prom_text import sample_sums, sums_by_label
from kvroute.tools.bench.children import ChildProcess, start_agents
from kvroute.tools.bench.grpc_echo import round_trips_ms
from kvroute.tools.local_cluster import LocalCluster, ManagedProcess, free_port, http_get
from kvroute.tools.stats import percentile
from kvroute.tools.tiny_model import build_model_dir
from kvroute.v1 import kvroute_pb2 as pb

MODEL = "tiny-llama"
WORDS = [
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
    "policy",
]
FOLLOW_BATCH_KEYS = 64  # keys stored (and as many removed) per agent batch under --follow-rate


def prompt_text(tokenizer, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode_prompt(" ".join(words))) < n_tokens:
        words.extend(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(256))
    ids = tokenizer.encode_prompt(" ".join(words))[:n_tokens]
    return tokenizer.decode(ids)


def chat_messages(system_text: str, i: int) -> list[dict]:
    """A long shared system prompt and a new user turn: the repeated-chat-prefix case."""
    return [
        {"role": "system", "content": system_text},
        {"role": "user", "content": f"question {i}: which worker holds this prefix, and why?"},
    ]


async def in_flight_elsewhere(
    address: str, worker_ids: list[str], block_size: int, requests: int, seed: int
) -> ControlPlaneClient:
    """Another router with `requests` requests in flight (new 256-token tails of other prompts), as
    in a serving fleet: the control plane then holds speculative claims while we query."""
    rng = random.Random(seed + 1)
    # A router of its own: the measuring router leaves its own session's echo out of its view.
    other = ControlPlaneClient(address, query_timeout_s=1.0, router_id="bench-other-router")
    other.start()
    if not await other.session.wait_connected(10):
        raise RuntimeError("second router session did not open")
    for _ in range(requests):
        tail = [rng.getrandbits(64) for _ in range(256 // block_size)]
        other.session.reserve(rng.choice(worker_ids), block_size, tail, prefill_tokens=256, prompt_tokens=8192)
    await asyncio.sleep(0.2)  # the reservations reach the control plane before the first query
    return other


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench decision: {what} within {timeout_s:.0f} s")
        await asyncio.sleep(0.01)


def _reserved_elsewhere(view: FleetView, router_id: str) -> int:
    tally = view.state.inflight.routers.get(router_id) if view.state is not None else None
    return sum(tally.requests.values()) if tally is not None else 0


def applied_events(metrics_url: str) -> float:
    """Block keys the control plane applied so far (stored + removed), from its /metrics."""
    status, body = http_get(metrics_url)
    if status != 200:
        raise RuntimeError(f"control plane /metrics answered {status}")
    by_op = sums_by_label(body.decode(), "kvroute_cp_block_events_total", "op")
    return by_op.get("stored", 0.0) + by_op.get("removed", 0.0)


async def measure(
    address: str,
    tokenizer,
    uncached,
    system_text: str,
    workers: int,
    block_size: int,
    iterations: int,
    seed: int,
    index: str,
    metrics_url: str,
    start_feed: Callable[[], None] | None,
    interval_s: float,
    max_seconds: float = 300.0,
    inflight_requests: int = 128,
) -> dict:
    view = FleetView("bench-router", models={MODEL}) if index == "local" else None
    client = ControlPlaneClient(address, query_timeout_s=1.0, view=view, max_message_bytes=256 * 1024 * 1024)
    if view is None:
        await client.refresh()
    client.start()  # the refresher (or the view's follower) and the router session stream, as the router runs them
    if not await client.session.wait_connected(10):
        raise RuntimeError("router session to the control plane did not open")
    if view is not None:
        await _until(lambda: view.synced, 120, "the view's first snapshot")
    other_router = await in_flight_elsewhere(address, [f"w{w}" for w in range(workers)], block_size, inflight_requests, seed)
    if view is not None:
        await _until(
            lambda: _reserved_elsewhere(view, other_router.session.router_id) >= inflight_requests,
            30,
            "the other router's requests in the view",
        )
    index_ms: list[float] = []
    sizes: dict[str, int] = {}
    if view is None:
        query = client.query

        async def timed_query(model, chains, lora_name=""):
            t0 = time.perf_counter()
            try:
                columns = await query(model, chains, lora_name)
            finally:
                index_ms.append((time.perf_counter() - t0) * 1000)
            if not sizes:
                sizes.update(query_message_sizes(model, chains, columns))
            return columns

        client.query = timed_query  # type: ignore[method-assign]
    else:
        answer = view.answer

        def timed_answer(model, chains, lora_name=""):
            t0 = time.perf_counter()
            try:
                return answer(model, chains, lora_name)
            finally:
                index_ms.append((time.perf_counter() - t0) * 1000)

        view.answer = timed_answer  # type: ignore[method-assign]
    router = Router(client, make_policy("kv_aware", seed=seed), RouterInflight(client.session))
    if start_feed is not None:
        start_feed()
        await asyncio.sleep(1.0)  # the feed at its rate before the first timed decision
    result: dict = {}
    fail_open = 0
    view_before = _view_applied(view)
    cp_before = applied_events(metrics_url)
    window_started = time.perf_counter()
    give_up_at = window_started + max_seconds
    for label, tok in (("", tokenizer), ("cold_", uncached)):
        samples, tokenize_ms = [], []
        for i in range(iterations + 20):
            if time.perf_counter() > give_up_at and samples:
                break  # a host too busy for the view to keep up: report what was measured
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
            if interval_s:
                await asyncio.sleep(interval_s)
        result[f"{label}p50_ms"] = round(percentile(samples, 50), 3)
        result[f"{label}p99_ms"] = round(percentile(samples, 99), 3)
        result[f"{label}tokenize_p50_ms"] = round(percentile(tokenize_ms, 50), 3)
        result[f"{label}query_p50_ms"] = round(percentile(index_ms[-iterations:], 50), 3)
        result[f"{label}query_p99_ms"] = round(percentile(index_ms[-iterations:], 99), 3)
        result[f"{label}decisions"] = len(samples)
    window = time.perf_counter() - window_started
    result["control_plane_applied_events_per_s"] = round((applied_events(metrics_url) - cp_before) / window)
    if view is not None:
        result["view_applied_events_per_s"] = round((_view_applied(view) - view_before) / window)
        result["view_entries"] = view.state.index.entry_count() if view.state is not None else 0
        result["view_snapshots"] = view.counters.snapshots  # more than 1: it fell behind the feed's window
        result["view_lag_ms_end"] = round(view.lag_s * 1000, 1)  # how old the newest change was when it arrived
    await client.close()
    await other_router.close()
    return {
        **result,
        "prompt_tokens": len(tokenizer.encode_chat(chat_messages(system_text, 0))),
        "workers": workers,
        "iterations": iterations,
        "inflight_elsewhere": inflight_requests,
        "fail_open": fail_open,
        **sizes,
    }


def _view_applied(view: FleetView | None) -> int:
    """Block keys the view's state applied (stored + removed; a snapshot starts a new state)."""
    if view is None or view.state is None:
        return 0
    counters = view.state.applier.counters
    return counters.stored_keys + counters.removed_keys


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


def measure_echo_floor(request_bytes: int, reply_bytes: int, iterations: int, core: int | None, workdir: Path) -> float:
    """p50 ms of a bare gRPC stream round trip to a `kvroute.tools.bench.grpc_echo` process (on `core` if given)."""
    return round(percentile(echo_round_trips_ms(request_bytes, reply_bytes, iterations, core, workdir), 50), 3)


def echo_round_trips_ms(request_bytes: int, reply_bytes: int, iterations: int, core: int | None, workdir: Path) -> list[float]:
    """Bare gRPC stream round trips (ms) to a `kvroute.tools.bench.grpc_echo` process (on `core` if given)."""
    return aio.run_value(echo_round_trips(request_bytes, reply_bytes, iterations, core, workdir))


async def echo_round_trips(request_bytes: int, reply_bytes: int, iterations: int, core: int | None, workdir: Path) -> list[float]:
    """`echo_round_trips_ms` on the running event loop (grpc.aio keeps to the first loop a process runs)."""
    port = free_port()
    server = ManagedProcess(
        "grpc-echo",
        [sys.executable, "-m", "kvroute.tools.bench.grpc_echo", "--port", str(port), "--reply-bytes", str(reply_bytes)],
        workdir / "grpc-echo.log",
    )
    server.start()
    try:
        if core is not None:
            os.sched_setaffinity(server.popen.pid, {core})
        return await round_trips_ms(f"127.0.0.1:{port}", request_bytes, iterations)
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


def run_decision(
    prompt_tokens: int = 8192,
    workers: int = 64,
    block_size: int = 16,
    iterations: int = 300,
    other_blocks: int | None = None,
    seed: int = 0,
    pin_cores: bool = False,
    max_index_entries: int = 0,
    index: str = "local",
    follow_rate: float = 0.0,
    interval_ms: float | None = None,
    max_seconds: float = 300.0,
) -> dict:
    """`other_blocks` per worker: 16,384 under `follow_rate` (>= 1M entries with 64 workers), else 2000.
    `interval_ms` between decisions: 2 under `follow_rate`, else 0 (back to back)."""
    if index not in ("local", "remote"):
        raise ValueError(f"index must be local or remote, got {index!r}")
    if other_blocks is None:
        other_blocks = 16_384 if follow_rate else 2000
    if interval_ms is None:
        interval_ms = 2.0 if follow_rate else 0.0
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / MODEL), heartbeat_timeout_s=3600)
    agents: ChildProcess | None = None
    try:
        # Claims of the other router's in-flight requests stay for the whole run (no engine confirms them).
        metrics_port = free_port()
        bound = ("--max-index-entries", str(max_index_entries)) if max_index_entries else ()
        address = cluster.start_control_plane(
            extra_args=("--speculative-ttl-ms", "3600000", "--metrics-port", str(metrics_port), *bound)
        )
        control_plane_core = pin_apart(cluster.control_plane.popen.pid) if pin_cores else None
        tokenizer = load_tokenizer(cluster.tokenizer_dir)
        uncached = load_tokenizer(cluster.tokenizer_dir, cache_tokens=0)  # what a never-seen prompt costs
        system_text = prompt_text(uncached, prompt_tokens - 24, seed)
        prefix = prompt_block_keys(uncached.encode_chat(chat_messages(system_text, 0)), block_size, MODEL)
        (workdir / "prefix.json").write_text(json.dumps([prefix]))
        agents = start_agents(
            workdir,
            "agents",
            address,
            "--workers",
            str(workers),
            "--worker-prefix",
            "w",
            "--model",
            MODEL,
            "--block-size",
            str(block_size),
            "--prefix-file",
            str(workdir / "prefix.json"),
            "--snapshot-keys",
            str(other_blocks),
            "--seed",
            str(seed),
            "--rate",
            str(follow_rate),
            "--batch-keys",
            str(FOLLOW_BATCH_KEYS),
            "--hold-keys",
            str(other_blocks),
            "--heartbeat-s",
            "5",
            "--wait-signal",
            taskset=str(control_plane_core) if control_plane_core is not None else "",
        )
        filled = agents.wait_ready(300)
        started_agents = agents
        result = aio.run_value(
            measure(
                address,
                tokenizer,
                uncached,
                system_text,
                workers,
                block_size,
                iterations,
                seed,
                index,
                f"http://127.0.0.1:{metrics_port}/metrics",
                (lambda: started_agents.signal(signal.SIGUSR1)) if follow_rate else None,
                interval_ms / 1000,
                max_seconds,
            )
        )
        result["control_plane_answer_mean_ms"] = control_plane_answer_mean_ms(f"http://127.0.0.1:{metrics_port}/metrics")
        feed = agents.finish()
        agents = None
        result["agents_events_per_s"] = feed["events_per_s"] if follow_rate else 0
        result["index_entries_at_start"] = filled["entries"]
    finally:
        if agents is not None:
            agents.process.stop()
        cluster.stop()
    out = {
        **result,
        "index": index,
        "follow_rate": follow_rate,
        "interval_ms": interval_ms,
        "pinned_cores": control_plane_core is not None,
        "max_index_entries": max_index_entries,
    }
    if index == "remote":  # after the control plane has stopped, in its place (its core when pinned)
        out["grpc_echo_p50_ms"] = measure_echo_floor(
            result["query_bytes"], result["answer_bytes"], iterations, control_plane_core, workdir
        )
    return out
