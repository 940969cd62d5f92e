"""`kvroute epp`: the router's decision as a Gateway API Inference Extension endpoint picker.

An Envoy ext_proc server (`envoy.service.ext_proc.v3.ExternalProcessor/Process`, one bidi stream
per HTTP request) speaking GAIE's endpoint-picker protocol (the inference extension's
docs/proposals/004-endpoint-picker-protocol): Envoy sends the request's headers and body, the
picker answers with the chosen engine as the `x-gateway-destination-endpoint` header and the same
value under `x-gateway-destination-endpoint` in the `envoy.lb` dynamic metadata, and Envoy sends
the request there itself. The decision is the router's (`routing_service.py`): the same body
parsing (`api/body.py`), request preparation, block keys, control-plane query and
policy, so for the same request and fleet state it picks what `POST /v1/route` answers.

Per stream (body modes from the first message's protocol_config, else --body-mode; NONE: decided
on the headers; Envoy's plain STREAMED is refused, it cannot carry a body-based decision):
    request headers   -> buffered mode: CONTINUE at once; streamed (FULL_DUPLEX_STREAMED): held
    request body      -> chunks accumulated until end_of_stream, then parsed and decided:
                         buffered: the body response carries the header and the metadata;
                         streamed: the held headers response carries them, then the body is sent
                         back (Envoy forwards only what the processor returns in that mode)
    response headers  -> the served endpoint (`envoy.lb` / `x-gateway-destination-endpoint-served`)
                         is read back: a request Envoy sent to a fallback counts there
    response body/end -> the request's in-flight entry ends (also when Envoy closes the stream)

From the first response on, the request is in this picker's `RouterInflight` exactly as a proxied
request is in a router's: pending prefill until the first response body byte (the response headers
when Envoy sends no response body), a speculative holder of its prompt blocks, announced to other
routers over the router session. The subset hint (`envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset` in the request's metadata) restricts the candidates.
ImmediateResponse: 503 when no endpoint is eligible, 429 when a sheddable request (its
`x-gateway-inference-objective` is one of --sheddable-objectives) finds every candidate at
--saturation-load, 400/404/413 for a request that cannot be routed (OpenAI error JSON), and for an
internal error 500 under FailClose or, under FailOpen, no destination at all (Envoy's own load
balancer picks, and a destination header the client sent is removed), as the InferencePool's
failureMode says. gRPC health serves GAIE's `liveness` and `readiness` (and the ext_proc service);
--metrics-port serves the router's /metrics, /health and /ready.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvroute.bad_request import BadRequest
from kvroute.data_plane.api.body import error_object, parse_routing_body
from kvroute.data_plane.cp_link.inflight import InflightTicket
from kvroute.data_plane.decision.policies import request_load
from kvroute.data_plane.prepare.request_prep import PrepareError
from kvroute.data_plane.service.routing import NoWorkersError, RouteDecision
from kvroute.data_plane.service.routing_service import RoutingService

log = logging.getLogger("kvroute.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
DP_RANK_HEADER = "x-data-parallel-rank"  # as the router's proxy sends it to a data-parallel worker
BODY_ECHO_CHUNK = 64 * 1024  # streamed mode: the body goes back to Envoy in pieces of this size
_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
_BUFFERED_MODES = (_BodyMode.Value("BUFFERED"), _BodyMode.Value("BUFFERED_PARTIAL"))
_FULL_DUPLEX = _BodyMode.Value("FULL_DUPLEX_STREAMED")
_STREAMED, _NO_BODY = _BodyMode.Value("STREAMED"), _BodyMode.Value("NONE")
_STREAMED_REFUSED = (
    "the ext_proc filter's request_body_mode is STREAMED: Envoy sends the request headers upstream "
    "before the body, so a decision made from the body cannot reach it; use FULL_DUPLEX_STREAMED "
    "(GAIE's) or BUFFERED"
)
_PREPARE_STATUS = {
    "invalid": (400, None),
    "model_not_found": (404, "model_not_found"),
    "too_long": (400, "context_length_exceeded"),
}


def host_port(endpoint: str) -> str:
    """A worker's endpoint URL as GAIE names endpoints: <ip:port>."""
    return urlsplit(endpoint).netloc if "//" in endpoint else endpoint


def _header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _headers_of(message: ext.HttpHeaders) -> dict[str, str]:
    return {
        h.key.lower(): (h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
        for h in message.headers.headers
    }


def _metadata_value(msg: ext.ProcessingRequest, namespace: str, key: str):
    """A value from the request's metadata_context (None when absent)."""
    if not msg.HasField("metadata_context") or namespace not in msg.metadata_context.filter_metadata:
        return None
    fields = msg.metadata_context.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return value.string_value
    return None


def immediate(status: int, message: str, code: str | None = None, param: str | None = None) -> ext.ProcessingResponse:
    """An answer Envoy sends to the client in place of forwarding: OpenAI's error object."""
    body = json.dumps(error_object(message, status, code, param)).encode()
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            body=body,
            details=f"kvroute_epp_{status}",
            headers=ext.HeaderMutation(set_headers=[_header_option("content-type", "application/json")]),
        )
    )


# ---------------------------------------------------------------------------- one request


@dataclass(slots=True)
class Pick:
    """What the picker tells Envoy: the endpoints (chosen first), or nothing (fail open)."""

    endpoints: list[str] = field(default_factory=list)
    headers: list[base_pb2.HeaderValueOption] = field(default_factory=list)
    decision: RouteDecision | None = None

    def common(self, body_length: int | None = None) -> ext.CommonResponse:
        headers = list(self.headers)
        if body_length is not None:  # the body is sent back in streamed mode: its length is ours to state
            headers.append(_header_option("content-length", str(body_length)))
        # No pick (FailOpen): a destination header the client sent itself must not steer Envoy.
        removed = [] if self.endpoints else [DESTINATION]
        return ext.CommonResponse(
            header_mutation=ext.HeaderMutation(set_headers=headers, remove_headers=removed),
            clear_route_cache=bool(self.endpoints),
        )

    def metadata(self) -> struct_pb2.Struct | None:
        if not self.endpoints:
            return None
        meta = struct_pb2.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: ",".join(self.endpoints)}})
        return meta


@dataclass(slots=True)
class _Exchange:
    """One HTTP request as the picker follows it along its stream."""

    buffered: bool
    response_full_duplex: bool
    body_sent: bool = True  # False: Envoy's request_body_mode is NONE, the headers are all there is
    response_body_sent: bool = True  # False: response_body_mode NONE, the response headers end the prefill
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: list[str] | None = None
    pick: Pick | None = None
    ticket: InflightTicket | None = None
    first_byte_seen: bool = False


class EndpointPicker(ext_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        service: RoutingService,
        *,
        buffered: bool = False,
        fail_open: bool = False,
        max_body_bytes: int = 4 * 1024 * 1024,
        fallback_endpoints: int = 0,
        sheddable_objectives: Iterable[str] = (),
        saturation_load: int = 0,
    ) -> None:
        self.service = service
        self.buffered, self.fail_open, self.max_body_bytes = buffered, fail_open, max_body_bytes
        self.fallback_endpoints = fallback_endpoints
        self.sheddable = frozenset(sheddable_objectives)
        self.saturation_load = saturation_load
        self._policy_reads_tokens = service.policy.needs.tokens

    async def Process(
        self, request_iterator: AsyncIterator[ext.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext.ProcessingResponse]:
        exchange: _Exchange | None = None
        try:
            async for msg in request_iterator:
                if exchange is None:
                    exchange = self._exchange(msg)
                    if exchange is None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _STREAMED_REFUSED)
                for response in await self._handle(exchange, msg):
                    yield response
                    if response.HasField("immediate_response"):
                        return
        finally:
            if exchange is not None and exchange.ticket is not None:
                self.service.inflight.finish(exchange.ticket)  # Envoy ends the stream with the request

    def _exchange(self, first: ext.ProcessingRequest) -> _Exchange | None:
        """Body modes from the first message's protocol_config (recent Envoy sends it), else the flag;
        None for Envoy's plain STREAMED request body mode, which cannot carry a body-based decision."""
        if first.HasField("protocol_config"):
            config = first.protocol_config
            if config.request_body_mode == _STREAMED:
                return None
            return _Exchange(
                buffered=config.request_body_mode in _BUFFERED_MODES,
                response_full_duplex=config.response_body_mode == _FULL_DUPLEX,
                body_sent=config.request_body_mode != _NO_BODY,
                response_body_sent=config.response_body_mode != _NO_BODY,
            )
        # Without protocol_config: streamed is GAIE's configuration (response bodies full duplex too);
        # buffered is taken as a filter that does not send response bodies.
        return _Exchange(buffered=self.buffered, response_full_duplex=not self.buffered, response_body_sent=not self.buffered)

    async def _handle(self, ex: _Exchange, msg: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if ex.subset is None and kind in ("request_headers", "request_body", "request_trailers"):
            subset = _metadata_value(msg, SUBSET_NAMESPACE, SUBSET_KEY)
            if subset is not None:
                ex.subset = [subset] if isinstance(subset, str) else subset
        if kind == "request_headers":
            ex.headers = _headers_of(msg.request_headers)
            if msg.request_headers.end_of_stream or not ex.body_sent:  # no body (e.g. GET /v1/models): on load
                pick = await self._pick(ex, bodiless=True)
                return (
                    [pick]
                    if isinstance(pick, ext.ProcessingResponse)
                    else [self._respond(pick, "request_headers", pick.common())]
                )
            if ex.buffered:
                return [ext.ProcessingResponse(request_headers=ext.HeadersResponse())]
            return []  # streamed: the headers response waits for the decision
        if kind == "request_body":
            ex.body += msg.request_body.body
            if len(ex.body) > self.max_body_bytes:
                return [
                    immediate(
                        413,
                        f"the request body is larger than this endpoint picker accepts "
                        f"({self.max_body_bytes} bytes; see --max-body-bytes)",
                        "request_too_large",
                    )
                ]
            if ex.pick is not None:  # buffered with trailers: the body part already decided on
                return [ext.ProcessingResponse(request_body=ext.BodyResponse())]
            if not msg.request_body.end_of_stream and not ex.buffered:
                return []
            # Buffered modes send the body in one message (BUFFERED_PARTIAL: what fit in Envoy's buffer).
            return await self._decided(ex, body_ends=msg.request_body.end_of_stream)
        if kind == "request_trailers":
            out = [] if ex.pick is not None else await self._decided(ex, body_ends=False)
            if out and out[-1].HasField("immediate_response"):
                return out
            return [*out, ext.ProcessingResponse(request_trailers=ext.TrailersResponse())]
        if kind == "response_headers":
            served = _metadata_value(msg, LB_NAMESPACE, SERVED)
            self._served(ex, served if served is not None else _headers_of(msg.response_headers).get(SERVED))
            if not ex.response_body_sent:  # the first byte will not be seen: the response's start is the nearest
                self._first_byte(ex)
            if msg.response_headers.end_of_stream:
                self._finish(ex)
            return [ext.ProcessingResponse(response_headers=ext.HeadersResponse())]
        if kind == "response_body":
            self._first_byte(ex)
            if msg.response_body.end_of_stream:
                self._finish(ex)
            if ex.response_full_duplex:  # the processor owns the body in this mode: pass it on as it came
                return [
                    ext.ProcessingResponse(
                        response_body=ext.BodyResponse(
                            response=ext.CommonResponse(
                                body_mutation=ext.BodyMutation(
                                    streamed_response=ext.StreamedBodyResponse(
                                        body=msg.response_body.body, end_of_stream=msg.response_body.end_of_stream
                                    )
                                )
                            )
                        )
                    )
                ]
            return [ext.ProcessingResponse(response_body=ext.BodyResponse())]
        if kind == "response_trailers":
            self._finish(ex)
            return [ext.ProcessingResponse(response_trailers=ext.TrailersResponse())]
        return []

    async def _decided(self, ex: _Exchange, body_ends: bool) -> list[ext.ProcessingResponse]:
        """The body is complete: decide, and answer in the stream's mode."""
        pick = await self._pick(ex)
        if isinstance(pick, ext.ProcessingResponse):
            return [pick]
        if ex.buffered:
            return [self._respond(pick, "request_body", pick.common())]
        body = bytes(ex.body)
        out = [self._respond(pick, "request_headers", pick.common(len(body)))]
        pieces = [body[i : i + BODY_ECHO_CHUNK] for i in range(0, len(body), BODY_ECHO_CHUNK)] or [b""]
        for i, piece in enumerate(pieces):
            out.append(
                ext.ProcessingResponse(
                    request_body=ext.BodyResponse(
                        response=ext.CommonResponse(
                            body_mutation=ext.BodyMutation(
                                streamed_response=ext.StreamedBodyResponse(
                                    body=piece, end_of_stream=body_ends and i == len(pieces) - 1
                                )
                            )
                        )
                    )
                )
            )
        return out

    @staticmethod
    def _respond(pick: Pick, field_name: str, common: ext.CommonResponse) -> ext.ProcessingResponse:
        response = ext.ProcessingResponse(
            **{field_name: (ext.HeadersResponse if field_name == "request_headers" else ext.BodyResponse)(response=common)}
        )
        metadata = pick.metadata()
        if metadata is not None:
            response.dynamic_metadata.CopyFrom(metadata)
        return response

    # ------------------------------------------------------------ the decision

    async def _pick(self, ex: _Exchange, bodiless: bool = False) -> Pick | ext.ProcessingResponse:
        service = self.service
        path = ex.headers.get(":path", "").split("?", 1)[0]
        kind = "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else "either"
        eligible = None
        if ex.subset is not None:
            allowed = frozenset(ex.subset)
            if not allowed:
                return immediate(503, "the request's endpoint subset is empty", "no_workers")
            eligible = lambda w: host_port(w.endpoint) in allowed
        try:
            if bodiless:
                decision = await service.router.decide(service.model, None, eligible=eligible)
            else:
                _, parsed = parse_routing_body(bytes(ex.body), kind, ex.headers)
                prepared = await service.preparer.prepare(parsed, tokenize=self._policy_reads_tokens)
                decision = await service.router.decide(
                    prepared.model,
                    prepared.token_ids,
                    prepared.lora_name,
                    prepared.cache_salt,
                    session_key=prepared.session_key,
                    eligible=eligible,
                )
        except BadRequest as exc:
            return immediate(exc.status, str(exc), exc.code, exc.param)
        except PrepareError as exc:
            status, code = _PREPARE_STATUS[exc.kind]
            return immediate(status, str(exc), code, exc.param)
        except NoWorkersError as exc:
            return immediate(503, str(exc), "no_workers")
        except Exception:
            log.exception("endpoint picker failed to decide")
            if self.fail_open:  # the InferencePool's FailOpen: Envoy's own load balancer picks
                ex.pick = Pick()
                return ex.pick
            return immediate(500, "the endpoint picker failed to handle the request (its log has the details)")
        if self._sheds(ex, decision):
            return immediate(
                429,
                f"every eligible worker is saturated (--saturation-load {self.saturation_load}) and "
                f"this request's objective {ex.headers.get(OBJECTIVE_HEADER)!r} is sheddable",
                "overloaded",
            )
        ranked = decision.ranked()
        endpoints = list(dict.fromkeys(host_port(c.endpoint) for c in ranked[: 1 + self.fallback_endpoints]))
        headers = [_header_option(DESTINATION, ",".join(endpoints))]
        rank = decision.dp_ranks.get(decision.worker_id)
        if rank is not None:
            headers.append(_header_option(DP_RANK_HEADER, str(rank)))
        ex.pick = Pick(endpoints, headers, decision)
        ex.ticket = self._start(decision, ranked[0].worker_id)
        return ex.pick

    def _sheds(self, ex: _Exchange, decision: RouteDecision) -> bool:
        if not self.saturation_load or ex.headers.get(OBJECTIVE_HEADER, "") not in self.sheddable:
            return False
        return all(request_load(c) >= self.saturation_load for c in decision.candidates)

    def _start(self, decision: RouteDecision, worker_id: str) -> InflightTicket:
        """Count the request in flight on `worker_id`, as the router's proxy counts what it sends."""
        chosen = next(c for c in decision.candidates if c.worker_id == worker_id)
        return self.service.inflight.start(
            worker_id,
            decision.prompt_tokens - chosen.cached_tokens,
            decision.chains.get(chosen.block_size, ()),
            chosen.block_size,
            decision.prompt_tokens,
        )

    def _served(self, ex: _Exchange, served: object) -> None:
        """Envoy names the endpoint that served the request; after a retry to a fallback it is not
        the chosen one, and the in-flight entry moves there."""
        if not isinstance(served, str) or ex.pick is None or ex.pick.decision is None or ex.ticket is None:
            return
        served = served.split(",", 1)[0].strip()
        decision = ex.pick.decision
        if served == host_port(decision.endpoint):
            return
        moved = [c for c in decision.ranked() if host_port(c.endpoint) == served]
        if not moved:
            log.warning("Envoy reports endpoint %s served the request, which is not among the candidates", served)
            return
        self.service.inflight.finish(ex.ticket)
        ex.ticket = self._start(decision, moved[0].worker_id)

    def _first_byte(self, ex: _Exchange) -> None:
        if not ex.first_byte_seen and ex.ticket is not None:
            ex.first_byte_seen = True
            self.service.inflight.first_token(ex.ticket)

    def _finish(self, ex: _Exchange) -> None:
        if ex.ticket is not None:
            self.service.inflight.finish(ex.ticket)
