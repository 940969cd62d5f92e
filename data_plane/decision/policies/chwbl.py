"""`chwbl`: KubeAI's PrefixHash, consistent hashing with bounded loads on the prompt's first tokens
(a baseline: reads no index)."""

from __future__ import annotations

import bisect
import math
import random
from array import array

import xxhash

from kvroute.data_plane.decision.policies.base import (
    NEEDS_TOKENS,
    Candidate,
    Choice,
    RoutingInput,
    request_load,
    require_candidates,
)

# KubeAI's PrefixHash defaults (its Model CRD, loadBalancing.prefixHash): meanLoadFactor 125 (%),
# replication 256 (virtual nodes per endpoint), prefixCharLength 100. KubeAI hashes the first 100
# characters of the prompt (for chat: of the first user message); we hash tokens, and 100 characters
# are about 25 tokens by the usual ~4 characters per English token rule of thumb.
CHWBL_PREFIX_TOKENS = 25
CHWBL_LOAD_FACTOR = 1.25
CHWBL_REPLICATION = 256


class PrefixHashBoundedLoad:
    """`chwbl`: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018) on the
    prompt prefix, as KubeAI's PrefixHash strategy does.

    - key: xxh3_64 of the model name and the first `prefix_tokens` prompt tokens (all if shorter);
    - ring: `replication` points per worker, xxh3_64("<worker_id>#<i>");
    - from the key's point, walk the ring clockwise and take the first worker that stays within the
      bound after taking this request: load + 1 <= ceil(load_factor * (total_load + 1) / workers),
      the paper's capacity with the new request counted. Some worker always fits (the least loaded
      one does), so the bound holds for every decision.
    KubeAI checks the same inequality without the ceil, so at low load no worker fits and it falls
    back to the key's own worker; with the ceil a second concurrent request may move on instead.
    Same prefix, same worker while that worker is under the bound. Deterministic (no ties to break;
    `seed`/`rng` are accepted for a uniform make_policy call). Scores: 0 for the chosen worker,
    1 + the ring-walk position for the rest (a retry continues the walk)."""

    name = "chwbl"
    needs = NEEDS_TOKENS

    def __init__(
        self,
        prefix_tokens: int = CHWBL_PREFIX_TOKENS,
        load_factor: float = CHWBL_LOAD_FACTOR,
        replication: int = CHWBL_REPLICATION,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if prefix_tokens < 1 or replication < 1:
            raise ValueError("prefix_tokens and replication must be >= 1")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0 (1.0 = perfectly even), got {load_factor}")
        self.prefix_tokens, self.load_factor, self.replication = prefix_tokens, load_factor, replication
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, worker_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        if worker_ids != self._ring_of:  # the fleet changed: rebuild (rare; candidates are usually the same set)
            ring = sorted((xxhash.xxh3_64_intdigest(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(self.replication))
            self._points, self._owners = [p for p, _ in ring], [w for _, w in ring]
            self._ring_of = worker_ids
        return self._points, self._owners

    def key(self, request: RoutingInput) -> int:
        head = array("q", request.token_ids[: self.prefix_tokens]).tobytes()
        return xxhash.xxh3_64_intdigest(request.model.encode() + b"\0" + head)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        by_id = {c.worker_id: c for c in candidates}
        points, owners = self._ring(tuple(sorted(by_id)))
        walk: dict[str, Candidate] = {}  # distinct workers in clockwise order from the key's point
        start = bisect.bisect_left(points, self.key(request))
        for j in range(len(points)):
            owner = owners[(start + j) % len(points)]
            if owner not in walk:
                walk[owner] = by_id[owner]
                if len(walk) == len(by_id):
                    break
        loads = {c.worker_id: request_load(c) for c in candidates}
        # The epsilon: a product that is an integer in exact arithmetic (1.1 * 10 / 11) must not ceil one up.
        cap = math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(candidates) - 1e-9)
        order = list(walk.values())
        chosen = next((c for c in order if loads[c.worker_id] + 1 <= cap), order[0])
        scores = {c.worker_id: float(i + 1) for i, c in enumerate(order)}
        scores[chosen.worker_id] = 0.0
        return Choice(chosen, scores)
