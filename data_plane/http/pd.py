"""Prefill/decode disaggregation: a router mode (`kvroute router --pd vllm|sglang`) that sends a
request's prompt to a prefill worker and its generation to a decode worker, over the same proxy
path (`proxy.py`) that serves whole requests.

    pd = PdRouting("vllm", router, proxy, roles={"engine-a": "prefill"}, bootstrap_ports={}, default_bootstrap_port=8998)
    prefill = await pd.decide_prefill(model, token_ids, lora_name, cache_salt, session_key)
    decode = await pd.decide_decode(model, lora_name)
    response = await pd.forward(request, path, raw_body, prefill, decode, prompt_tokens, tail, clock, started)

Roles: a worker's registered role (`kvroute agent --role prefill|decode`), else the router's
`--pd-role ID=ROLE` (engines no agent reports on). Only "prefill" workers take prefill legs and only
"decode" workers take decode legs; workers without a role are left out in this mode (a 503 names
the missing pool). The prefill worker is chosen by the router's policy (`--policy`, kv_aware by
default: the index's prefix match and load) among the prefill workers; the decode worker by fewest
requests (`least_loaded`: this router's in-flight count or the engine's running + waiting).

vLLM (a KV connector such as NixlConnector, `--kv-transfer-config`; docs/pd-disaggregation.md):
1. prefill leg: the client's body with `kv_transfer_params` {"do_remote_decode": true,
   "do_remote_prefill": false, remote_* null}, `stream` false, `max_tokens` 1 (and
   `max_completion_tokens` 1 when the client set it), without `stream_options` / `min_tokens` /
   `min_completion_tokens`; its answer is read whole and its `kv_transfer_params` kept. An engine
   that cannot be reached, answers 5xx or returns no `kv_transfer_params` (no connector) is
   skipped for the next prefill candidate; a 4xx answer (a bad request) goes to the client.
2. decode leg: the client's body as sent plus the returned `kv_transfer_params`, streamed or not as
   the client asked, over the decode workers (a failed decode worker is retried on the next one with
   the same parameters: the KV waits on the prefill worker until it is pulled or times out).

SGLang (`--disaggregation-mode prefill|decode`): both legs at once with the same body plus
`bootstrap_host` (the prefill endpoint's host, an IPv6 address in brackets), `bootstrap_port` (its bootstrap server's port:
`--pd-bootstrap-port`, SGLang's default 8998) and `bootstrap_room` (random, 0..2^63-1). The decode
worker's answer goes to the client once the prefill leg has answered without error. A failure of
either leg before the client got a byte tries the pair again with a new room: a failed prefill
worker is replaced by the next prefill candidate, a failed decode worker by the next decode one.

Every leg holds an in-flight ticket from send to answer (`BackendProxy.leg` / `forward`), released
on every path, cancellation included. When every candidate failed the client gets one 502
`backend_unavailable` that says which leg could not be served. Responses carry `x-kvroute-worker`
(the decode worker) and `x-kvroute-prefill-worker`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from aiohttp import web

from kvroute.data_plane.api.errors import error_response
from kvroute.data_plane.cp_link.control_plane_client import KnownWorker
from kvroute.data_plane.decision.policies import Candidate, LeastLoaded
from kvroute.data_plane.http.proxy import BackendProxy, LegAborted, LegAnswer, LegFailed
from kvroute.data_plane.ops.stage_timing import StageClock
from kvroute.data_plane.service.routing import NoWorkersError, RouteDecision, Router
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.roles import DECODE, PREFILL

log = logging.getLogger("kvroute.router.pd")

PROTOCOLS = ("vllm", "sglang")
PREFILL_WORKER_HEADER = "x-kvroute-prefill-worker"
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
_ROOM_LIMIT = 2**63 - 1  # SGLang's bootstrap rooms are non-negative signed 64-bit integers
# The prefill leg asks a vLLM engine to keep the prompt's KV for a remote decode (NixlConnector's request fields).
_VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


class PdRouting:
    def __init__(
        self,
        protocol: str,
        router: Router,
        proxy: BackendProxy,
        roles: Mapping[str, str] | None = None,
        bootstrap_ports: Mapping[str, int] | None = None,
        default_bootstrap_port: int = SGLANG_DEFAULT_BOOTSTRAP_PORT,
        rng: random.Random | None = None,
    ) -> None:
        """`roles`: worker id -> role for workers that register none (static, found by DNS);
        `bootstrap_ports`: worker id -> its SGLang bootstrap port, else `default_bootstrap_port`."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"P/D protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.protocol, self.router, self.proxy = protocol, router, proxy
        self.roles = dict(roles or {})
        self.bootstrap_ports = dict(bootstrap_ports or {})
        self.default_bootstrap_port = default_bootstrap_port
        # The decode leg: fewest requests, over the same fleet, in-flight state and health as the router's.
        self.decode_router = Router(router.control_plane, LeastLoaded(), router.inflight, router.health, router.metrics)
        self._rng = rng or random.Random()
        self._log = RateLimitedLog(log)

    # ------------------------------------------------------------ roles and decisions

    def role_of(self, worker: KnownWorker) -> str:
        return worker.role or self.roles.get(worker.worker_id, "")

    def is_prefill(self, worker: KnownWorker) -> bool:
        return self.role_of(worker) == PREFILL

    def is_decode(self, worker: KnownWorker) -> bool:
        return self.role_of(worker) == DECODE

    def _require(self, model: str, lora_name: str, role: str) -> None:
        known = self.router.control_plane.workers_for(model, lora_name)
        if known and not any(self.role_of(w) == role for w in known):
            raise NoWorkersError(
                f"no {role} worker of model {model!r} is known ({len(known)} workers, none with "
                f"role {role}): in P/D mode workers register a role (`kvroute agent --role {role}`) "
                f"or the router names it (--pd-role ID={role})"
            )

    async def decide_prefill(
        self,
        model: str,
        token_ids: Sequence[int] | None,
        lora_name: str = "",
        cache_salt: str = "",
        session_key: str = "",
        clock: StageClock | None = None,
        explain: bool = False,
    ) -> RouteDecision:
        """The router's policy over the prefill workers (NoWorkersError when there are none)."""
        self._require(model, lora_name, PREFILL)
        return await self.router.decide(
            model,
            token_ids,
            lora_name,
            cache_salt,
            session_key=session_key,
            clock=clock,
            explain=explain,
            eligible=self.is_prefill,
        )

    async def decide_decode(self, model: str, lora_name: str = "") -> RouteDecision:
        """Fewest requests over the decode workers (NoWorkersError when there are none)."""
        self._require(model, lora_name, DECODE)
        return await self.decode_router.decide(model, None, lora_name, eligible=self.is_decode)

    # ------------------------------------------------------------ forwarding

    async def forward(
        self,
        request: web.Request,
        path: str,
        raw: bytes,
        prefill: RouteDecision,
        decode: RouteDecision,
        prompt_tokens: int,
        tail: bytearray | None = None,
        clock: StageClock | None = None,
        started: float | None = None,
    ) -> web.StreamResponse:
        body = json.loads(raw)  # an object: the router parsed it already (http_api.parse_routing_body)
        if self.protocol == "vllm":
            return await self._vllm(request, path, body, prefill, decode, prompt_tokens, tail, clock, started)
        return await self._sglang(request, path, body, prefill, decode, prompt_tokens, tail, clock, started)

    def _attempts(self, ranked: list[Candidate]) -> list[Candidate]:
        limit = self.proxy.max_attempts
        return ranked[:limit] if limit > 0 else ranked

    async def _vllm(
        self,
        request: web.Request,
        path: str,
        body: dict,
        prefill: RouteDecision,
        decode: RouteDecision,
        prompt_tokens: int,
        tail: bytearray | None,
        clock: StageClock | None,
        started: float | None,
    ) -> web.StreamResponse:
        prefill_body = json.dumps(vllm_prefill_body(body)).encode()
        failures = []
        for candidate in self._attempts(prefill.ranked()):
            try:
                answer = await self.proxy.leg(request, path, prefill_body, candidate, prefill, prompt_tokens)
            except LegFailed as exc:
                failures.append(f"{candidate.worker_id}: {exc}")
                self._log.warning(f"prefill:{candidate.worker_id}", "prefill leg on %s failed (%s)", candidate.worker_id, exc)
                continue
            if answer.status >= 400:  # the engine refused the request itself: another worker would too
                return self.proxy.engine_error(answer)
            params = transfer_params(answer.body)
            if params is None:
                failures.append(f"{candidate.worker_id}: answered without kv_transfer_params")
                self._log.warning(
                    f"params:{candidate.worker_id}",
                    "prefill worker %s answered without "
                    "kv_transfer_params: is it started with a KV connector (--kv-transfer-config)?",
                    candidate.worker_id,
                )
                continue
            decode_body = json.dumps({**body, "kv_transfer_params": params}).encode()
            return await self.proxy.forward(
                request,
                path,
                decode_body,
                decode,
                prompt_tokens,
                tail,
                clock,
                started,
                extra_headers={PREFILL_WORKER_HEADER: candidate.worker_id},
            )
        return self._exhausted("prefill", failures)

    async def _sglang(
        self,
        request: web.Request,
        path: str,
        body: dict,
        prefill: RouteDecision,
        decode: RouteDecision,
        prompt_tokens: int,
        tail: bytearray | None,
        clock: StageClock | None,
        started: float | None,
    ) -> web.StreamResponse:
        prefills, decodes = self._attempts(prefill.ranked()), self._attempts(decode.ranked())
        p = d = 0
        failures: list[str] = []
        failed_leg = "prefill"
        while p < len(prefills) and d < len(decodes):
            candidate, decoder = prefills[p], decodes[d]
            legs_body = json.dumps(self.with_bootstrap(body, candidate)).encode()
            prefill_leg = asyncio.create_task(self.proxy.leg(request, path, legs_body, candidate, prefill, prompt_tokens))
            try:
                response = await self.proxy.forward(
                    request,
                    path,
                    legs_body,
                    _only(decode, decoder),
                    prompt_tokens,
                    tail,
                    clock,
                    started,
                    extra_headers={PREFILL_WORKER_HEADER: candidate.worker_id},
                    gate=lambda leg=prefill_leg: self._prefill_answered(leg),
                )
            except LegAborted as aborted:
                if aborted.response is not None:
                    return aborted.response
                failures.append(f"prefill {candidate.worker_id}: {aborted}")
                failed_leg, p = "prefill", p + 1
                continue
            finally:
                prefill_leg.cancel()  # a no-op once it answered; else its ticket is released as it unwinds
                await asyncio.gather(prefill_leg, return_exceptions=True)
            if response.status >= 500 and not response.prepared:  # the decode worker failed before any byte
                failures.append(f"decode {decoder.worker_id}: HTTP {response.status}")
                failed_leg, d = "decode", d + 1
                continue
            return response
        return self._exhausted(failed_leg, failures)

    async def _prefill_answered(self, leg: asyncio.Task[LegAnswer]) -> None:
        """The decode answer's gate: the prefill leg must have answered without error."""
        try:
            answer = await leg
        except LegFailed as exc:
            self._log.warning("prefill-failed", "prefill leg failed (%s): trying the pair again", exc)
            raise LegAborted(str(exc)) from None
        if answer.status >= 400:
            raise LegAborted(f"HTTP {answer.status}", self.proxy.engine_error(answer))

    def with_bootstrap(self, body: dict, prefill: Candidate) -> dict:
        """The body both SGLang legs get: where the decode worker finds the prefill's KV, and its room."""
        host = urlsplit(prefill.endpoint).hostname or ""
        if ":" in host:  # an IPv6 address goes in brackets, as SGLang's load balancer sends it
            host = f"[{host}]"
        return {
            **body,
            "bootstrap_host": host,
            "bootstrap_port": self.bootstrap_ports.get(prefill.worker_id, self.default_bootstrap_port),
            "bootstrap_room": self._rng.randint(0, _ROOM_LIMIT),
        }

    def _exhausted(self, leg: str, failures: list[str]) -> web.Response:
        self._log.warning(f"exhausted:{leg}", "no %s worker could serve the request: %s", leg, "; ".join(failures))
        return error_response(
            f"no {leg} worker could serve the request: all {len(failures)} tried failed (the router's log has the details)",
            502,
            "backend_unavailable",
        )


def vllm_prefill_body(body: dict) -> dict:
    """The prefill leg's body (module docstring, vLLM step 1)."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["kv_transfer_params"] = dict(_VLLM_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def transfer_params(answer: bytes) -> dict | None:
    """The `kv_transfer_params` object of a prefill answer, or None (no connector, or not JSON)."""
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None


def _only(decision: RouteDecision, candidate: Candidate) -> RouteDecision:
    """`decision` narrowed to one worker (one leg of one attempt)."""
    return dataclasses.replace(decision, worker_id=candidate.worker_id, endpoint=candidate.endpoint, candidates=[candidate])


def parse_roles(text: str) -> dict[str, str]:
    """`ID=ROLE,...` (roles prefill or decode) -> {worker id: role}; ValueError says what is wrong."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        worker, sep, role = item.partition("=")
        if not sep or not worker.strip() or role.strip() not in (PREFILL, DECODE):
            raise ValueError(f"expected ID=prefill or ID=decode, got {item!r}")
        out[worker.strip()] = role.strip()
    return out
