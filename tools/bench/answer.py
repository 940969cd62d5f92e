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

With `max_index_entries` the index is a BoundedPrefixIndex (`kvroute control-plane
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

from kvroute.control_plane.service import ControlPlaneMetrics, ControlPlaneService
from kvroute.data_plane.control_plane_client import query_message
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import BitmaskPrefixIndex, BoundedPrefixIndex
from kvroute.tools.stats import percentile
from kvroute.v1 import kvroute_pb2 as pb

MODEL = "bench-model"


class Built(NamedTuple):
    answer: Callable[[], bytes]  # one answer, from query bytes to reply bytes
    query_bytes: int
    index: BitmaskPrefixIndex


def build(workers: int, prompt_blocks: int, other_blocks: int, inflight_requests: int, block_size: int,
          seed: int, max_index_entries: int = 0) -> Built:
    rng = random.Random(seed)
    index = BoundedPrefixIndex(max_index_entries) if max_index_entries else BitmaskPrefixIndex()
    state = FleetState.build(index, heartbeat_timeout_s=3600.0, speculative_ttl_s=3600.0, reservation_max_age_s=3600.0)
    inflight, registry = state.inflight, state.registry
    service = ControlPlaneService(state, ControlPlaneMetrics(CollectorRegistry()))
    prompt = [rng.getrandbits(64) for _ in range(prompt_blocks)]
    for w in range(workers):
        record = registry.register(f"w{w}", MODEL, "sim", block_size, f"http://127.0.0.1:{20000 + w}")
        index.store(record.slot, prompt[: rng.randrange(prompt_blocks + 1)]
                    + [rng.getrandbits(64) for _ in range(other_blocks)])
    other = inflight.open_session("other-router")
    tail = 256 // block_size
    for i in range(inflight_requests):
        inflight.reserve(other, i + 1, rng.randrange(workers), [rng.getrandbits(64) for _ in range(tail)],
                         256, 0, 8192, block_size)
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

    return Built(answer, len(data), index)


def _timed(answer: Callable[[], bytes], iterations: int, before: Callable[[], None], name: str) -> dict[str, float]:
    samples = []
    for _ in range(iterations):
        before()
        t0 = time.perf_counter()
        answer()
        samples.append((time.perf_counter() - t0) * 1e6)
    return {f"{name}_p50_us": round(percentile(samples, 50), 1), f"{name}_p99_us": round(percentile(samples, 99), 1)}


def run_answer(workers: int = 64, prompt_tokens: int = 8192, block_size: int = 16, other_blocks: int = 2000,
               inflight_requests: int = 128, iterations: int = 2000, pause_ms: float = 1.0, seed: int = 0,
               max_index_entries: int = 0) -> dict:
    answer, query_bytes, index = build(workers, prompt_tokens // block_size, other_blocks, inflight_requests,
                                       block_size, seed, max_index_entries)
    if max_index_entries and index.entry_count() >= max_index_entries:
        raise ValueError(f"--max-index-entries {max_index_entries} must exceed the fleet's {index.entry_count()} "
                         "entries: this bench times walks, not evictions")
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
    if isinstance(index, BoundedPrefixIndex):
        def unmark() -> None:  # a new lap, twice: nothing is marked (private: only a bench wants this)
            index._new_lap()
            index._new_lap()

        result.update(_timed(answer, iterations, unmark, "unmarked"))
    return {**result, "pause_ms": pause_ms, "workers": workers, "prompt_tokens": prompt_tokens,
            "query_bytes": query_bytes, "inflight_elsewhere": inflight_requests, "iterations": iterations,
            "max_index_entries": max_index_entries, "index_entries": index.entry_count()}
