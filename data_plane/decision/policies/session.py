"""`session`: rendezvous hashing on the session key (a baseline: reads no index)."""

from __future__ import annotations

import random

import xxhash

from kvroute.data_plane.decision.policies.base import NEEDS_NOTHING, Candidate, Choice, RoutingInput, make_rng, require_candidates
from kvroute.data_plane.decision.policies.load_balancing import LeastLoaded


class SessionAffinity:
    """`session`: all requests of a session go to one worker, by rendezvous (highest random weight)
    hashing: weight(w) = xxh3_64(session_key, worker_id), highest wins (Thaler & Ravishankar, 1996).
    Adding a worker moves only the sessions the new worker now wins (about 1/(n+1) of them),
    removing one moves only its own sessions, and there is no state, so router replicas agree.

    Keyed requests ignore load (pure affinity is the baseline: a busy session stays where it is).
    Requests without a session key go to the least loaded worker (LeastLoaded, seeded tie-break).
    Scores are the rendezvous rank (0 = chosen): a retry goes where the session would move."""

    name = "session"
    needs = NEEDS_NOTHING

    def __init__(self, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._least = LeastLoaded(rng=make_rng(seed, rng))

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        if not request.session_key:
            return self._least.choose(request, candidates)
        key = request.session_key.encode()
        prefix = len(key).to_bytes(4, "little") + key  # length-prefixed: no (key, id) pair collides by concatenation
        ranked = sorted(candidates, key=lambda c: (-xxhash.xxh3_64_intdigest(prefix + c.worker_id.encode()), c.worker_id))
        return Choice(ranked[0], {c.worker_id: float(i) for i, c in enumerate(ranked)})
