"""Discrete-event simulation of a fleet behind one router.

Real code: the routing policies (kvroute.data_plane.decision.policies), the router's candidate builder
(kvroute.data_plane.decision.candidates), the router's in-flight tracking (kvroute.data_plane.cp_link.inflight),
the agent's engine-hash -> block-key resolution (kvroute.worker_agent.block_resolver) and the
control plane's index (kvroute.prefix_index).
Simulated: each engine (sim_engine's PrefixCache + Scheduler + CostModel) and the clock.
KV events reach the index when the engine step that produced them ends, plus `event_delay_s`.

P/D pools (`FleetConfig.prefill_workers` > 0, as a `kvroute router --pd` fleet): the first N workers
take prefill legs (the policy chooses among them; the leg computes the prompt and one token), the
rest decode legs (fewest requests, `least_loaded`, as the router does); a finished prefill leg's
blocks reach the decode worker after `transfer_s_per_block` each, and the decode leg generates
without computing its prompt. TTFT and e2e run from arrival to the decode leg's first and last
token; the hit rate is the prefill pool's.

`ttft_oracle` (simulator only, not a router policy) is a reference: it reads every engine's exact
state (the rest of the running step, the queue, the cache, free KV blocks) and sends each request
where its own TTFT would be lowest if nothing else arrived. It answers "would a router that knew
everything do better, one request at a time?"; it is not a bound on what a policy can reach, since
it never invests in placement for the requests that follow.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.cp_link.control_plane_client import KnownWorker
from kvroute.data_plane.cp_link.inflight import InflightTicket, RouterInflight
from kvroute.data_plane.decision.decide import decide
from kvroute.data_plane.decision.policies import RoutingInput, make_policy
from kvroute.fleet.answer import answer_columns
from kvroute.fleet.changes import ChangeEncoder, apply_change
from kvroute.fleet.entries import BlockOp, HeartbeatBody, Op, RegisterBody
from kvroute.fleet.inflight import Reservation
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import Tier, make_index
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.prefix_cache import ClearedEvent, PrefixCache, RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.scheduler import Scheduler, SimRequest
from kvroute.tools.simulator.workloads import SimWorkloadRequest
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_deltas import KeysRemoved, KeysStored
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "sim-model"
TTFT_ORACLE = "ttft_oracle"


@dataclass
class FleetConfig:
    workers: int = 8
    num_blocks: int = 8192
    block_size: int = 16
    cost: CostModel = field(default_factory=CostModel)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    event_delay_s: float = 0.0
    seed: int = 0
    kv_aware_params: dict = field(default_factory=dict)  # KvAwareParams fields (kv_aware runs only)
    routers: int = 1  # routers deciding in turn, each on its own view of the fleet
    view_delay_s: float = 0.0  # how late each change of the control plane's state reaches a router's view
    index_backend: str = "auto"  # the prefix index's (kvroute.prefix_index.make_index): results are the same on each
    prefill_workers: int = 0  # P/D pools: this many prefill workers, the rest decode (0: every worker does both)
    transfer_s_per_block: float = 0.0001  # P/D: a prefill leg's KV reaches its decode worker after this per block


@dataclass
class PolicyRun:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    query_tokens: int = 0
    busy_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    rejected: int = 0
    # Per routed request, in arrival order: (arrival_s, worker index, hit tokens the engine found,
    # prompt tokens, ttft_s); filled only with simulate_policy(..., detail=True).
    requests: list[tuple[float, int, int, int, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _Worker:
    def __init__(self, i: int, config: FleetConfig) -> None:
        self.worker_id = f"w{i}"
        self.slot = i
        self.cache = PrefixCache(config.num_blocks, config.block_size, hash_seed=f"sim-{config.seed}-{i}")
        self.scheduler = Scheduler(
            self.cache,
            config.cost,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            vocab_size=50_000,
            seed=config.seed * 1000 + i,
        )
        self.resolver = BlockResolver(MODEL)
        self.busy = False
        self.busy_s = 0.0
        self.step_end = 0.0  # when the running step (or decode stretch) ends, while busy


class _SimRouter:
    """One router: its own in-flight tracking and policy, and the state it decides on (the control
    plane's own with one router and no delay, else its view, fed by the change log `view_delay_s` late)."""

    def __init__(self, number: int, policy, known: list[KnownWorker], state: FleetState, view: bool) -> None:
        self.router_id = f"router-{number}"
        self.policy = policy
        self.known = known
        self.own = RouterInflight()
        self.state = state
        self.view = view
        self.applied = 0  # changes of the log applied to the view
        self.session = None  # its session at the control plane (several routers)

    def catch_up(self, log: list[tuple[float, pb.FleetChange]], until: float) -> None:
        """Apply the control plane's changes made at or before `until` to this router's view."""
        if not self.view:
            return
        i, state = self.applied, self.state
        while i < len(log) and log[i][0] <= until:
            apply_change(state, log[i][1])
            i += 1
        self.applied = i


class _ControlPlane:
    """The control plane's state; with views, every change it applies is logged with its time."""

    def __init__(self, workers: list[_Worker], views: bool, block_size: int, index_backend: str) -> None:
        self.state = FleetState.build(make_index(index_backend), heartbeat_timeout_s=float("inf"), reservation_max_age_s=1e12)
        self.log: list[tuple[float, pb.FleetChange]] = []
        self.now = 0.0
        if views:
            encoder = ChangeEncoder(self.state, "control-plane", lambda change, model: self.log.append((self.now, change)))
            self.state.applier.listener = self.state.inflight.listener = encoder
        self.records = [
            self.state.applier.register(
                w.worker_id, RegisterBody(MODEL, "sim", block_size, "", "", [], None, "", ""), resume=False
            )
            for w in workers
        ]
        self._seq = [0] * len(workers)

    def apply_events(self, w: _Worker, wire: list, now: float) -> None:
        self.now = now
        ops = []
        for delta in w.resolver.apply(wire):
            if type(delta) is KeysStored:
                ops.append(BlockOp(Op.STORED, Tier.GPU, delta.keys))
            elif type(delta) is KeysRemoved:
                ops.append(BlockOp(Op.REMOVED, Tier.GPU, delta.keys))
            else:
                ops.append(BlockOp(Op.CLEARED, Tier.GPU))
        if ops:
            self._seq[w.slot] += 1
            self.state.applier.apply_batch(self.records[w.slot], self._seq[w.slot], False, ops)

    def report_load(self, w: _Worker, now: float) -> None:
        """The worker's queues changed: the control plane hears of it at once."""
        load = self.records[w.slot].load
        running, waiting, usage = len(w.scheduler.running), len(w.scheduler.waiting), w.cache.usage()
        if (load.running_requests, load.waiting_requests, load.kv_usage) != (running, waiting, usage):
            self.now = now
            capacity = w.cache.num_blocks * w.cache.block_size
            self.state.applier.heartbeat(self.records[w.slot], HeartbeatBody(running, waiting, usage, 0, [], capacity))


def true_ttft(
    w: _Worker, prompt: Sequence[int], max_tokens: int, now: float, max_num_batched_tokens: int
) -> tuple[bool, float, int]:
    """(would wait for KV blocks or a sequence slot, TTFT in s, cached tokens) of `prompt` on `w`
    if nothing else arrived: the rest of the running step, then FIFO steps that prefill the queue
    ahead and this prompt's uncached tokens within the token budget, each priced by the engine's
    cost model. Cached means cached now or in a prompt ahead: blocks are cached when their chunk
    is scheduled, and FCFS schedules every prompt ahead in full before it admits the next one.
    Exact (tested) but for requests finishing meanwhile (their decode slots are still counted) and
    blocks that the allocations ahead evict."""
    cache, sched = w.cache, w.scheduler
    bs = cache.block_size
    ahead_blocks: set[int] = set()  # prompt blocks that requests ahead will have cached by then

    def cached_blocks(hashes: Sequence[int], prompt_len: int) -> int:
        return min(cache.longest_cached_prefix(hashes, ahead_blocks), (prompt_len - 1) // bs)

    ahead = []
    for r in sched.running:
        if not r.prefill_done:
            ahead.append(len(r.prompt) - r.computed)
            ahead_blocks.update(r.prompt_hashes)
    need = 0
    for r in sched.waiting:
        held = cached_blocks(r.prompt_hashes, len(r.prompt))
        ahead.append(len(r.prompt) - held * bs)
        need += cache.blocks_for(len(r.prompt) + r.max_tokens) - held
        ahead_blocks.update(r.prompt_hashes)
    hit = cached_blocks(cache.chain_hashes(prompt), len(prompt)) * bs
    need += cache.blocks_for(len(prompt) + max_tokens) - hit // bs
    blocked = need > cache.free_blocks() + cache.evictable_blocks or len(sched.running) + len(sched.waiting) >= sched.max_num_seqs
    queue = ahead + [len(prompt) - hit]
    decoders = sum(1 for r in sched.running if r.prefill_done)
    t = w.step_end - now if w.busy else 0.0
    while queue:
        budget, tokens, done = max_num_batched_tokens - decoders, 0, 0
        while queue and budget > 0:
            chunk = min(queue[0], budget)
            budget -= chunk
            tokens += chunk
            queue[0] -= chunk
            if queue[0] == 0:
                queue.pop(0)
                done += 1
        t += sched.cost.step_seconds(tokens, decoders)
        decoders += done
    return blocked, t, hit


def _to_wire(event, block_size: int):
    if isinstance(event, StoredEvent):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, block_size)
    if isinstance(event, RemovedEvent):
        return BlockRemoved(event.block_hashes)
    if isinstance(event, ClearedEvent):
        return AllBlocksCleared()
    raise TypeError(event)


def simulate_policy(
    policy_name: str, workload: list[SimWorkloadRequest], config: FleetConfig, progress=None, detail: bool = False
) -> PolicyRun:
    oracle = policy_name == TTFT_ORACLE
    pd = config.prefill_workers > 0
    if pd and (oracle or not config.prefill_workers < config.workers):
        raise ValueError("P/D pools need 0 < prefill_workers < workers, and a router policy (not ttft_oracle)")
    oracle_rng = random.Random(config.seed)
    workers = [_Worker(i, config) for i in range(config.workers)]
    views = config.routers > 1 or config.view_delay_s > 0
    cp = _ControlPlane(workers, views, config.block_size, config.index_backend)
    known = [KnownWorker(w.worker_id, MODEL, "", config.block_size, pb.WorkerLoad()) for w in workers]
    decode_known = known[config.prefill_workers :] if pd else []
    if pd:
        known = known[: config.prefill_workers]  # the policy chooses among the prefill pool only
    decode_policy = make_policy("least_loaded", seed=config.seed)
    prefill_legs: dict[str, SimWorkloadRequest] = {}  # P/D: prefill leg id -> its request
    transfers: list[tuple[float, int, SimWorkloadRequest, float, _SimRouter]] = []  # P/D: (due, order, request, arrival, router)
    routers = []
    for number in range(max(1, config.routers)):
        policy = (
            None
            if oracle
            else make_policy(
                policy_name, seed=config.seed + number, **(config.kv_aware_params if policy_name == "kv_aware" else {})
            )
        )
        router = _SimRouter(
            number, policy, known, FleetState.build(make_index(config.index_backend)) if views else cp.state, views
        )
        if config.routers > 1:
            router.session = cp.state.inflight.open_session(router.router_id)
            router.state.applier.listener = None
        routers.append(router)
    run = PolicyRun(policy_name)
    seq = itertools.count()
    arrivals = sorted(workload, key=lambda r: r.arrival_s)
    next_arrival = 0
    # (time, order, kind, payload): kind 1 = step done, 2 = events reach the index
    heap: list[tuple[float, int, int, object]] = []
    # request id -> (its router, its ticket there, arrival, its reservation at the control plane or None)
    tickets: dict[str, tuple[_SimRouter, InflightTicket, float, Reservation | None]] = {}
    ids = itertools.count()
    now = 0.0
    done = 0

    def start_step(w: _Worker, t: float) -> None:
        result = None
        step_s = w.scheduler.decode_step_seconds()
        if step_s > 0:
            # Decode-only stretches run in one event, up to the step boundary after the next arrival
            # (or the next KV transfer's landing, which may add a decode leg here).
            horizon = arrivals[next_arrival].arrival_s - t if next_arrival < len(arrivals) else float("inf")
            if transfers:
                horizon = min(horizon, max(0.0, transfers[0][0] - t))
            result = w.scheduler.fast_forward(max(1, math.ceil(horizon / step_s)) if horizon != float("inf") else 1 << 30)
        if result is None:
            result = w.scheduler.step()
        w.busy = True
        w.busy_s += result.seconds
        w.step_end = t + result.seconds
        heapq.heappush(heap, (t + result.seconds, next(seq), 1, (w, result)))

    def start_decode_leg(req: SimWorkloadRequest, arrival: float, router: _SimRouter, t: float) -> None:
        """P/D: the prefill's KV has landed; the decode worker with the fewest requests generates."""
        decision = decide(decode_policy, RoutingInput(MODEL, len(req.tokens)), decode_known, router.own, None)
        w = workers[int(decision.worker_id[1:])]
        leg = SimRequest(f"r{next(ids)}", req.tokens, req.output_tokens, remote_prefilled=True)
        w.scheduler.add(leg)
        tickets[leg.request_id] = (router, router.own.start(w.worker_id, 0, ()), arrival, None)
        cp.report_load(w, t)
        if not w.busy:
            start_step(w, t)

    while heap or next_arrival < len(arrivals) or transfers:
        if (
            transfers
            and (not heap or transfers[0][0] <= heap[0][0])
            and (next_arrival >= len(arrivals) or transfers[0][0] <= arrivals[next_arrival].arrival_s)
        ):
            now, _, req, arrival, router = heapq.heappop(transfers)
            start_decode_leg(req, arrival, router, now)
            continue
        if next_arrival < len(arrivals) and (not heap or arrivals[next_arrival].arrival_s <= heap[0][0]):
            req: SimWorkloadRequest = arrivals[next_arrival]
            next_arrival += 1
            now = req.arrival_s
            keys = prompt_block_keys(req.tokens, config.block_size, MODEL)
            too_big = -(-(len(req.tokens) + req.output_tokens) // config.block_size) > config.num_blocks
            router = routers[(next_arrival - 1) % len(routers)]
            if not oracle:  # policies decide even on a request the engine will reject (their state moves on)
                router.catch_up(cp.log, now - config.view_delay_s)
                w, cached = _policy_choice(router, workers, req, keys, config)
            elif not too_big:
                w, cached = _oracle_choice(workers, req, now, config, oracle_rng)
            if too_big:
                run.rejected += 1  # larger than a whole engine cache: an engine would reject it too
                continue
            sim_req = SimRequest(f"r{next(ids)}", req.tokens, 1 if pd else req.output_tokens)
            if pd:
                prefill_legs[sim_req.request_id] = req
            w.scheduler.add(sim_req)
            prefill = max(0, len(req.tokens) - cached)
            reservation = None
            if router.session is not None:
                cp.now = now
                reservation = cp.state.inflight.reserve(
                    router.session, next(seq), w.slot, keys, prefill, 0, len(req.tokens), config.block_size
                )
            tickets[sim_req.request_id] = (router, router.own.start(w.worker_id, prefill, keys), req.arrival_s, reservation)
            cp.report_load(w, now)
            if not w.busy:
                start_step(w, now)
            continue
        now, _, kind, payload = heapq.heappop(heap)
        if kind == 1:
            w, result = payload
            w.busy = False
            cp.now = now
            for r in result.first_tokens:
                router, ticket, arrival, reservation = tickets[r.request_id]
                if r.request_id not in prefill_legs:  # a prefill leg's one token is not the client's
                    run.ttft_s.append(now - arrival)
                    if detail:
                        run.requests.append((arrival, workers.index(w), r.hit_tokens, len(r.prompt), now - arrival))
                router.own.first_token(ticket)
                if reservation is not None:
                    cp.state.inflight.prefill_done(reservation.session, reservation.reservation_id)
            for r in result.finished:
                router, ticket, arrival, reservation = tickets.pop(r.request_id)
                router.own.finish(ticket)
                if reservation is not None:
                    cp.state.inflight.release(reservation.session, reservation.reservation_id)
                if r.request_id in prefill_legs:  # its KV travels to a decode worker
                    due = now + (len(r.prompt) // config.block_size) * config.transfer_s_per_block
                    heapq.heappush(transfers, (due, next(seq), prefill_legs.pop(r.request_id), arrival, router))
                    continue
                run.e2e_s.append(now - arrival)
                done += 1
                if progress and done % 500 == 0:
                    progress(done)
            events = w.cache.take_events()
            if events:
                wire = [_to_wire(e, config.block_size) for e in events]
                if config.event_delay_s > 0:
                    heapq.heappush(heap, (now + config.event_delay_s, next(seq), 2, (w, wire)))
                else:
                    cp.apply_events(w, wire, now)
            if w.scheduler.has_work():
                start_step(w, now)
            cp.report_load(w, now)
        else:
            w, wire = payload
            cp.apply_events(w, wire, now)
    run.makespan_s = now
    run.busy_s = [w.busy_s for w in workers]
    computing = workers[: config.prefill_workers] if pd else workers  # decode legs' prompts arrive as KV
    run.hit_tokens = sum(w.cache.hits_tokens for w in computing)
    run.query_tokens = sum(w.cache.queries_tokens for w in computing)
    return run


def _policy_choice(
    router: _SimRouter, workers: list[_Worker], req: SimWorkloadRequest, keys: list[int], config: FleetConfig
) -> tuple[_Worker, int]:
    """The router's way: the index's answer from the state it decides on (`answer_columns`, as the
    control plane answers and a router's view does), then `decide`."""
    chains = {config.block_size: keys}
    state = router.state
    asking = state.inflight.routers.get(router.router_id) if router.session is not None else None
    columns = answer_columns(state, MODEL, chains, "", asking)
    request = RoutingInput(
        MODEL,
        len(req.tokens),
        token_ids=req.tokens,
        session_key=req.session,
        chains=chains,
        now_s=req.arrival_s,
        other_routers=columns.other_routers,
    )
    decision = decide(router.policy, request, router.known, router.own, columns)
    return workers[int(decision.worker_id[1:])], decision.cached_tokens


def _oracle_choice(
    workers: list[_Worker], req: SimWorkloadRequest, now: float, config: FleetConfig, rng: random.Random
) -> tuple[_Worker, int]:
    """ttft_oracle: the lowest true TTFT among workers with room, ties at random."""
    options = [(true_ttft(w, req.tokens, req.output_tokens, now, config.max_num_batched_tokens), w) for w in workers]
    best = min(est[:2] for est, _ in options)
    tied = [(w, est[2]) for est, w in options if est[:2] == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def oracle_hit_rate(workload: list[SimWorkloadRequest], block_size: int, capacity_blocks: int | None) -> float:
    """Token hit rate of one pooled LRU prefix cache (None = infinite), requests in arrival order."""
    return oracle_hit_rates(workload, block_size, [capacity_blocks])[0]


def oracle_hit_rates(workload: list[SimWorkloadRequest], block_size: int, capacities_blocks: list[int | None]) -> list[float]:
    """`oracle_hit_rate` for several capacities in one pass (each prompt is hashed once)."""
    lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities_blocks]
    hits = [0] * len(capacities_blocks)
    queries = 0
    for req in sorted(workload, key=lambda r: r.arrival_s):
        keys = prompt_block_keys(req.tokens, block_size, MODEL)
        queries += len(req.tokens)
        for c, (lru, capacity) in enumerate(zip(lrus, capacities_blocks)):
            n = 0
            for k in keys:
                if k not in lru:
                    break
                n += 1
            hits[c] += min(n, (len(req.tokens) - 1) // block_size) * block_size  # the last token is always computed
            for k in keys:
                lru[k] = None
                lru.move_to_end(k)
            if capacity is not None:
                while len(lru) > capacity:
                    lru.popitem(last=False)
    return [h / queries if queries else 0.0 for h in hits]
