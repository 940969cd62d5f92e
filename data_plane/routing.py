"""Router core: prompt tokens -> block keys -> control-plane query -> policy -> decision."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from data_plane.control_plane_client import ControlPlaneClient
from data_plane.load_tracker import LoadTracker
from data_plane.policies import Candidate, RoutingInput, RoutingPolicy
from kvroute.block_keys import prompt_block_keys

log = logging.getLogger("kvroute.router")
tracer = trace.get_tracer("kvroute.router")


class NoWorkersError(RuntimeError):
    """No worker is known for the model (not an index problem: there is nowhere to route)."""


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

    def ranked(self) -> list[Candidate]:
        """Candidates best first: the chosen one, then by score (used for retries)."""
        rest = sorted((c for c in self.candidates if c.worker_id != self.worker_id),
                      key=lambda c: self.scores.get(c.worker_id, 0.0))
        chosen = [c for c in self.candidates if c.worker_id == self.worker_id]
        return chosen + rest

    def as_json(self) -> dict:
        return {"worker_id": self.worker_id, "endpoint": self.endpoint, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "policy": self.policy, "fail_open": self.fail_open,
                "workers": [{"worker_id": c.worker_id, "endpoint": c.endpoint, "cached_tokens": c.cached_tokens,
                             "score": self.scores.get(c.worker_id, 0.0), "inflight_requests": c.inflight_requests,
                             "running_requests": c.running_requests, "waiting_requests": c.waiting_requests}
                            for c in self.candidates]}


class Router:
    def __init__(self, control_plane: ControlPlaneClient, policy: RoutingPolicy, load: LoadTracker) -> None:
        self.control_plane = control_plane
        self.policy = policy
        self.load = load
        self.fail_open_count = 0

    async def decide(self, model: str, token_ids: list[int], lora_name: str = "", cache_salt: str = "",
                     exclude: frozenset[str] = frozenset()) -> RouteDecision:
        with tracer.start_as_current_span("kvroute.route") as span:
            workers = [w for w in self.control_plane.workers_for(model) if w.worker_id not in exclude]
            if not workers:
                raise NoWorkersError(f"no workers known for model {model!r}")
            chains = {bs: prompt_block_keys(token_ids, bs, model, lora_name, cache_salt)
                      for bs in {w.block_size for w in workers}}
            fail_open = False
            matched: dict[str, int] = {}
            loads = {w.worker_id: w.load for w in workers}
            try:
                for m in await self.control_plane.query(model, chains):
                    matched[m.worker_id] = m.matched_blocks * m.block_size
                    loads[m.worker_id] = m.load
            except grpc.aio.AioRpcError as exc:
                fail_open = True  # decide on load alone; never fail a request for an index reason
                self.fail_open_count += 1
                span.set_attribute("kvroute.fail_open_reason", exc.code().name)
            candidates = []
            for w in workers:
                inflight, pending = self.load.inflight(w.worker_id)
                load = loads[w.worker_id]
                candidates.append(Candidate(
                    worker_id=w.worker_id, endpoint=w.endpoint, block_size=w.block_size,
                    cached_tokens=min(matched.get(w.worker_id, 0), len(token_ids)),
                    running_requests=load.running_requests, waiting_requests=load.waiting_requests,
                    kv_usage=load.kv_usage, inflight_requests=inflight, pending_prefill_tokens=pending))
            choice = self.policy.choose(RoutingInput(model, len(token_ids)), candidates)
            decision = RouteDecision(choice.worker.worker_id, choice.worker.endpoint, len(token_ids),
                                     choice.worker.cached_tokens, self.policy.name, fail_open, candidates, choice.scores)
            if span.is_recording():
                span.set_attribute("kvroute.policy", self.policy.name)
                span.set_attribute("kvroute.prompt_tokens", len(token_ids))
                span.set_attribute("kvroute.worker_id", decision.worker_id)
                span.set_attribute("kvroute.cached_tokens", decision.cached_tokens)
                span.set_attribute("kvroute.fail_open", fail_open)
            return decision
