"""Routing policies: pure functions of the candidates (no I/O, no clock), so the fleet simulator
drives exactly the code the router runs.

    policy = make_policy("kv_aware", seed=0, decode_weight=32.0)
    choice = policy.choose(RoutingInput(model, prompt_tokens), [Candidate(...), ...])
    choice.worker        # the chosen Candidate
    choice.scores        # worker_id -> estimated cost, lower is better (the retry order)

Every policy that compares scores breaks ties uniformly at random with its own `random.Random`
(`seed=` or `rng=`), never "always the first worker": with an empty index every candidate
ties, and a deterministic tie-break would send the whole cold fleet's traffic to one GPU.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import xxhash


@dataclass(slots=True)
class Candidate:
    """One worker as a policy sees it: index match, engine-reported load, this router's in-flight work."""
    worker_id: str
    endpoint: str
    block_size: int
    cached_tokens: int = 0           # prompt tokens already in this worker's KV cache (prefix match, any tier)
    cpu_cached_tokens: int = 0       # of those, on the CPU tier (must be loaded back)
    disk_cached_tokens: int = 0      # of those, on a disk/remote tier
    running_requests: int = 0        # engine-reported (heartbeat)
    waiting_requests: int = 0        # engine-reported (heartbeat)
    kv_usage: float = 0.0            # engine-reported (heartbeat), 0..1
    inflight_requests: int = 0       # routed by kvroute routers (this one exactly, others via the control plane), not finished
    pending_prefill_tokens: int = 0  # of those, uncached prompt tokens whose prefill is not done yet
    worker_cached_blocks: int = 0    # blocks the worker's cache holds in all (index), for spreading new prefixes


@dataclass(slots=True)
class RoutingInput:
    model: str
    prompt_tokens: int
    token_ids: Sequence[int] = ()  # the prompt itself, for policies that read it (chwbl, approx_tree)
    session_key: str = ""          # x-session-id header or OpenAI `user`; "" = none (session policy)
    chains: Mapping[int, Sequence[int]] = field(default_factory=dict)  # block size -> the prompt's block keys


@dataclass(slots=True)
class Choice:
    worker: Candidate
    scores: dict[str, float] = field(default_factory=dict)  # worker_id -> cost (lower is better)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice: ...


def _require(candidates: list[Candidate]) -> None:
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate")


def _pick_min(scores: dict[str, float], candidates: list[Candidate], rng: random.Random) -> Candidate:
    best = min(scores.values())
    tolerance = 1e-9 * max(1.0, abs(best))
    return _pick_one([c for c in candidates if scores[c.worker_id] <= best + tolerance], rng)


def _pick_one(pool: list[Candidate], rng: random.Random) -> Candidate:
    """Uniform among equals; a lone candidate draws nothing, so the seeded sequence only moves on ties."""
    return pool[0] if len(pool) == 1 else rng.choice(pool)


def request_load(c: Candidate) -> int:
    """Requests on a worker: max(engine-reported running + waiting, this router's in-flight), since
    heartbeats lag behind what this router has just sent."""
    return max(c.inflight_requests, c.running_requests + c.waiting_requests)


def _rng(seed: int | None, rng: random.Random | None) -> random.Random:
    return rng if rng is not None else random.Random(seed)


class RoundRobin:
    """Cycles through the candidates (ordered by worker id) with one counter per model.

    Scores are the position in the rotation from the chosen worker (0, 1, 2...), so a retry goes
    to the next worker in the cycle."""
    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        _require(candidates)
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        start = turn % len(ordered)
        scores = {c.worker_id: float((i - start) % len(ordered)) for i, c in enumerate(ordered)}
        return Choice(ordered[start], scores)


class RandomPolicy:
    """Uniformly random (seeded or injected `random.Random`); all scores 0."""
    name = "random"

    def __init__(self, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = _rng(seed, rng)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        _require(candidates)
        return Choice(self._rng.choice(candidates), {c.worker_id: 0.0 for c in candidates})


class LeastLoaded:
    """Fewest requests (`request_load`). Ignores the cache."""
    name = "least_loaded"

    def __init__(self, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = _rng(seed, rng)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        _require(candidates)
        scores = {c.worker_id: float(request_load(c)) for c in candidates}
        return Choice(_pick_min(scores, candidates, self._rng), scores)


@dataclass(frozen=True, slots=True)
class KvAwareParams:
    """Weights of the kv_aware cost, in prefill-token equivalents (lower is better):

        credited(w) = cached tokens, those on the cpu tier x cpu_tier_credit, on disk x disk_tier_credit
        cost(w) = max(0, prompt_tokens - credited(w))                  # prefill this request needs there
                + recompute_weight * (max_w' credited(w') - credited(w))  # of it, prefill the fleet already holds
                + pending_prefill_tokens(w)                            # prefill routers already queued there
                + queue_weight * max(0, waiting(w) - inflight(w)) * mean_prompt_tokens
                                                                       # queued there by unknown senders
                + decode_weight * max(running(w), inflight(w))         # decode pressure

    The first, third, fourth and fifth terms estimate this request's time to first token on w. The
    second prices what a cache miss costs everyone else: prefill that some worker holds is computed
    again, and its blocks evict others' on a full cache. It is what keeps a burst of one new prefix
    on the worker that got the first of them (the followers' blocks are speculatively held there)
    instead of scattering it, and what stops load noise from moving a prefix every few requests.

    Parameters (settable per router, i.e. per model: `kvroute router --kv-aware-param NAME=VALUE`,
    and in the simulator: `kvroute simulate --kv-aware-param NAME=VALUE`):
    queue_weight:       how much of a waiting request's estimated prefill lands before ours (1.0 = FCFS).
    mean_prompt_tokens: estimated uncached prefill behind each waiting request no kvroute router sent
                        (engines report a count, not tokens).
    decode_weight:      prefill tokens one running (or in-flight) request is worth: a busy decode batch
                        slows our prefill step and the decode that follows.
    recompute_weight:   see above; 0 = pure TTFT greedy (scatters bursts), 1 = a recomputed token
                        costs the fleet as much as a waited-for one.
    cpu_tier_credit, disk_tier_credit: fraction of a prefill a block on that tier saves (loading it
                        back is cheaper than recomputing, not free; 0.8 = host memory at ~5x prefill
                        speed, 0.5 = local disk / remote store at ~2x).
    load_bound, load_bound_slack_tokens: bounded load. A worker is eligible only while its pending
                        prefill plus this request's stays within load_bound x the fleet mean (with this
                        request) + slack, unless no worker has less. This is what moves a hot prefix
                        to a second (and third) worker, which then caches it too, before its holder's
                        queue explodes. 0 = off.
    temperature:        0 = minimum cost; > 0 = softmax sampling, probability ~ exp(-(cost - best) / T),
                        T in prefill tokens.

    Defaults were chosen with `kvroute simulate` over the generated suite (README: "Choosing kv_aware's
    weights"); they are not fitted to one workload.
    """
    queue_weight: float = 1.0
    mean_prompt_tokens: float = 2048.0
    decode_weight: float = 128.0
    recompute_weight: float = 1.0
    cpu_tier_credit: float = 0.8
    disk_tier_credit: float = 0.5
    load_bound: float = 1.25
    load_bound_slack_tokens: float = 2048.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("queue_weight", "mean_prompt_tokens", "decode_weight", "recompute_weight",
                     "load_bound_slack_tokens", "temperature"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ValueError(f"kv_aware {name} must be >= 0, got {getattr(self, name)}")
        for name in ("cpu_tier_credit", "disk_tier_credit"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"kv_aware {name} must be in [0, 1], got {getattr(self, name)}")
        if self.load_bound and not self.load_bound >= 1.0:
            raise ValueError(f"kv_aware load_bound must be 0 (off) or >= 1.0, got {self.load_bound}")


class KvAware:
    """Minimum estimated cost (see `KvAwareParams`) among the workers within the load bound.

    Ties (an idle fleet, a new prefix) go to the worker whose cache holds the fewest blocks, so new
    prefixes spread the fleet's working set evenly (a random pick piles several groups on some
    workers, which then evict each other: the simulator showed ~1.6x the misses of a balanced
    placement); among those, rendezvous hashing on the prompt's first block no candidate holds, so
    two routers deciding on the same new prefix at the same instant still agree; the seeded
    `random.Random` only when the prompt has no full block. Never "always the first worker"."""
    name = "kv_aware"

    def __init__(self, params: KvAwareParams | None = None, seed: int | None = None,
                 rng: random.Random | None = None) -> None:
        self.params = params or KvAwareParams()
        self._rng = _rng(seed, rng)

    def credited_tokens(self, c: Candidate) -> float:
        if not (c.cpu_cached_tokens or c.disk_cached_tokens):
            return c.cached_tokens
        p = self.params
        return (c.cached_tokens - (1.0 - p.cpu_tier_credit) * c.cpu_cached_tokens
                - (1.0 - p.disk_tier_credit) * c.disk_cached_tokens)

    def queued_work(self, c: Candidate) -> float:
        """Work ahead of a new request on this worker, whoever sent it."""
        p = self.params
        return (c.pending_prefill_tokens
                + p.queue_weight * max(0, c.waiting_requests - c.inflight_requests) * p.mean_prompt_tokens
                + p.decode_weight * max(c.running_requests, c.inflight_requests))

    def cost(self, request: RoutingInput, c: Candidate, best_credited: float = 0.0) -> float:
        """The documented cost of one candidate; `best_credited`: the most any candidate has cached."""
        credited = self.credited_tokens(c)
        return self._cost(max(0.0, request.prompt_tokens - credited), max(0.0, best_credited - credited), c)

    def _cost(self, uncached: float, recomputed: float, c: Candidate) -> float:
        return uncached + self.params.recompute_weight * recomputed + self.queued_work(c)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        _require(candidates)
        p = self.params
        credited = [self.credited_tokens(c) for c in candidates]
        best = max(credited)
        prompt = request.prompt_tokens
        uncached = [prompt - cr if cr < prompt else 0.0 for cr in credited]
        scores = {c.worker_id: self._cost(u, best - cr, c) for c, u, cr in zip(candidates, uncached, credited)}
        pool = self._within_bound(candidates, uncached) if p.load_bound and len(candidates) > 1 else candidates
        if p.temperature > 0:
            return Choice(self._sample(scores, pool), scores)
        low = min(scores[c.worker_id] for c in pool)
        tied = [c for c in pool if scores[c.worker_id] <= low + 1e-9 * max(1.0, abs(low))]
        if len(tied) > 1:
            fewest = min(c.worker_cached_blocks for c in tied)
            tied = [c for c in tied if c.worker_cached_blocks == fewest]
        return Choice(tied[0] if len(tied) == 1 else self._tie_break(request, tied), scores)

    def _tie_break(self, request: RoutingInput, tied: list[Candidate]) -> Candidate:
        bs = tied[0].block_size
        chain = request.chains.get(bs)
        if not chain:
            return self._rng.choice(tied)
        key = chain[min(len(chain) - 1, max(c.cached_tokens for c in tied) // bs)].to_bytes(8, "little")
        return max(tied, key=lambda c: (xxhash.xxh3_64_intdigest(key + c.worker_id.encode()), c.worker_id))

    def _within_bound(self, candidates: list[Candidate], uncached: list[float]) -> list[Candidate]:
        """Workers whose pending prefill with this request's stays within the bound (or is the least)."""
        p = self.params
        pending = sum(c.pending_prefill_tokens for c in candidates)
        work = [c.pending_prefill_tokens + u for c, u in zip(candidates, uncached)]
        least = min(work)
        scale = p.load_bound / len(candidates)
        return [c for c, w, u in zip(candidates, work, uncached)
                if w <= least or w <= scale * (pending + u) + p.load_bound_slack_tokens]

    def _sample(self, scores: dict[str, float], pool: list[Candidate]) -> Candidate:
        low = min(scores[c.worker_id] for c in pool)
        weights = [math.exp(-(scores[c.worker_id] - low) / self.params.temperature) for c in pool]
        return self._rng.choices(pool, weights)[0]


POLICIES: dict[str, type] = {"kv_aware": KvAware, "round_robin": RoundRobin, "random": RandomPolicy,
                             "least_loaded": LeastLoaded}
_KV_AWARE_FIELDS = {f.name for f in fields(KvAwareParams)}


def parse_kv_aware_params(items: Sequence[str]) -> dict[str, float]:
    """`["recompute_weight=0.5", ...]` (CLI --kv-aware-param) -> validated KvAwareParams fields."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in _KV_AWARE_FIELDS:
            raise ValueError(f"--kv-aware-param {item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(sorted(_KV_AWARE_FIELDS))}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--kv-aware-param {item!r}: {value!r} is not a number") from None
    KvAwareParams(**out)  # validates ranges
    return out


def make_policy(name: str, **params) -> RoutingPolicy:
    """`make_policy("kv_aware", seed=1, queue_weight=0.5)`: KvAwareParams fields may be passed flat.
    `seed`/`rng` are accepted (and ignored) by round_robin too, so callers can pass them uniformly."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "kv_aware":
        weights = {k: params.pop(k) for k in list(params) if k in _KV_AWARE_FIELDS}
        if weights:
            if params.get("params") is not None:
                raise ValueError("pass either params=KvAwareParams(...) or its fields, not both")
            params["params"] = KvAwareParams(**weights)
    elif name == "round_robin":
        params.pop("seed", None)
        params.pop("rng", None)
    try:
        return POLICIES[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None


# session, chwbl and approx_tree live in affinity_policies, which imports this module and adds
# itself to POLICIES; a module import (not `from ... import`) works whichever of the two loads first.
import data_plane.affinity_policies  # noqa: F401
