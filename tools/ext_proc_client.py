"""What Envoy's ext_proc filter sends an endpoint picker, replayed from Envoy's published protos
(xds-protos): for `kvroute epp`'s end-to-end test and `kvroute bench live --epp`.

    async with grpc.aio.insecure_channel(addr) as channel:
        stream = EnvoyExtProcStream(ExternalProcessorStub(channel), mode="streamed")
        picked = await stream.request("/v1/completions", body, chunks=3)   # headers, then the body
        ... send the request to picked.endpoint ...
        await stream.response(served=picked.endpoint)                       # response headers
        await stream.close()                                                # the HTTP request is over

Modes: "buffered" (ProcessingMode BUFFERED: Envoy waits for each answer, the whole body comes in
one message) and "streamed" (FULL_DUPLEX_STREAMED, GAIE's: headers and every body chunk are sent
without waiting; the processor answers the headers once it has decided and sends the body back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
_MODES = {
    "buffered": processing_mode_pb2.ProcessingMode.BUFFERED,
    "streamed": processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
}


@dataclass
class Picked:
    """What the picker answered for the request path."""

    endpoint: str = ""  # the x-gateway-destination-endpoint header it set ("" = none)
    metadata_endpoint: str = ""  # envoy.lb / x-gateway-destination-endpoint in its dynamic metadata
    headers: dict[str, str] = field(default_factory=dict)  # every header it set
    removed: list[str] = field(default_factory=list)  # headers it removed
    status: int = 0  # an ImmediateResponse's HTTP status (0 = none: forward the request)
    error_body: bytes = b""
    body: bytes = b""  # streamed mode: the body as the picker sent it back


def _metadata(namespace: str, key: str, value: object) -> base_pb2.Metadata:
    fields = struct_pb2.Struct()
    fields.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: fields})


class EnvoyExtProcStream:
    """One HTTP request's ext_proc stream, driven the way Envoy drives it."""

    def __init__(self, stub: ext_grpc.ExternalProcessorStub, mode: str = "streamed", send_protocol_config: bool = False) -> None:
        self.mode = mode
        self.call = stub.Process()
        self._protocol_config = send_protocol_config

    async def request(
        self,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None = None,
        chunks: int = 1,
        subset: list[str] | None = None,
    ) -> Picked:
        """The request headers (`subset`: GAIE's endpoint subset hint in the metadata), then the body
        (in `chunks` pieces in streamed mode; None: a request without one, e.g. a GET); what the
        picker answered."""
        all_headers = {
            ":method": "POST" if body is not None else "GET",
            ":path": path,
            ":authority": "gateway",
            **({"content-type": "application/json", "content-length": str(len(body))} if body is not None else {}),
            **(headers or {}),
        }
        first = ext.ProcessingRequest(
            request_headers=ext.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in all_headers.items()]
                ),
                end_of_stream=body is None,
            )
        )
        if subset is not None:
            first.metadata_context.CopyFrom(_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset))
        if self._protocol_config:
            first.protocol_config.request_body_mode = _MODES[self.mode]
            first.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE
        picked = Picked()
        await self.call.write(first)
        if body is None:
            self._note(await self.call.read(), picked)
            return picked
        if self.mode == "buffered":
            answer = await self.call.read()
            if self._note(answer, picked):
                return picked
            await self.call.write(ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True)))
            self._note(await self.call.read(), picked)
            return picked
        size = max(1, -(-len(body) // max(1, chunks)))
        pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        for i, piece in enumerate(pieces):
            await self.call.write(
                ext.ProcessingRequest(request_body=ext.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
            )
        if self._note(await self.call.read(), picked):  # the headers response, held until the decision
            return picked
        echoed = bytearray()
        while True:  # then the body, sent back
            answer = await self.call.read()
            streamed = answer.request_body.response.body_mutation.streamed_response
            echoed += streamed.body
            if streamed.end_of_stream:
                break
        picked.body = bytes(echoed)
        return picked

    @staticmethod
    def _note(answer: ext.ProcessingResponse, picked: Picked) -> bool:
        """Record a request-path answer; True when it ended the request (ImmediateResponse)."""
        if answer.HasField("immediate_response"):
            picked.status = answer.immediate_response.status.code
            picked.error_body = answer.immediate_response.body
            return True
        kind = answer.WhichOneof("response")
        common = getattr(answer, kind).response
        picked.removed += common.header_mutation.remove_headers
        for option in common.header_mutation.set_headers:
            picked.headers[option.header.key] = option.header.raw_value.decode() or option.header.value
        picked.endpoint = picked.headers.get(DESTINATION, picked.endpoint)
        lb = answer.dynamic_metadata.fields.get("envoy.lb")
        if lb is not None and DESTINATION in lb.struct_value.fields:
            picked.metadata_endpoint = lb.struct_value.fields[DESTINATION].string_value
        return False

    async def response(self, served: str, status: int = 200) -> None:
        """The upstream's response headers, with the endpoint that served it (GAIE's
        `x-gateway-destination-endpoint-served` in the `envoy.lb` metadata)."""
        await self.call.write(
            ext.ProcessingRequest(
                response_headers=ext.HttpHeaders(
                    headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])
                ),
                metadata_context=_metadata("envoy.lb", "x-gateway-destination-endpoint-served", served),
            )
        )
        await self.call.read()

    async def close(self) -> None:
        """The HTTP request is over: Envoy ends the stream."""
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:  # drain until the server ends it
            pass
