"""gRPC `kvroute.v1.Router`: the same decision as POST /v1/route (nothing is forwarded), for
applications that send the request to the engine themselves.

Input is one of `prompt` (tokenized like /v1/completions), `token_ids`, or chat `messages`
(content or content parts, and `tools`, rendered with the model's chat template, generation
prompt added, like /v1/chat/completions); `route_input` hands it to the request preparation HTTP
uses too (`request_prep.py`). `session_id` is the session policy's key (HTTP: x-session-id).
With `reserve`, the decision counts as in flight until `PrefillDone`/`Release` or its TTL
(`app_reservations.py`).
Bad input -> INVALID_ARGUMENT (also a request that does not parse, e.g. a string that is not valid
UTF-8: `add_router_service` registers the service through `kvroute.grpc_requests`, not with grpc's
own deserializer, which would answer UNKNOWN), unknown model -> NOT_FOUND, no worker known -> UNAVAILABLE, an
unexpected exception -> INTERNAL with a generic message and the traceback in the log.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import grpc
from opentelemetry import propagate, trace

from kvroute.data_plane.grpc.app_reservations import AppReservations, TooManyReservations
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.ops.traffic_capture import TrafficCapture
from kvroute.data_plane.prepare.request_prep import PrepareError, RequestPreparer, RouteInput
from kvroute.data_plane.service.routing import NoWorkersError, RouteDecision, Router
from kvroute.grpc_requests import add_servicer
from kvroute.telemetry import span, tracing_active
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

tracer = trace.get_tracer("kvroute.router")
# PrepareError.kind -> status
_PREPARE_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "model_not_found": grpc.StatusCode.NOT_FOUND,
    "too_long": grpc.StatusCode.INVALID_ARGUMENT,
}
log = logging.getLogger("kvroute.router.grpc")


def _counted(method: str, behavior: Callable[..., Awaitable], metrics: RouterMetrics) -> Callable[..., Awaitable]:
    """`behavior` counted in kvroute_router_grpc_requests_total by status code, and timed."""
    requests, seconds = metrics.grpc_requests, metrics.grpc_request_seconds.labels(method)

    async def counted(request, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        code = "UNKNOWN"  # an exception gRPC itself turns into UNKNOWN
        try:
            response = await behavior(request, context)
            code = "OK"
            return response
        except grpc.aio.AbortError:
            code = context.code().name if context.code() is not None else "UNKNOWN"
            raise
        finally:
            requests.labels(method, code).inc()
            seconds.observe(time.perf_counter() - started)

    return counted


def add_router_service(service: RouterGrpcService, server: grpc.aio.Server) -> None:
    """`add_RouterServicer_to_server`, but a request that does not parse is INVALID_ARGUMENT (not UNKNOWN),
    and every call is counted by status code (an unparseable one as INVALID_ARGUMENT)."""
    metrics = service.router.metrics
    descriptor = pb.DESCRIPTOR.services_by_name["Router"]
    counted = SimpleNamespace(**{m.name: _counted(m.name, getattr(service, m.name), metrics) for m in descriptor.methods})
    add_servicer(
        server, descriptor, counted, on_unparseable=lambda method: metrics.grpc_requests.labels(method, "INVALID_ARGUMENT").inc()
    )


class RouterGrpcService(pb_grpc.RouterServicer):
    def __init__(
        self, router: Router, preparer: RequestPreparer, reservations: AppReservations, capture: TrafficCapture | None = None
    ) -> None:
        self.router, self.preparer = router, preparer
        self.reservations = reservations
        self.capture = capture  # a Route call is a decision for a request served elsewhere: record it too

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)} if tracing_active() else {}
        with span(tracer, "kvroute.v1.Router/Route", context=propagate.extract(carrier), kind=trace.SpanKind.SERVER):
            try:
                return await self._route(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("unexpected error in Router/Route")
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    "the router failed to handle the request (an internal error; its log has the details)",
                )

    async def _route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        arrived = self.capture.sample_arrival() if self.capture else None
        try:
            prepared = await self.preparer.prepare(route_input(request))
        except PrepareError as exc:
            await context.abort(_PREPARE_STATUS[exc.kind], str(exc))
        try:
            decision = await self.router.decide(
                prepared.model,
                prepared.token_ids,
                prepared.lora_name,
                prepared.cache_salt,
                session_key=prepared.session_key,
                explain=request.explain,
            )
        except NoWorkersError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if self.capture and arrived is not None:  # RouteRequest has no output budget: output_length 0
            self.capture.record(arrived, prepared.token_ids, 0, prepared.model, prepared.lora_name, prepared.cache_salt)
        response = to_route_response(decision)
        if request.reserve:
            try:
                rid, ttl_s = self.reservations.reserve(decision, request.reservation_ttl_ms / 1000)
            except TooManyReservations as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            response.reservation_id, response.reservation_ttl_ms = rid, round(ttl_s * 1000)
        return response

    async def PrefillDone(self, request: pb.ReservationRef, context: grpc.aio.ServicerContext) -> pb.ReservationState:
        await self._check_issued(request.reservation_id, context)
        return pb.ReservationState(
            reservation_id=request.reservation_id, was_held=self.reservations.prefill_done(request.reservation_id)
        )

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReservationState:
        await self._check_issued(request.reservation_id, context)
        outcome = (
            pb.RequestOutcome.Name(request.outcome).removeprefix("REQUEST_OUTCOME_").lower()
            if request.outcome in pb.RequestOutcome.values()
            else "unspecified"
        )
        return pb.ReservationState(
            reservation_id=request.reservation_id, was_held=self.reservations.release(request.reservation_id, outcome)
        )

    async def _check_issued(self, rid: int, context: grpc.aio.ServicerContext) -> None:
        if not self.reservations.issued(rid):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"reservation {rid} was not issued by this router (reservations live on the router that answered the Route call)",
            )


def route_input(request: pb.RouteRequest) -> RouteInput:
    """What request preparation takes, from a RouteRequest (its `input` oneof)."""
    kind = request.WhichOneof("input")
    parsed = RouteInput(
        request.model,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
        missing_prompt="one of 'prompt', 'token_ids' or 'messages' is required",
    )
    if kind == "prompt":
        parsed.kind, parsed.prompt = "completions", request.prompt
    elif kind == "token_ids":
        parsed.prompt = list(request.token_ids.ids) or None
        parsed.missing_prompt = "'token_ids' must not be empty"
    elif kind == "messages":
        parsed.kind = "chat"
        parsed.messages = [_chat_message(m) for m in request.messages.messages]
        parsed.tools = [_tool(t) for t in request.tools] or None
    if request.tools and kind != "messages":
        raise PrepareError("'tools' are rendered into chat messages only: give 'messages'", param="tools")
    parsed.session_key = request.session_id
    return parsed


def _chat_message(m: pb.ChatMessage) -> dict:
    """The OpenAI message the HTTP path would have parsed: content as a string or as parts."""
    if m.parts and m.content:
        raise PrepareError("a ChatMessage has either 'content' or 'parts', not both", param="messages")
    message: dict = {
        "role": m.role,
        "content": [{"type": p.type or "text", "text": p.text} for p in m.parts] if m.parts else m.content,
    }
    if m.name:
        message["name"] = m.name
    return message


def _tool(t: pb.ToolDefinition) -> dict:
    function: dict = {"name": t.name}
    if t.description:
        function["description"] = t.description
    if t.parameters_json:
        try:
            function["parameters"] = json.loads(t.parameters_json)
        except ValueError as exc:
            raise PrepareError(f"tool {t.name!r}: 'parameters_json' is not valid JSON ({exc})", param="tools") from None
        except RecursionError:  # json recurses per level: arrays nested past Python's limit
            raise PrepareError(f"tool {t.name!r}: 'parameters_json' nests arrays and objects too deeply", param="tools") from None
    return {"type": t.type or "function", "function": function}


def to_route_response(d: RouteDecision) -> pb.RouteResponse:
    return pb.RouteResponse(
        worker_id=d.worker_id,
        endpoint=d.endpoint,
        prompt_tokens=d.prompt_tokens,
        cached_tokens=d.cached_tokens,
        policy=d.policy,
        fail_open=d.fail_open,
        workers=[
            pb.WorkerScore(
                worker_id=c.worker_id,
                endpoint=c.endpoint,
                cached_tokens=c.cached_tokens,
                score=d.scores.get(c.worker_id, 0.0),
                inflight_requests=c.inflight_requests,
                load=pb.WorkerLoad(
                    running_requests=c.running_requests,
                    waiting_requests=c.waiting_requests,
                    kv_usage=c.kv_usage,
                    kv_capacity_tokens=c.kv_capacity_tokens,
                ),
            )
            for c in d.candidates
        ],
        explanation=to_explanation(d) if d.explanation is not None else None,
    )


def to_explanation(d: RouteDecision) -> pb.DecisionExplanation:
    e = d.explanation_json()
    return pb.DecisionExplanation(
        policy=e["policy"],
        reason=e["reason"],
        params=e["params"],
        fail_open_reason=e["fail_open_reason"],
        workers=[
            pb.CandidateExplanation(
                worker_id=w["worker_id"],
                cost=w["cost"],
                terms=w["terms"],
                credited_tokens=w["credited_tokens"],
                within_load_bound=w["within_load_bound"],
                in_spread_pool=w["in_spread_pool"],
                index=pb.IndexMatch(**w["index"]) if w["index"] is not None else None,
            )
            for w in e["workers"]
        ],
    )
