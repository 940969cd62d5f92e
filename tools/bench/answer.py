"""The control plane's answer to one router query, in-process: the same fleet and prompt as
`kvroute bench decision` (64 workers holding random-length prefixes of an 8k-token prompt plus
unrelated blocks, another router's 128 requests in flight with their claims), timed around
`ControlPlaneService.answer` with the message parsed and the reply serialized as the serving
path does.

It is timed three ways, because the serving process measures about twice the back-to-back figure:
`back_to_back_p50_us` (a warm core and warm caches), `after_pause_p50_us` (the core idle for
`pause_ms` before each answer, as between one router's queries) and `after_traffic_p50_us` (4 MB of
other memory written before each answer, the core kept busy). When the pause costs what the
traffic does not, the serving figure is the core waking from idle, not the code.

The walk itself is timed apart too (`match_tiers_*`: the index's `match_tiers` on the prompt's keys as
the service hands them over, a protobuf repeated field; `match_tiers_list_*`: a list of ints;
`match_columns_*`: the native index's columnar walk, which returns the per-worker lists the answer is
built from), in wall time and, as `*_cpu_*`, in this thread's CPU time (what a walk costs a core when
other processes share it). `skewed_match_tiers_cpu_*` walks the same prompt over another fleet, where a
few workers hold most of it (`skewed_index`). `index_backend` picks the index (`kvroute control-plane --index-backend`).

With `max_index_entries` the index is the bounded one (`kvroute control-plane
--max-index-entries`) whose bound the fleet stays under: the walk then also marks what it matched.
A prompt already marked this lap costs one lookup (the back-to-back figures); `unmarked_*` times
the answer with the marks cleared before each one, the most marking a walk can cost (the whole
matched prefix, as for a prefix first asked for in this lap).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry

from kvroute.control_plane.metrics import ControlPlaneMetrics
from kvroute.control_plane.service import ControlPlaneService
from kvroute.data_plane.cp_link.control_plane_client import query_message
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import PrefixIndex, is_bounded, make_index, resolve_backend
from kvroute.tools.stats import percentile
from kvroute.v1 import kvroute_pb2 as pb

MODEL = "bench-model"


class Built(NamedTuple):
    answer: Callable[[], bytes]  # one answer, from query bytes to reply bytes
    query_bytes: int
    index: PrefixIndex


def build(
    workers: int,
    prompt_blocks: int,
    other_blocks: int,
    inflight_requests: int,
    block_size: int,
    seed: int,
    max_index_entries: int = 0,
    index_backend: str = "auto",
) -> Built:
    return _build(workers, prompt_blocks, other_blocks, inflight_requests, block_size, seed, max_index_entries, index_backend)[0]


def _build(
    workers: int,
    prompt_blocks: int,
    other_blocks: int,
    inflight_requests: int,
    block_size: int,
    seed: int,
    max_index_entries: int,
    index_backend: str,
) -> tuple[Built, list[int], list[int]]:
    """The fleet, and the prompt's keys and the workers' slots (for timing the walk alone)."""
    rng = random.Random(seed)
    index = make_index(index_backend, max_index_entries)
    state = FleetState.build(index, heartbeat_timeout_s=3600.0, speculative_ttl_s=3600.0, reservation_max_age_s=3600.0)
    inflight, registry = state.inflight, state.registry
    service = ControlPlaneService(state, ControlPlaneMetrics(CollectorRegistry()))
    prompt = [rng.getrandbits(64) for _ in range(prompt_blocks)]
    slots = []
    for w in range(workers):
        record = registry.register(f"w{w}", MODEL, "sim", block_size, f"http://127.0.0.1:{20000 + w}")
        slots.append(record.slot)
        index.store(record.slot, prompt[: rng.randrange(prompt_blocks + 1)] + [rng.getrandbits(64) for _ in range(other_blocks)])
    other = inflight.open_session("other-router")
    tail = 256 // block_size
    for i in range(inflight_requests):
        inflight.reserve(
            other, i + 1, rng.randrange(workers), [rng.getrandbits(64) for _ in range(tail)], 256, 0, 8192, block_size
        )
    asking = inflight.open_session("this-router").router
    message = query_message(MODEL, {block_size: prompt})
    message.query.query_id = 1
    data = message.SerializeToString()

    def answer() -> bytes:
        received = pb.RouterMessage.FromString(data)
        reply = pb.RouterReply()
        reply.result.SetInParent()
        service.answer(received.query, reply.result, asking=asking)
        return reply.SerializeToString()

    return Built(answer, len(data), index), prompt, slots


def skewed_index(backend: str, workers: int, prompt_blocks: int, other_blocks: int, seed: int) -> tuple[PrefixIndex, list[int]]:
    """A fleet where a few workers hold most of the prompt: 4 hold 90-100% of it, the rest under 10%
    (each also `other_blocks` unrelated blocks); its index and the prompt."""
    rng = random.Random(seed)
    index = make_index(backend)
    prompt = [rng.getrandbits(64) for _ in range(prompt_blocks)]
    for w in range(workers):
        held = rng.randrange(prompt_blocks * 9 // 10, prompt_blocks + 1) if w < 4 else rng.randrange(prompt_blocks // 10)
        index.store(w, prompt[:held] + [rng.getrandbits(64) for _ in range(other_blocks)])
    return index, prompt


def _timed(
    answer: Callable[[], object],
    iterations: int,
    before: Callable[[], None],
    name: str,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    samples = []
    for _ in range(iterations):
        before()
        t0 = clock()
        answer()
        samples.append((clock() - t0) * 1e6)
    return {f"{name}_p50_us": round(percentile(samples, 50), 1), f"{name}_p99_us": round(percentile(samples, 99), 1)}


def run_answer(
    workers: int = 64,
    prompt_tokens: int = 8192,
    block_size: int = 16,
    other_blocks: int = 2000,
    inflight_requests: int = 128,
    iterations: int = 2000,
    pause_ms: float = 1.0,
    seed: int = 0,
    max_index_entries: int = 0,
    index_backend: str = "auto",
) -> dict:
    backend = resolve_backend(index_backend)
    (answer, query_bytes, index), prompt, slots = _build(
        workers, prompt_tokens // block_size, other_blocks, inflight_requests, block_size, seed, max_index_entries, backend
    )
    if max_index_entries and index.entry_count() >= max_index_entries:
        raise ValueError(
            f"--max-index-entries {max_index_entries} must exceed the fleet's {index.entry_count()} "
            "entries: this bench times walks, not evictions"
        )
    for _ in range(50):
        answer()
    traffic = bytearray(4 << 20)
    stride = b"\x01" * len(traffic[::64])

    def write_traffic() -> None:
        traffic[::64] = stride  # one write per cache line

    result = {
        **_timed(answer, iterations, lambda: None, "back_to_back"),
        **_timed(answer, iterations, lambda: time.sleep(pause_ms / 1000), "after_pause"),
        **_timed(answer, iterations, write_traffic, "after_traffic"),
    }
    wire = query_message(MODEL, {block_size: prompt}).query.chains[0].block_keys  # as the service reads them
    walks = {"match_tiers": lambda: index.match_tiers(wire), "match_tiers_list": lambda: index.match_tiers(prompt)}
    if hasattr(index, "match_columns"):
        walks["match_columns"] = lambda: index.match_columns(wire, slots)
    for name, walk in walks.items():
        result.update(_timed(walk, iterations, lambda: None, name))
        # this thread's CPU time: what the walk costs a core, without the time other processes took it away
        result.update(_timed(walk, iterations, lambda: None, f"{name}_cpu", time.thread_time))
    skewed, skewed_prompt = skewed_index(backend, workers, prompt_tokens // block_size, other_blocks, seed)
    result.update(
        _timed(lambda: skewed.match_tiers(skewed_prompt), iterations, lambda: None, "skewed_match_tiers_cpu", time.thread_time)
    )
    if is_bounded(index):

        def unmark() -> None:  # a new lap, twice: nothing is marked (private: only a bench wants this)
            index._new_lap()
            index._new_lap()

        result.update(_timed(answer, iterations, unmark, "unmarked"))
    return {
        **result,
        "index_backend": backend,
        "pause_ms": pause_ms,
        "workers": workers,
        "prompt_tokens": prompt_tokens,
        "query_bytes": query_bytes,
        "inflight_elsewhere": inflight_requests,
        "iterations": iterations,
        "max_index_entries": max_index_entries,
        "index_entries": index.entry_count(),
    }
