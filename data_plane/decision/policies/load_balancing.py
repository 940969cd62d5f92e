"""Policies that ignore the cache: `round_robin`, `random`, `least_loaded`. They read neither the
prompt nor the index (`needs` is empty), so the router tokenizes nothing and queries nothing for them."""

from __future__ import annotations

import random

from kvroute.data_plane.decision.policies.base import (
    NEEDS_NOTHING,
    Candidate,
    Choice,
    RoutingInput,
    make_rng,
    pick_min,
    request_load,
    require_candidates,
)


class RoundRobin:
    """Cycles through the candidates (ordered by worker id) with one counter per model.

    Scores are the position in the rotation from the chosen worker (0, 1, 2...), so a retry goes
    to the next worker in the cycle."""

    name = "round_robin"
    needs = NEEDS_NOTHING

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        start = turn % len(ordered)
        scores = {c.worker_id: float((i - start) % len(ordered)) for i, c in enumerate(ordered)}
        return Choice(ordered[start], scores)


class RandomPolicy:
    """Uniformly random (seeded or injected `random.Random`); all scores 0."""

    name = "random"
    needs = NEEDS_NOTHING

    def __init__(self, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = make_rng(seed, rng)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        return Choice(self._rng.choice(candidates), {c.worker_id: 0.0 for c in candidates})


class LeastLoaded:
    """Fewest requests (`request_load`). Ignores the cache."""

    name = "least_loaded"
    needs = NEEDS_NOTHING

    def __init__(self, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = make_rng(seed, rng)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        scores = {c.worker_id: float(request_load(c)) for c in candidates}
        return Choice(pick_min(scores, candidates, self._rng), scores)
