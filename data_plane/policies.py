"""Routing policies: pure functions of the candidates (no I/O), so the fleet simulator can
drive exactly the code the router runs."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class Candidate:
    worker_id: str
    endpoint: str
    block_size: int
    cached_tokens: int = 0
    running_requests: int = 0        # engine-reported (heartbeat)
    waiting_requests: int = 0        # engine-reported (heartbeat)
    kv_usage: float = 0.0
    inflight_requests: int = 0       # routed by this router, not finished
    pending_prefill_tokens: int = 0  # routed by this router, prefill not done yet


@dataclass(slots=True)
class RoutingInput:
    model: str
    prompt_tokens: int


@dataclass(slots=True)
class Choice:
    worker: Candidate
    scores: dict[str, float] = field(default_factory=dict)  # worker_id -> cost (lower is better)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice: ...


def _pick_min(scores: dict[str, float], candidates: list[Candidate], rng: random.Random) -> Candidate:
    best = min(scores.values())
    tied = [c for c in candidates if scores[c.worker_id] <= best + 1e-9]
    return tied[0] if len(tied) == 1 else rng.choice(tied)  # never "always the first worker"


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        return Choice(ordered[next(self._counter) % len(ordered)], {c.worker_id: 0.0 for c in candidates})


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        return Choice(self._rng.choice(candidates), {c.worker_id: 0.0 for c in candidates})


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        scores = {c.worker_id: float(max(c.inflight_requests, c.running_requests + c.waiting_requests))
                  for c in candidates}
        return Choice(_pick_min(scores, candidates, self._rng), scores)


@dataclass(frozen=True, slots=True)
class KvAwareParams:
    """Cost of a candidate, in prefill-token equivalents (lower is better):

        cost = (prompt_tokens - cached_tokens)                 # prefill this request still needs there
             + pending_prefill_tokens                           # prefill this router already queued there
             + queue_weight * waiting_requests * mean_prompt_tokens   # engine-reported queue (other routers)
             + decode_weight * max(running_requests, inflight_requests)

    `mean_prompt_tokens` estimates the prefill behind each waiting request the engine reports;
    `decode_weight` converts one running decode into the prefill tokens it slows down.
    """
    queue_weight: float = 1.0
    mean_prompt_tokens: float = 2048.0
    decode_weight: float = 64.0


class KvAware:
    name = "kv_aware"

    def __init__(self, params: KvAwareParams | None = None, seed: int | None = None) -> None:
        self.params = params or KvAwareParams()
        self._rng = random.Random(seed)

    def cost(self, request: RoutingInput, c: Candidate) -> float:
        p = self.params
        return (max(0, request.prompt_tokens - c.cached_tokens) + c.pending_prefill_tokens
                + p.queue_weight * c.waiting_requests * p.mean_prompt_tokens
                + p.decode_weight * max(c.running_requests, c.inflight_requests))

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        scores = {c.worker_id: self.cost(request, c) for c in candidates}
        return Choice(_pick_min(scores, candidates, self._rng), scores)


POLICIES = {"kv_aware": KvAware, "round_robin": RoundRobin, "random": RandomPolicy, "least_loaded": LeastLoaded}


def make_policy(name: str, **params) -> RoutingPolicy:
    try:
        return POLICIES[name](**params)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
