"""Event decode -> key resolution -> index update, the agent + control-plane hot path, in-process; then
the index alone: block events applied per second as the control plane and routers feed it, and its
memory per (key, worker, tier) entry.

    run_ingest(index_backend="native")   # kvroute bench ingest --index-backend native --json

- `block_events_per_s`: real vLLM map-era payloads (msgpack bytes as a vLLM 0.33 publisher writes
  them) through the agent's decoder and resolver into the index: the whole pipeline, decoding included.
- `apply_events_per_s`: the index alone, per form of its input (`packed`: little-endian u64 bytes as
  the log's msgpack batches and snapshots carry them, `pb`: a protobuf repeated fixed64 field as the
  control plane receives an agent's EventBatch, `list`: ints, as `unpack_keys` gives them): stores of
  `blocks_per_event` keys, each followed by a removal of two, over `workers` slots; per second of
  this process's CPU time (`apply_events_per_s`: one core's throughput on a shared machine) and of
  wall time (`apply_events_per_wall_s`). The bitmask index iterates ints: its `packed` input is an
  array('Q') over the words (no list), since it cannot read bytes.
- `bytes_per_block_entry` (tracemalloc) and `estimated_bytes_per_entry` (the index's own figure) for a
  fresh index of `memory_entries` entries built from packed keys (as the control plane's protobuf
  batches deliver them, so every entry's int objects are counted for the Python index), some keys on
  every worker; `rss_bytes_per_entry`: the same build in a fresh interpreter, its resident set before
  and after (includes the allocator's slack and the key objects a Python index keeps; 0 when not
  measured).

With `max_index_entries` both are the bounded index (`kvroute control-plane --max-index-entries`):
the ingest then runs past the bound (evicting as it stores) when the bound is below what the
batches leave, and the memory figure is per entry of a bounded index below its bound, its own
bookkeeping included (cut down to a bound all at once, CPython's dicts and sets would keep their
tables' size and say little about an index that only ever grew to its bound).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import tracemalloc
from array import array

import msgspec

from kvroute.fleet.entries import pack_keys
from kvroute.prefix_index import is_bounded, make_index, resolve_backend
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_deltas import KeysRemoved, KeysStored
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.vllm_wire import decode_payload


def make_payloads(n_batches: int, blocks_per_event: int, block_size: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    payloads, next_hash = [], 1
    for _ in range(n_batches):
        tokens = [rng.randrange(50_000) for _ in range(blocks_per_event * block_size)]
        hashes = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        removal = {"type": "BlockRemoved", "block_hashes": hashes[:2], "medium": "GPU", "group_idx": 0}
        payloads.append(msgspec.msgpack.encode([time.time(), [event, removal], 0]))
    return payloads


def _repeated(keys: list[int]):
    event = pb.BlocksStored()
    event.block_keys.extend(keys)
    return event.block_keys


def packed(backend: str):
    """Keys packed as the log carries them, in the form the backend takes: bytes for the native index;
    for the bitmask index (which iterates ints) the same words as an array('Q') over them, no list."""
    return pack_keys if backend == "native" else (lambda keys: array("Q", keys))


def apply_rates(
    backend: str, n_batches: int, blocks_per_event: int, workers: int, seed: int, max_index_entries: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Block events per second the index applies (stores and removals), per input form: per second of
    this process's CPU time (one core's throughput, whatever else the machine runs) and of wall time."""
    rng = random.Random(seed)
    chains = [[rng.getrandbits(64) for _ in range(blocks_per_event)] for _ in range(n_batches)]
    cpu, wall = {}, {}
    for name, form in (("packed", packed(backend)), ("pb", _repeated), ("list", list)):
        batches = [(i % workers, form(chain), form(chain[:2])) for i, chain in enumerate(chains)]
        index = make_index(backend, max_index_entries)
        store, remove = index.store, index.remove
        events = 0
        started, started_cpu = time.perf_counter(), time.process_time()
        for slot, stored, removed in batches:
            events += store(slot, stored)
            events += remove(slot, removed)
        cpu[name] = round(events / max(time.process_time() - started_cpu, 1e-9))
        wall[name] = round(events / (time.perf_counter() - started))
    return cpu, wall


def build_for_memory(backend: str, entries: int, workers: int, seed: int, max_index_entries: int):
    """An index of `entries` entries from packed keys (array('Q'), made from random bytes: no int object
    is made or freed before the build, so a fresh interpreter's RSS delta is the build's); 1/80 of the
    keys on every worker."""
    shared = entries // 80
    words = array("Q")
    words.frombytes(random.Random(seed).randbytes(8 * (entries - (workers - 1) * shared)))
    per_worker = [words[w::workers] + words[:shared] for w in range(workers)]
    index = make_index(backend, max_index_entries and 1 << 40)

    def build():
        for w in range(workers):
            index.store(w, per_worker[w])
        index.match(words[:1000].tolist())  # with a bound, walks mark what they matched: count that too
        return index

    return build


def rss_per_entry(backend: str, entries: int, workers: int, seed: int, max_index_entries: int) -> float:
    """The build in a fresh interpreter: resident set after minus before, per entry (0: no /proc here)."""
    code = (
        "import json, sys; from kvroute.tools.bench.ingest import build_for_memory; from kvroute.tools.procfs import rss_bytes; "
        f"build = build_for_memory({backend!r}, {entries}, {workers}, {seed}, {max_index_entries}); "
        "before = rss_bytes(); index = build(); "
        "print(json.dumps((rss_bytes() - before) / index.entry_count()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    if out.returncode:
        raise RuntimeError(f"the RSS build failed: {out.stderr.strip()[-2000:]}")
    return round(json.loads(out.stdout), 1)


def run_ingest(
    n_batches: int = 4000,
    blocks_per_event: int = 16,
    block_size: int = 16,
    workers: int = 8,
    seed: int = 0,
    max_index_entries: int = 0,
    index_backend: str = "auto",
    memory_entries: int = 1_000_000,
    rss: bool = True,
) -> dict:
    backend = resolve_backend(index_backend)
    payloads = make_payloads(n_batches, blocks_per_event, block_size, seed)
    resolvers = [BlockResolver("bench-model") for _ in range(workers)]
    index = make_index(backend, max_index_entries)
    block_events = 0
    started = time.perf_counter()
    for i, payload in enumerate(payloads):
        worker = i % workers
        batch = decode_payload(i, payload)
        for delta in resolvers[worker].apply(batch.events):
            if type(delta) is KeysStored:
                block_events += index.store(worker, delta.keys)
            elif type(delta) is KeysRemoved:
                block_events += index.remove(worker, delta.keys)
    elapsed = time.perf_counter() - started
    rates, rates_wall = apply_rates(backend, n_batches, blocks_per_event, workers, seed, max_index_entries)

    build = build_for_memory(backend, memory_entries, workers, seed, max_index_entries)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    mem_index = build()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    entries = mem_index.entry_count()
    allocated = sum(s.size_diff for s in after.compare_to(before, "filename"))
    evicted = index.counters.entries if is_bounded(index) else 0
    return {
        "index_backend": backend,
        "block_events_per_s": round(block_events / elapsed),
        "apply_events_per_s": rates,
        "apply_events_per_wall_s": rates_wall,
        "bytes_per_block_entry": round(allocated / entries, 1),
        "estimated_bytes_per_entry": round(mem_index.estimated_bytes() / entries, 1),
        "rss_bytes_per_entry": rss_per_entry(backend, memory_entries, workers, seed, max_index_entries) if rss else 0.0,
        "block_events": block_events,
        "seconds": round(elapsed, 3),
        "index_entries_measured": entries,
        "max_index_entries": max_index_entries,
        "index_entries": index.entry_count(),
        "evicted_entries": evicted,
    }
