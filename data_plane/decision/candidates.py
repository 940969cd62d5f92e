"""One builder of routing candidates: what a policy sees of each worker, for the router and the
tools that simulate it (the fleet simulator, the burst bench) alike.

    build_candidates(known, own, chains, prompt_tokens, columns=answer, avoid=cooling_down)

- `known`: the workers the router knows for the model (ListWorkers: endpoint, block size, blocks
  held, last heartbeat's load);
- `own`: this router's own in-flight requests (`RouterInflight`, in the router and in the simulator);
- `chains`: block size -> the prompt's block keys (the speculative match of this router's own
  in-flight prompts is looked up per block size in it);
- `columns`: the index's answer (`kvroute.fleet.answer.IndexColumns` from this router's view or a
  simulation, or `pb.WorkerColumns` from a control plane's Query), one entry per live worker of the
  model; None when the index could not be used (fail open).

With columns: one Candidate per worker of the answer that this router knows, in the answer's
order: cached tokens = the longer of the index's match (any tier, other routers' speculative
holders included) and this router's own in-flight prompts on that worker, x the worker's block
size, capped at the prompt; cpu/disk-tier parts; the answer's engine load; in-flight requests and
pending prefill = this router's own (exact) + other routers' reservations. A worker that joined
since the last ListWorkers is left out until the next one. Known workers no agent reports on
(model "": found by DNS, or static) cannot be in the answer: they follow it as candidates without
an index match, as when failing open (below), provided the answer named some known worker.

Without columns (failing open): every known worker, in the known fleet's order, with no index
and no other routers' reservations, but this router's own in-flight work and the prompts it has in
flight (a burst of one new prefix keeps its affinity within this router even while the control
plane is slow), and the last heartbeat's load.

Workers in `avoid` (backends cooling down after a failure) are left out of `known` first, unless
every known worker is in it; an answer that names only avoided workers then fails open over the rest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from itertools import repeat
from typing import Protocol

from kvroute.data_plane.decision.policies import Candidate


class WorkerLoadView(Protocol):
    running_requests: int
    waiting_requests: int
    kv_usage: float
    kv_capacity_tokens: int


class KnownWorkerView(Protocol):
    """What the builder reads of a known worker (`control_plane_client.KnownWorker`)."""

    worker_id: str
    model: str  # "": no agent reports on it, so the index never names it
    endpoint: str
    block_size: int
    cached_blocks: int
    load: WorkerLoadView
    data_parallel_rank: int | None


class OwnInflight(Protocol):
    """This router's own in-flight requests (`RouterInflight`)."""

    def snapshot(self) -> dict[str, tuple[int, int]]: ...

    def speculative_match(self, block_keys: Sequence[int]) -> dict[str, int]: ...


class IndexColumnsView(Protocol):
    """The index's columnar answer, as the builder reads it (`IndexColumns` or `pb.WorkerColumns`)."""

    worker_id: Sequence[str]
    matched_blocks: Sequence[int]
    cpu_blocks: Sequence[int]
    disk_blocks: Sequence[int]
    reserved_requests: Sequence[int]
    reserved_prefill_tokens: Sequence[int]
    running_requests: Sequence[int]
    waiting_requests: Sequence[int]
    kv_usage: Sequence[float]
    cached_blocks: Sequence[int]  # empty from an older control plane: the known worker's count stands
    kv_capacity_tokens: Sequence[int]  # empty from an older control plane: the known worker's load stands


_NOTHING_OWN = (0, 0)


def build_candidates(
    known: Sequence[KnownWorkerView],
    own: OwnInflight,
    chains: Mapping[int, Sequence[int]],
    prompt_tokens: int,
    columns: IndexColumnsView | None = None,
    avoid: Collection[str] = frozenset(),
) -> list[Candidate]:
    """The candidates of one decision (see the module docstring); [] when the answer names no known worker."""
    if avoid:
        known = [w for w in known if w.worker_id not in avoid] or known
    mine = own.snapshot()
    speculative = {bs: own.speculative_match(chain) for bs, chain in chains.items()} if mine else {}
    if columns is None:
        return _from_known(known, mine, speculative, prompt_tokens)
    return _from_columns(columns, known, mine, speculative, prompt_tokens)


def _from_columns(
    columns: IndexColumnsView,
    known: Sequence[KnownWorkerView],
    mine: dict[str, tuple[int, int]],
    speculative: dict[int, dict[str, int]],
    prompt_tokens: int,
) -> list[Candidate]:
    # Every column is read in one C call (zip over the repeated fields): this runs for every worker
    # on every decision.
    by_id = {w.worker_id: w for w in known}
    out = []
    held = columns.cached_blocks
    capacity = columns.kv_capacity_tokens
    claims = columns.speculative_blocks or repeat(0)  # an answer may leave it out: nothing claimed
    for i, (wid, matched, cpu, disk, claimed, reserved, prefill, running, waiting, usage) in enumerate(
        zip(
            columns.worker_id,
            columns.matched_blocks,
            columns.cpu_blocks,
            columns.disk_blocks,
            claims,
            columns.reserved_requests,
            columns.reserved_prefill_tokens,
            columns.running_requests,
            columns.waiting_requests,
            columns.kv_usage,
        )
    ):
        w = by_id.get(wid)
        if w is None:
            continue
        bs = w.block_size
        own_requests, own_pending = mine.get(wid, _NOTHING_OWN) if mine else _NOTHING_OWN
        confirmed = matched - claimed  # a claim continues a chain the events confirmed: it is the tail
        if own_requests and bs in speculative:
            matched = max(matched, speculative[bs].get(wid, 0))
        # Conditionals, not min(): this runs per worker per decision and tiers are mostly empty.
        cached = matched * bs
        in_flight = (matched - confirmed) * bs
        out.append(
            Candidate(
                wid,
                w.endpoint,
                bs,
                cached if cached < prompt_tokens else prompt_tokens,
                min(cpu * bs, prompt_tokens) if cpu else 0,
                min(disk * bs, prompt_tokens) if disk else 0,
                running,
                waiting,
                usage,
                own_requests + reserved,
                own_pending + prefill,
                held[i] if held else w.cached_blocks,
                in_flight if in_flight < prompt_tokens else prompt_tokens,
                capacity[i] if capacity else w.load.kv_capacity_tokens,
            )
        )
    if out and len(out) < len(by_id):  # some known worker is not in the answer: one no agent reports on?
        answered = set(columns.worker_id)
        unreported = [w for w in known if not w.model and w.worker_id not in answered]
        if unreported:
            out += _from_known(unreported, mine, speculative, prompt_tokens)
    return out


def _from_known(
    known: Sequence[KnownWorkerView], mine: dict[str, tuple[int, int]], speculative: dict[int, dict[str, int]], prompt_tokens: int
) -> list[Candidate]:
    out = []
    for w in known:
        own_requests, own_pending = mine.get(w.worker_id, _NOTHING_OWN)
        blocks = speculative[w.block_size].get(w.worker_id, 0) if w.block_size in speculative else 0
        in_flight = min(blocks * w.block_size, prompt_tokens)  # without the index all of it is this router's own
        out.append(
            Candidate(
                w.worker_id,
                w.endpoint,
                w.block_size,
                in_flight,
                0,
                0,
                w.load.running_requests,
                w.load.waiting_requests,
                w.load.kv_usage,
                own_requests,
                own_pending,
                w.cached_blocks,
                in_flight,
                w.load.kv_capacity_tokens,
            )
        )
    return out
