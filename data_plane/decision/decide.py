"""The decision: a pure function of what the router knows at this instant (no await, no I/O), which
the HTTP router, the gRPC `Route` API, the endpoint picker and the fleet simulator all run.

    decision = decide(policy, RoutingInput(model, prompt_tokens, token_ids, session_key, chains),
                      known, own, columns, fail_open_reason="", avoid=frozenset(), explain=False)

- `known`: the workers of the model (and adapter) the router knows (its view of the fleet, the
  control plane's ListWorkers, or the static fleet), in a stable order;
- `own`: this router's own in-flight requests (`RouterInflight`);
- `columns`: the index's answer (`kvroute.fleet.answer.IndexColumns` from this router's view or a
  simulation, `pb.WorkerColumns` from a control plane's Query), or None with `fail_open_reason`
  saying why the index could not be used;
- `avoid`: workers sitting out after a failure (left out unless every known worker is).

Candidates come from `candidates.build_candidates` (with the answer; without it, or when the answer
names no known worker, load alone over the known fleet: a fail-open decision), then the policy
chooses. `explain` also takes the decision apart (`RouteDecision.explanation`, `index_view`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvroute.data_plane.decision.candidates import IndexColumnsView, KnownWorkerView, OwnInflight, build_candidates
from kvroute.data_plane.decision.policies import Candidate, Explanation, RoutingInput, RoutingPolicy, explain_scores

NO_KNOWN_WORKER = "index answered with no known worker"


@dataclass(slots=True)
class RouteDecision:
    worker_id: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    policy: str
    fail_open: bool
    candidates: list[Candidate] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    fail_open_reason: str = ""
    chains: dict[int, list[int]] = field(default_factory=dict)  # block size -> the prompt's block keys
    dp_ranks: dict[str, int] = field(default_factory=dict)  # worker_id -> X-data-parallel-rank, DP workers only
    explanation: Explanation | None = None  # only when asked (decide(..., explain=True))
    index_view: dict[str, dict[str, int]] | None = None  # worker_id -> what the index answered, with explanation
    model: str = ""  # the model routed for (the request's base model)

    def ranked(self) -> list[Candidate]:
        """Candidates best first: the chosen one, then by score (the retry order)."""
        rest = sorted(
            (c for c in self.candidates if c.worker_id != self.worker_id), key=lambda c: self.scores.get(c.worker_id, 0.0)
        )
        chosen = [c for c in self.candidates if c.worker_id == self.worker_id]
        return chosen + rest

    def as_json(self) -> dict:
        """The POST /v1/route answer."""
        return {
            "worker_id": self.worker_id,
            "endpoint": self.endpoint,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "fail_open": self.fail_open,
            "policy": self.policy,
            "workers": [
                {
                    "worker_id": c.worker_id,
                    "endpoint": c.endpoint,
                    "cached_tokens": c.cached_tokens,
                    "score": self.scores.get(c.worker_id, 0.0),
                    "inflight_requests": c.inflight_requests,
                    "running_requests": c.running_requests,
                    "waiting_requests": c.waiting_requests,
                }
                for c in self.candidates
            ],
        } | ({"explain": self.explanation_json()} if self.explanation else {})

    def explanation_json(self) -> dict:
        """The decision taken apart (POST /v1/route?explain=1): why the winner won, per candidate its
        cost terms, and what the index answered for it (null: failing open, the index was not used)."""
        e = self.explanation
        assert e is not None
        view = self.index_view or {}
        return {
            "policy": e.policy,
            "reason": e.reason,
            "fail_open": self.fail_open,
            "fail_open_reason": self.fail_open_reason,
            "params": e.params,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "cost": w.cost,
                    "terms": w.terms,
                    "credited_tokens": w.credited_tokens,
                    "within_load_bound": w.within_load_bound,
                    "in_spread_pool": w.in_spread_pool,
                    "index": view.get(w.worker_id),
                }
                for w in e.workers
            ],
        }


def index_view(columns: IndexColumnsView, known: Sequence[KnownWorkerView]) -> dict[str, dict[str, int]]:
    """Per worker, the index's answer alone (before this router's own in-flight prompts are added):
    matched prefix and its tiers in tokens, and other routers' reservations there."""
    block_size = {w.worker_id: w.block_size for w in known}
    out = {}
    for wid, matched, cpu, disk, reserved, prefill in zip(
        columns.worker_id,
        columns.matched_blocks,
        columns.cpu_blocks,
        columns.disk_blocks,
        columns.reserved_requests,
        columns.reserved_prefill_tokens,
    ):
        bs = block_size.get(wid, 0)
        out[wid] = {
            "matched_tokens": matched * bs,
            "cpu_tokens": cpu * bs,
            "disk_tokens": disk * bs,
            "other_routers_requests": reserved,
            "other_routers_prefill_tokens": prefill,
        }
    return out


def decide(
    policy: RoutingPolicy,
    request: RoutingInput,
    known: Sequence[KnownWorkerView],
    own: OwnInflight,
    columns: IndexColumnsView | None,
    fail_open_reason: str = "",
    avoid: Collection[str] = frozenset(),
    explain: bool = False,
) -> RouteDecision:
    """One decision (see the module docstring); `known` must not be empty."""
    reason = fail_open_reason
    chains, prompt_tokens = request.chains, request.prompt_tokens
    candidates: list[Candidate] = []
    if columns is not None:
        candidates = build_candidates(known, own, chains, prompt_tokens, columns, avoid)
        if not candidates:
            reason = NO_KNOWN_WORKER
    if not candidates:  # no index wanted, or failing open: load alone over the known fleet
        candidates = build_candidates(known, own, chains, prompt_tokens, None, avoid)
    choice = policy.choose(request, candidates)
    dp_ranks = {w.worker_id: w.data_parallel_rank for w in known if w.data_parallel_rank is not None}
    decision = RouteDecision(
        choice.worker.worker_id,
        choice.worker.endpoint,
        prompt_tokens,
        choice.worker.cached_tokens,
        policy.name,
        bool(reason),
        candidates,
        choice.scores,
        reason,
        dict(chains),
        dp_ranks,
        model=request.model,
    )
    if explain:
        explainer = getattr(policy, "explain", None)
        decision.explanation = (
            explainer(request, candidates, choice) if explainer is not None else explain_scores(policy.name, choice, candidates)
        )
        decision.index_view = index_view(columns, known) if columns is not None and not reason else None
    return decision
