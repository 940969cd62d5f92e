"""Event decode -> key resolution -> index update, the agent + control-plane hot path, in-process.

Feeds real vLLM map-era payloads (msgpack bytes as a vLLM 0.33 publisher writes them) through the
agent's decoder and resolver into the control plane's BitmaskPrefixIndex, and measures block events
per second and the index's memory per (key, worker) entry. The memory index is fed packed keys, as
the control plane's protobuf batches are, so every entry's int object is counted (an earlier
version fed it ready-made ints and so left them out: 116 bytes per entry instead of ~150).

With `max_index_entries` both are the bounded index (`kvroute control-plane --max-index-entries`):
the ingest then runs past the bound (evicting as it stores) when the bound is below what the
batches leave, and the memory figure is per entry of a bounded index below its bound, its own
bookkeeping included (cut down to a bound all at once, CPython's dicts and sets would keep their
tables' size and say little about an index that only ever grew to its bound).
"""

from __future__ import annotations

import random
import time
import tracemalloc
from array import array

import msgspec

from kvroute.prefix_index import BitmaskPrefixIndex, BoundedPrefixIndex
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
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                 "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                 "kv_cache_spec_kind": "full_attention"}
        removal = {"type": "BlockRemoved", "block_hashes": hashes[:2], "medium": "GPU", "group_idx": 0}
        payloads.append(msgspec.msgpack.encode([time.time(), [event, removal], 0]))
    return payloads


def run_ingest(n_batches: int = 4000, blocks_per_event: int = 16, block_size: int = 16, workers: int = 8,
               seed: int = 0, max_index_entries: int = 0) -> dict:
    payloads = make_payloads(n_batches, blocks_per_event, block_size, seed)
    resolvers = [BlockResolver("bench-model") for _ in range(workers)]

    def new_index(bound: int) -> BitmaskPrefixIndex:
        return BoundedPrefixIndex(bound) if bound else BitmaskPrefixIndex()

    index = new_index(max_index_entries)
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

    # Memory per entry: build a fresh index of known size under tracemalloc, from packed keys (as the
    # control plane's protobuf batches deliver them: each store makes its own int objects).
    keys = random.Random(seed).sample(range(1, 2**63), 200_000)
    packed = [array("Q", keys[w::workers] + keys[:5000]) for w in range(workers)]  # some keys shared by all
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    mem_index = new_index(max_index_entries and 1 << 40)
    for w in range(workers):
        mem_index.store(w, packed[w])
    mem_index.match(list(packed[0][:1000]))  # with a bound, walks mark what they matched: count that too
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    entries = mem_index.entry_count()
    allocated = sum(s.size_diff for s in after.compare_to(before, "filename"))
    evicted = index.counters.entries if isinstance(index, BoundedPrefixIndex) else 0
    return {"block_events_per_s": round(block_events / elapsed), "bytes_per_block_entry": round(allocated / entries, 1),
            "estimated_bytes_per_entry": round(mem_index.estimated_bytes() / entries, 1),
            "block_events": block_events, "seconds": round(elapsed, 3), "index_entries_measured": entries,
            "max_index_entries": max_index_entries, "index_entries": index.entry_count(), "evicted_entries": evicted}
