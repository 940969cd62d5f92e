"""The interface every routing policy implements, and the helpers they share.

A policy is a pure function of its input and the candidates (no I/O, no clock), so the fleet
simulator drives exactly the code the router runs:

    choice = policy.choose(RoutingInput(model, prompt_tokens), [Candidate(...), ...])
    choice.worker        # the chosen Candidate
    choice.scores        # worker_id -> estimated cost, lower is better (the retry order)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class Candidate:
    """One worker as a policy sees it: index match, engine-reported load, this router's in-flight work."""

    worker_id: str
    endpoint: str
    block_size: int
    cached_tokens: int = 0  # prompt tokens already in this worker's KV cache (prefix match, any tier)
    cpu_cached_tokens: int = 0  # of those, on the CPU tier (must be loaded back)
    disk_cached_tokens: int = 0  # of those, on a disk/remote tier
    running_requests: int = 0  # engine-reported (heartbeat)
    waiting_requests: int = 0  # engine-reported (heartbeat)
    kv_usage: float = 0.0  # engine-reported (heartbeat), 0..1
    inflight_requests: int = 0  # routed by kvroute routers (this one exactly, others via the control plane), not finished
    pending_prefill_tokens: int = 0  # of those, uncached prompt tokens whose prefill is not done yet
    worker_cached_blocks: int = 0  # blocks the worker's cache holds in all (index), for spreading new prefixes
    inflight_cached_tokens: int = 0  # of cached_tokens, those only in-flight requests are computing there now
    kv_capacity_tokens: int = 0  # engine-reported (heartbeat): its KV cache size in tokens, 0 = unknown


@dataclass(slots=True)
class RoutingInput:
    model: str
    prompt_tokens: int
    token_ids: Sequence[int] = ()  # the prompt itself, for policies that read it (chwbl, approx_tree)
    session_key: str = ""  # x-session-id header or OpenAI `user`; "" = none (session policy)
    chains: Mapping[int, Sequence[int]] = field(default_factory=dict)  # block size -> the prompt's block keys
    now_s: float = 0.0  # when it arrived (monotonic, or simulated), for policies that keep rates
    other_routers: int = 0  # routers besides this one deciding on the fleet now (the index's answer); 0 = alone or unknown


@dataclass(frozen=True, slots=True)
class PolicyNeeds:
    """What a policy reads, so the request path does only that work: `tokens` = the prompt's token
    ids (tokenizing), `block_keys` = its block keys per block size, `index` = the control plane's
    answer (a query). Without `index`, candidates come from the known fleet and this router's
    in-flight state; without `tokens`, `RoutingInput.token_ids` is empty and `prompt_tokens` 0."""

    tokens: bool = False
    block_keys: bool = False
    index: bool = False


NEEDS_NOTHING = PolicyNeeds()
NEEDS_TOKENS = PolicyNeeds(tokens=True)
NEEDS_INDEX = PolicyNeeds(tokens=True, block_keys=True, index=True)


@dataclass(slots=True)
class Choice:
    worker: Candidate
    scores: dict[str, float] = field(default_factory=dict)  # worker_id -> cost (lower is better)


@dataclass(slots=True)
class CandidateExplanation:
    """Why one candidate scored what it did. `terms`: the named parts of the policy's formula, which
    sum to `cost` (empty for a policy whose score is not a formula). `eligible`: still in the
    running at the last step (inside the load bound, and the spread pool while caches fill); None
    when the policy has no such step."""

    worker_id: str
    cost: float
    terms: dict[str, float] = field(default_factory=dict)
    credited_tokens: float = 0.0
    within_load_bound: bool | None = None
    in_spread_pool: bool | None = None


@dataclass(slots=True)
class Explanation:
    """A decision taken apart: per candidate its cost terms, and in one sentence why the winner won."""

    policy: str
    reason: str
    workers: list[CandidateExplanation] = field(default_factory=list)
    params: dict[str, float] = field(default_factory=dict)


class RoutingPolicy(Protocol):
    name: str
    needs: PolicyNeeds

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice: ...


def explain_scores(policy: str, choice: Choice, candidates: list[Candidate]) -> Explanation:
    """The explanation of a policy without a cost formula (`explain` not defined): its scores, lower
    first in the retry order."""
    return Explanation(
        policy,
        f"{choice.worker.worker_id} chosen by {policy} (its scores order the retries; the policy has no cost terms)",
        [CandidateExplanation(c.worker_id, choice.scores.get(c.worker_id, 0.0)) for c in candidates],
    )


def require_candidates(candidates: list[Candidate]) -> None:
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate")


def pick_min(scores: dict[str, float], candidates: list[Candidate], rng: random.Random) -> Candidate:
    best = min(scores.values())
    tolerance = 1e-9 * max(1.0, abs(best))
    return pick_one([c for c in candidates if scores[c.worker_id] <= best + tolerance], rng)


def pick_one(pool: list[Candidate], rng: random.Random) -> Candidate:
    """Uniform among equals; a lone candidate draws nothing, so the seeded sequence only moves on ties."""
    return pool[0] if len(pool) == 1 else rng.choice(pool)


def request_load(c: Candidate) -> int:
    """Requests on a worker: max(engine-reported running + waiting, this router's in-flight), since
    heartbeats lag behind what this router has just sent."""
    return max(c.inflight_requests, c.running_requests + c.waiting_requests)


def make_rng(seed: int | None, rng: random.Random | None) -> random.Random:
    return rng if rng is not None else random.Random(seed)


def others_by_load(chosen: Candidate, candidates: list[Candidate]) -> dict[str, float]:
    """Scores for policies whose choice is not a cost: 0 for the chosen worker, 1 + load for the
    rest, so a retry goes to the least loaded other worker."""
    return {c.worker_id: 0.0 if c is chosen else 1.0 + request_load(c) for c in candidates}
