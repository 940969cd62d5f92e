"""Router core: prompt tokens -> block keys -> control-plane query -> candidates -> policy.

`Router.decide(model, token_ids, lora_name, cache_salt, session_key=...)`:
1. the known workers of the model (and LoRA adapter, if one is asked for) from
   `ControlPlaneClient.workers_for` (last ListWorkers snapshot, or the static fleet) give the
   distinct block sizes;
2. the prompt is hashed once per block size (`kvroute.block_keys`; `prompt_keys.PromptKeyCache`
   reuses the keys of an already-seen prefix);
3. one query with one KeyChain per block size, under the client's deadline, over the router
   session stream (or the unary Query RPC while the stream is down);
4. candidates: cached_tokens = the longer of the index's match (any tier, other routers'
   speculative holders included) and this router's own in-flight requests' prompts on that
   worker, x the worker's block size (capped at the prompt); cpu/disk-tier parts; engine load;
   in-flight work = this router's own (exact, `RouterInflight`) + other routers' reservations;
5. the policy chooses (it also gets the prompt's token ids, block keys and the session key, for
   the policies that hash or remember prompts or sessions instead of reading the index).

Failing open: if the query times out, errors, or returns no workers while some are known, the
decision is made over the known workers on load alone plus this router's own in-flight prompts
(`fail_open=True`). A request never fails for an index reason; only "no worker known at all"
raises NoWorkersError (its message says why: `readiness.no_workers_reason`). Workers failing their
active health checks are no candidates unless every known one is (`backend_health.py`).

Workers no agent reports on (found by DNS, static) are candidates on load beside the index's
answer (`candidates.py`). When every known worker is one of them and the control plane is
reachable, the index is not asked: it knows none of them, and the decision on load is no failure
(not counted as failing open). With the control plane unreachable it is asked as ever, and fails
open as ever, so that a lost control plane still shows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc
from opentelemetry import trace

from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, KnownWorker
from kvroute.data_plane.cp_link.fleet_view import VIEW_NOT_SYNCED, VIEW_STALE
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.decide import NO_KNOWN_WORKER, RouteDecision, decide
from kvroute.data_plane.decision.policies import RoutingInput, RoutingPolicy
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.ops.stage_timing import StageClock
from kvroute.data_plane.prepare.prompt_keys import PromptKeyCache
from kvroute.data_plane.service.readiness import no_workers_reason
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.telemetry import span
from kvroute.v1 import kvroute_pb2 as pb

log = logging.getLogger("kvroute.router")
tracer = trace.get_tracer("kvroute.router")


_INDEX_REASONS = {
    "index has no workers for the model": "index_empty",
    NO_KNOWN_WORKER: "index_unknown_workers",
    VIEW_NOT_SYNCED: "view_not_synced",
    VIEW_STALE: "view_stale",
}


def fail_open_label(reason: str) -> str:
    """The metric label of a fail-open reason: a bounded set (gRPC status names lower-cased)."""
    if reason in _INDEX_REASONS:
        return _INDEX_REASONS[reason]
    if reason in grpc.StatusCode.__members__:
        return reason.lower()
    if reason.startswith("SessionUnavailable"):  # the session stream ended under the query: a replica gone
        return "unavailable"
    return "error"


def _unreported_only(known: Sequence[KnownWorker]) -> bool:
    """No agent reports on any of `known` (the first worker settles it in a fleet with agents)."""
    return not any(w.model for w in known)


class NoWorkersError(RuntimeError):
    """No worker is known for the model (not an index problem: there is nowhere to route)."""


class Router:
    def __init__(
        self,
        control_plane: ControlPlaneClient,
        policy: RoutingPolicy,
        inflight: RouterInflight,
        health: BackendHealth | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        """`inflight` and `health` are built once at start-up and shared with the proxy, which writes
        them (requests sent and finished, backends that failed); decisions only read them."""
        self.control_plane = control_plane
        self.policy = policy
        self.inflight = inflight
        self.health = health or BackendHealth()
        self.metrics = metrics or RouterMetrics()
        self.prompt_keys = PromptKeyCache()
        self._log = RateLimitedLog(log)

    async def decide(
        self,
        model: str,
        token_ids: Sequence[int] | None,
        lora_name: str = "",
        cache_salt: str = "",
        session_key: str = "",
        clock: StageClock | None = None,
        explain: bool = False,
        eligible: Callable[[KnownWorker], bool] | None = None,
    ) -> RouteDecision:
        """`token_ids`: the prompt, or None when the request was not tokenized (the policy needs no
        tokens). Block keys and the control-plane query happen only for a policy that reads them
        (`policy.needs`). Workers failing their health checks (`health.down()`) are left out unless
        every known one is, then workers cooling down after a failed request unless no other is
        left. `lora_name`: route only among workers serving that adapter (and key the prompt in its
        namespace). `session_key`: the client's session/end-user id ("" = none).
        `explain`: also take the decision apart (`RouteDecision.explanation`, `index_view`).
        `eligible`: route only among the known workers it accepts (the endpoint picker's subset hint);
        NoWorkersError when it accepts none."""
        started = time.perf_counter()
        needs = self.policy.needs
        prompt_tokens = len(token_ids) if token_ids is not None else 0
        with span(tracer, "kvroute.route") as route_span:
            known = self.control_plane.workers_for(model, lora_name)
            if eligible is not None and known:
                known = [w for w in known if eligible(w)]
                if not known:
                    raise NoWorkersError(f"none of the known workers of model {model!r} is in the request's subset")
            if not known:
                raise NoWorkersError(no_workers_reason(self.control_plane, model, lora_name))
            down = self.health.down()
            if down:  # failing their health checks: out, unless every one is (then all are tried)
                known = [w for w in known if w.worker_id not in down] or known
            chains: dict[int, list[int]] = {}
            if needs.block_keys and token_ids is not None:
                chains = {
                    bs: self.prompt_keys.keys(token_ids, bs, model, lora_name, cache_salt)
                    for bs in sorted({w.block_size for w in known if w.block_size > 0})
                }
            if clock is not None:
                clock.mark("keys")
            reason = ""
            columns = None
            if needs.index and (not _unreported_only(known) or not self.control_plane.reachable):
                view = self.control_plane.view
                if view is not None:  # --index local: the answer is read in process
                    columns, reason = view.answer(model, chains, lora_name)
                else:
                    columns, reason = await self._query(model, chains, lora_name)
            if clock is not None:
                clock.mark("query")
            routing_input = RoutingInput(
                model,
                prompt_tokens,
                token_ids=token_ids or (),
                session_key=session_key,
                chains=chains,
                now_s=started,
                other_routers=columns.other_routers if columns is not None else 0,
            )
            decision = decide(
                self.policy, routing_input, known, self.inflight, columns, reason, self.health.cooling_down(), explain
            )
            reason = decision.fail_open_reason
            if clock is not None:
                clock.mark("score")
            if reason:
                self._failed_open(reason)
                route_span.set_attribute("kvroute.fail_open_reason", reason)
            if route_span.is_recording():
                route_span.set_attribute("kvroute.policy", self.policy.name)
                route_span.set_attribute("kvroute.prompt_tokens", prompt_tokens)
                route_span.set_attribute("kvroute.worker_id", decision.worker_id)
                route_span.set_attribute("kvroute.cached_tokens", decision.cached_tokens)
                route_span.set_attribute("kvroute.fail_open", decision.fail_open)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        return decision

    def _failed_open(self, reason: str) -> None:
        """Count it by why, and say so in the log (at most once per cause every 5 s)."""
        label = fail_open_label(reason)
        self.metrics.fail_open.labels(label).inc()
        deadline = self.control_plane.query_deadline
        self.metrics.query_deadline_seconds.set(deadline.seconds)
        if label == "deadline_exceeded":
            if deadline.adaptive:
                self._log.warning(
                    label,
                    "deciding on load alone: the control-plane query took longer than its "
                    "deadline (%.1f ms; slowest recent answer %.1f ms, bounds %g-%g ms: "
                    "--query-timeout-ms, --query-timeout-max-ms); affinity is lost for these requests",
                    deadline.seconds * 1000,
                    deadline.recent_slowest_s * 1000,
                    deadline.min_s * 1000,
                    deadline.max_s * 1000,
                )
            else:
                self._log.warning(
                    label,
                    "deciding on load alone: the control-plane query took longer than its "
                    "fixed deadline (%.1f ms, --query-timeout-ms; --query-timeout-factor makes it follow "
                    "the host); affinity is lost for these requests",
                    deadline.seconds * 1000,
                )
        elif label in ("index_empty", "index_unknown_workers"):
            self._log.warning(
                label, "deciding on load alone: %s (workers registering, or this router's fleet view is behind)", reason
            )
        elif label in ("view_not_synced", "view_stale"):
            self._log.warning(label, "deciding on load alone: %s", reason)
        else:
            self._log.warning(label, "deciding on load alone: the control-plane query failed (%s)", reason)

    async def _query(self, model: str, chains: dict[int, list[int]], lora_name: str) -> tuple[pb.WorkerColumns | None, str]:
        """The index's answer and "" — or None and why the index could not be used."""
        try:
            columns = await self.control_plane.query(model, chains, lora_name)
        except grpc.aio.AioRpcError as exc:
            return None, exc.code().name
        except TimeoutError:
            return None, "DEADLINE_EXCEEDED"
        except Exception as exc:  # noqa: BLE001 - never fail a request for an index reason
            return None, f"{type(exc).__name__}: {exc}"  # logged (rate-limited) by _failed_open
        if not columns.worker_id:  # e.g. a restarted control plane whose agents have not re-registered yet
            return None, "index has no workers for the model"
        return columns, ""
