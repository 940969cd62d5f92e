"""Forwarding a request to the chosen engine (the last step of a request's path).

`BackendProxy.forward(request, path, body, decision, prompt_tokens)`:
- sends the client's *original* body bytes to `<endpoint><path>` (`upstream.py`: pooled keep-alive
  connections per engine) with the client's headers
  (minus hop-by-hop ones, and minus Authorization unless `forward_authorization`) and a W3C `traceparent` injected inside a `kvroute.proxy` client span;
- waits for the backend's first body byte, then streams the rest through chunk by chunk (SSE, or
  any body without a Content-Length), or, for a body with a Content-Length up to 1 MiB (a
  non-streamed completion), reads it whole and relays it in one write; `x-kvroute-worker:
  <worker_id>` on the response;
- a backend that refuses the connection, returns 5xx, or fails before its first byte is retried
  on the decision's next-best worker (`max_attempts` in all, default: every candidate, so no
  error reaches the client while some worker is healthy); nothing reached the client yet,
  so that is invisible to it. A failed worker is reported to `BackendHealth`, which later
  decisions read (it sits out a cooldown unless nothing else is known). If every attempt fails
  the client gets the last 5xx or a 502 that names no engine address (those go to the log, at most one line per worker / kind every 5 s);
- an engine's error read whole (status >= 400 with a Content-Length up to 1 MiB, the last 5xx
  included) goes to the client with its status and message as OpenAI's error object
  (`http_errors.engine_error_body`); a streamed answer is relayed as it is;
- keeps the in-flight state honest (`RouterInflight`: this router's own count and its reservation
  in the control plane): in flight from send to finish with the prompt's block keys at that
  worker's block size, prefill pending until the first byte, always released in `finally`;
- pins the request to a data-parallel rank with `X-data-parallel-rank` when the worker is one
  rank of a DP engine (vLLM and SGLang honour the header);
- given a `tail` bytearray, leaves the last >= 16 KiB of the body in it (traffic capture reads
  `usage` from there instead of parsing every chunk);
- given `extra_headers`, adds them to the client's response; given a `gate`, awaits it once the
  backend's first bytes are in, before any reaches the client (prefill/decode disaggregation:
  the decode answer waits for its prefill leg; the gate raises `LegAborted` to give the attempt up).

`BackendProxy.leg(request, path, body, candidate, decision, prompt_tokens)` is one exchange read
whole with the same headers, health and in-flight bookkeeping (a P/D prefill leg): `LegAnswer`, or
`LegFailed` when the engine is unreachable or answers 5xx (its worker is reported to `BackendHealth`).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import Counter

from kvroute.data_plane.api.errors import engine_error_body, error_response
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import Candidate
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.http.upstream import BadEndpoint, UpstreamPool, UpstreamResponse
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.ops.stage_timing import StageClock
from kvroute.data_plane.service.routing import RouteDecision
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.telemetry import span, tracing_active

log = logging.getLogger("kvroute.router.proxy")
tracer = trace.get_tracer("kvroute.router")

WORKER_HEADER = "x-kvroute-worker"
DP_RANK_HEADER = "X-data-parallel-rank"
# A response with a Content-Length up to this is read whole before it is relayed (a non-streamed
# completion): one write instead of a chunk loop, measured ~0.1 ms less per request.
WHOLE_BODY_BYTES = 1 << 20
TAIL_BYTES = 16384  # enough for a response's trailing usage object / an SSE stream's last chunks
# Not forwarded in either direction: per-connection headers, framing we redo, and trace context we replace.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "traceparent",
        "tracestate",
        "x-data-parallel-rank",
    }
)


class _Failed(Exception):
    """This attempt failed before anything reached the client (safe to retry elsewhere)."""

    def __init__(self, reason: str, upstream: UpstreamResponse | None = None, body: bytes = b"") -> None:
        super().__init__(reason)
        self.upstream, self.body = upstream, body


class LegFailed(Exception):
    """A leg's engine could not be reached or answered 5xx (its worker was reported as failed)."""


class LegAborted(Exception):
    """Raised by a `gate`: give this attempt up before the client saw anything; `response`, when set,
    is what the client gets instead (else the caller decides)."""

    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.response = response


@dataclass(slots=True)
class LegAnswer:
    """An engine's answer read whole (status < 500)."""

    worker_id: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class BackendProxy:
    def __init__(
        self,
        inflight: RouterInflight,
        health: BackendHealth,
        metrics: RouterMetrics,
        max_attempts: int = 0,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 1800.0,
        forward_authorization: bool = False,
        engine_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.inflight, self.health, self.metrics = inflight, health, metrics
        # The client's Authorization is the router's API key unless engines take the same (--forward-authorization).
        self._dropped = _HOP_HEADERS if forward_authorization else _HOP_HEADERS | {"authorization"}
        self._engine_ssl = engine_ssl  # https:// engines: verified with --engine-tls-ca (None: system CAs)
        self.max_attempts = max_attempts  # 0 = every candidate
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._pool: UpstreamPool | None = None
        self._log = RateLimitedLog(log)  # every engine down = a few lines per request otherwise
        self._served: dict[tuple[str, str], Counter] = {}

    async def open(self) -> None:
        self._pool = UpstreamPool(*self._timeouts, ssl_context=self._engine_ssl)

    async def close(self) -> None:
        if self._pool:
            await self._pool.close()
            self._pool = None

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        decision: RouteDecision,
        prompt_tokens: int,
        tail: bytearray | None = None,
        clock: StageClock | None = None,
        started: float | None = None,
        extra_headers: Mapping[str, str] | None = None,
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> web.StreamResponse:
        """`started` (time.perf_counter() at the request's arrival) times the first byte of a streamed answer."""
        ranked = decision.ranked()
        attempts = ranked[: self.max_attempts] if self.max_attempts > 0 else ranked
        failures = []
        for i, candidate in enumerate(attempts):
            last = i == len(attempts) - 1
            try:
                return await self._attempt(
                    request, path, body, decision, candidate, prompt_tokens, i, last, tail, clock, started, extra_headers, gate
                )
            except _Failed as failed:
                self.metrics.backend_errors.labels(candidate.worker_id).inc()
                if self.health.failed(candidate.worker_id):
                    self.metrics.sit_outs.labels(candidate.worker_id).inc()
                failures.append(f"{candidate.worker_id}: {failed}")
                if not last:
                    self.metrics.retries.inc()
                    self._log.warning(
                        f"retry:{candidate.worker_id}",
                        "backend %s failed before its first byte (%s); retrying on %s",
                        candidate.worker_id,
                        failed,
                        attempts[i + 1].worker_id,
                    )
                elif failed.upstream is not None:  # the last attempt's own 5xx goes to the client as is
                    self._log.warning(
                        f"last:{candidate.worker_id}", "backend %s answered %s; no attempts left", candidate.worker_id, failed
                    )
                    return self._replay_error(failed, candidate)
        self._log.warning("exhausted", "no backend could serve the request: %s", "; ".join(failures))
        down = self.health.down()
        checks = ", as every one fails its health checks" if down and all(c.worker_id in down for c in attempts) else ""
        return error_response(
            f"no backend could serve the request: all {len(failures)} workers tried failed{checks} "
            "(the router's log has the details)",
            502,
            "backend_unavailable",
        )

    async def leg(
        self, request: web.Request, path: str, body: bytes, candidate: Candidate, decision: RouteDecision, prompt_tokens: int
    ) -> LegAnswer:
        """One exchange with `candidate`, read whole (module docstring); raises LegFailed."""
        assert self._pool is not None, "BackendProxy.open() was not called"
        worker = candidate.worker_id
        ticket = self.inflight.start(
            worker,
            prompt_tokens - candidate.cached_tokens,
            decision.chains.get(candidate.block_size, ()),
            candidate.block_size,
            prompt_tokens,
        )
        upstream = None
        try:
            with span(tracer, "kvroute.proxy", kind=trace.SpanKind.CLIENT) as proxy_span:
                if proxy_span.is_recording():
                    proxy_span.set_attribute("kvroute.worker_id", worker)
                    proxy_span.set_attribute("url.full", candidate.endpoint + path)
                try:
                    upstream = await self._pool.post(
                        candidate.endpoint + path, body, self._backend_headers(request, decision.dp_ranks.get(worker))
                    )
                    answer = await upstream.read()
                except (aiohttp.ClientError, OSError, TimeoutError, BadEndpoint) as exc:
                    proxy_span.record_exception(exc)
                    self._leg_failed(worker)
                    raise LegFailed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
                proxy_span.set_attribute("http.response.status_code", upstream.status)
                if upstream.status >= 500:
                    self._leg_failed(worker)
                    raise LegFailed(f"HTTP {upstream.status}")
                self._count(decision.policy, decision.model, worker, prompt_tokens, candidate.cached_tokens)
                return LegAnswer(worker, upstream.status, upstream.reason or "", list(upstream.headers), answer)
        finally:
            if upstream is not None:
                upstream.release()
            self.inflight.finish(ticket)

    def _leg_failed(self, worker: str) -> None:
        self.metrics.backend_errors.labels(worker).inc()
        if self.health.failed(worker):
            self.metrics.sit_outs.labels(worker).inc()

    def engine_error(self, answer: LegAnswer) -> web.Response:
        """A leg's error answer (status >= 400) as the client gets it: OpenAI's error object."""
        rewritten = engine_error_body(answer.status, answer.body, answer.headers)
        response = web.Response(status=answer.status, reason=answer.reason, body=answer.body if rewritten is None else rewritten)
        for name, value in answer.headers:
            if name.lower() not in _HOP_HEADERS:
                response.headers.add(name, value)
        response.headers[WORKER_HEADER] = answer.worker_id
        if rewritten is not None:
            response.headers["Content-Type"] = "application/json"
        return response

    def _replay_error(self, failed: _Failed, candidate: Candidate) -> web.Response:
        assert failed.upstream is not None
        return self._engine_error(failed.upstream, failed.body, candidate.worker_id)

    def _engine_error(self, upstream: UpstreamResponse, body: bytes, worker_id: str) -> web.Response:
        """An engine's error, read whole: its status, its message in OpenAI's error object."""
        return self.engine_error(LegAnswer(worker_id, upstream.status, upstream.reason, list(upstream.headers), body))

    @staticmethod
    def _copy_headers(
        upstream: UpstreamResponse, response: web.StreamResponse, worker_id: str, extra: Mapping[str, str] | None = None
    ) -> None:
        for name, value in upstream.headers:
            if name.lower() not in _HOP_HEADERS:
                response.headers.add(name, value)
        response.headers[WORKER_HEADER] = worker_id
        if extra:
            response.headers.update(extra)

    def _backend_headers(self, request: web.Request, dp_rank: int | None) -> dict[str, str]:
        dropped = self._dropped
        headers = {name: value for name, value in request.headers.items() if name.lower() not in dropped}
        headers.setdefault("Content-Type", "application/json")
        if dp_rank is not None:
            headers[DP_RANK_HEADER] = str(dp_rank)
        if tracing_active():
            propagate.inject(headers)  # W3C traceparent of the current (kvroute.proxy) span
        return headers

    def _count(self, policy: str, model: str, worker: str, prompt_tokens: int, cached_tokens: int) -> None:
        served = self._served.get((policy, worker))
        if served is None:  # labels() costs a few us per call: keep the child per (policy, worker)
            served = self._served[(policy, worker)] = self.metrics.proxied_requests.labels(policy, worker)
        served.inc()
        if prompt_tokens or cached_tokens:
            tokens = self.metrics.tokens_of(model)
            tokens.prompt.inc(prompt_tokens)
            tokens.predicted_cached.inc(cached_tokens)

    async def _attempt(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        decision: RouteDecision,
        candidate: Candidate,
        prompt_tokens: int,
        attempt: int,
        last: bool,
        tail: bytearray | None = None,
        clock: StageClock | None = None,
        started: float | None = None,
        extra_headers: Mapping[str, str] | None = None,
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> web.StreamResponse:
        assert self._pool is not None, "BackendProxy.open() was not called"
        worker = candidate.worker_id
        url = candidate.endpoint + path
        ticket = self.inflight.start(
            worker,
            prompt_tokens - candidate.cached_tokens,
            decision.chains.get(candidate.block_size, ()),
            candidate.block_size,
            prompt_tokens,
        )
        with span(tracer, "kvroute.proxy", kind=trace.SpanKind.CLIENT) as proxy_span:
            if proxy_span.is_recording():
                proxy_span.set_attribute("kvroute.worker_id", worker)
                proxy_span.set_attribute("kvroute.attempt", attempt)
                proxy_span.set_attribute("url.full", url)
            upstream = None
            try:
                try:
                    upstream = await self._pool.post(url, body, self._backend_headers(request, decision.dp_ranks.get(worker)))
                    if clock is not None:
                        clock.mark("connect")
                    proxy_span.set_attribute("http.response.status_code", upstream.status)
                    if upstream.status >= 500:
                        raise _Failed(f"HTTP {upstream.status}", upstream, await upstream.read() if last else b"")
                    first = await upstream.readany()  # a backend dying here is still retryable
                    whole = upstream.content_length is not None and upstream.content_length <= WHOLE_BODY_BYTES
                    if whole:  # a plain JSON answer: read it all (still nothing sent, still retryable)
                        first += await upstream.read()
                except (aiohttp.ClientError, OSError, TimeoutError, BadEndpoint) as exc:
                    proxy_span.record_exception(exc)
                    raise _Failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
                if gate is not None:  # LegAborted passes up to the caller: nothing was sent yet
                    await gate()
                if not whole:  # a whole answer ends here: its release (finally) settles the prefill too,
                    self.inflight.first_token(ticket)  # one message to the control plane instead of two
                self._count(decision.policy, decision.model, worker, prompt_tokens, candidate.cached_tokens)
                if whole:
                    # Handed to aiohttp whole: one write with its Content-Length, no chunk loop.
                    if upstream.status >= 400:
                        response = self._engine_error(upstream, first, worker)
                        if extra_headers:
                            response.headers.update(extra_headers)
                    else:
                        response = web.Response(status=upstream.status, reason=upstream.reason, body=first)
                        self._copy_headers(upstream, response, worker, extra_headers)
                    if clock is not None:
                        clock.mark("first_byte")
                    if tail is not None:
                        tail += first[-TAIL_BYTES:]
                    return response
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                self._copy_headers(upstream, response, worker, extra_headers)
                await response.prepare(request)
                chunk = first
                while chunk:
                    await response.write(chunk)
                    if chunk is first:
                        if started is not None:
                            self.metrics.ttft_seconds.observe(time.perf_counter() - started)
                        if clock is not None:
                            clock.mark("first_byte")
                    if tail is not None:  # amortized O(chunk): trimmed only once it doubles
                        tail += chunk
                        if len(tail) > 2 * TAIL_BYTES:
                            del tail[:-TAIL_BYTES]
                    chunk = await upstream.readany()
                await response.write_eof()
                return response
            except _Failed as failed:
                proxy_span.set_status(trace.StatusCode.ERROR, str(failed))
                raise
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # Mid-stream (backend died, or the client went away): the client already has bytes, so
                # its connection is closed without the final chunk; a clean end would hide the truncation.
                proxy_span.record_exception(exc)
                proxy_span.set_status(trace.StatusCode.ERROR, "stream interrupted")
                log.warning("stream from %s interrupted after the first byte: %r", worker, exc)
                if request.transport is not None:
                    request.transport.close()
                return response
            finally:
                if upstream is not None:
                    upstream.release()
                self.inflight.finish(ticket)
