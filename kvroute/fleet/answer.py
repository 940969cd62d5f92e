"""The index's answer to a prompt: per live worker of the model, its matched prefix (tiers,
speculative part), engine load and what other routers reserved there, as columns.

    columns = answer_columns(state, "llama", {16: keys}, lora_name="", asking=tally)

One builder for every asker: the control plane's Query / RouterSession answer (written into
`kvroute.v1.WorkerColumns` one C call per column), a router deciding on its own view of the fleet,
and the simulator. `asking` is the asking router's tally in the state's in-flight tracker (its own
reservations are left out: it knows them exactly), or None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvroute.fleet.inflight import RouterTally
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import Tier, TierMatch


@dataclass(slots=True)
class IndexColumns:
    """The answer, index i = worker_id[i] (the fields of `kvroute.v1.WorkerColumns`)."""

    worker_id: list[str] = field(default_factory=list)
    matched_blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    disk_blocks: list[int] = field(default_factory=list)
    speculative_blocks: list[int] = field(default_factory=list)
    reserved_requests: list[int] = field(default_factory=list)
    reserved_prefill_tokens: list[int] = field(default_factory=list)
    running_requests: list[int] = field(default_factory=list)
    waiting_requests: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # blocks each worker holds on the gpu tier in all
    kv_capacity_tokens: list[int] = field(default_factory=list)  # each engine's KV cache size, 0 = unknown
    other_routers: int = 0  # router sessions open at the control plane besides the asking router's


_NO_MATCH = TierMatch()


def answer_columns(
    state: FleetState, model: str, chains: Mapping[int, Sequence[int]], lora_name: str = "", asking: RouterTally | None = None
) -> IndexColumns:
    """Every live worker of `model` (serving `lora_name` if given), matched against the chain of its
    own block size in `chains` (block size -> keys); a column that is all zeros (no tiers, nothing
    reserved: the common case) is one shared list, not computed."""
    inflight = state.inflight
    inflight.expire()
    index = state.index
    records = state.registry.workers(model, lora_name)
    matches = {bs: index.match_tiers(keys) for bs, keys in chains.items()}
    slots = [r.slot for r in records]
    zeros = [0] * len(records)
    present = matches.values()
    single = next(iter(present)) if len(matches) == 1 else None
    if single is None or not all(r.block_size in matches for r in records):
        single = None
        per_worker = [matches.get(r.block_size, _NO_MATCH) for r in records]

    def column(name: str) -> list[int]:
        if not any(getattr(m, name) for m in present):
            return zeros
        if single is not None:  # one block size in the fleet: one dict, looked up in one C loop
            return list(map(getattr(single, name).get, slots, zeros))
        return [getattr(m, name).get(slot, 0) for m, slot in zip(per_worker, slots)]

    out = IndexColumns(
        [r.worker_id for r in records], column("depth"), column("cpu_blocks"), column("disk_blocks"), column("speculative_blocks")
    )
    all_requests, all_prefill = inflight.requests, inflight.prefill_tokens
    if all_requests:
        own_requests = asking.requests if asking is not None else {}
        own_prefill = asking.prefill_tokens if asking is not None else {}
        out.reserved_requests = [all_requests.get(slot, 0) - own_requests.get(slot, 0) for slot in slots]
        out.reserved_prefill_tokens = [all_prefill.get(slot, 0) - own_prefill.get(slot, 0) for slot in slots]
    else:
        out.reserved_requests = out.reserved_prefill_tokens = zeros
    loads = [r.load for r in records]
    out.running_requests = [load.running_requests for load in loads]
    out.waiting_requests = [load.waiting_requests for load in loads]
    out.kv_usage = [load.kv_usage for load in loads]
    out.kv_capacity_tokens = [load.kv_capacity_tokens for load in loads]
    out.other_routers = len(inflight.routers) - (1 if asking is not None else 0)
    count = index.worker_block_count
    out.cached_blocks = [count(slot, Tier.GPU) for slot in slots]
    return out
