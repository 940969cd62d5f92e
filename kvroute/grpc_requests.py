"""Registering a gRPC servicer so that a request that does not parse is INVALID_ARGUMENT.

The generated `add_<Service>Servicer_to_server` deserializes with `Message.FromString`: bytes that
are not the message (corrupt wire format, a string that is not valid UTF-8) raise inside grpc,
which answers UNKNOWN ("Unexpected DecodeError") before any kvroute code runs, and a client cannot
tell its own bad input from a server bug. `add_servicer` registers every method of the service
with a deserializer that turns those bytes into an `Unparseable` value instead, and a wrapper that
answers it INVALID_ARGUMENT with protobuf's reason, before the servicer's method is called (for a
stream, when the bad message is reached: what came before it was handled).

    add_servicer(server, pb.DESCRIPTOR.services_by_name["ControlPlane"], service,
                 on_unparseable=lambda method: metrics.bad_requests.labels(method, "unparseable").inc())
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass


@dataclass(frozen=True, slots=True)
class Unparseable:
    """Request bytes that are not the method's message."""

    message_type: str  # its full name, e.g. kvroute.v1.QueryRequest
    reason: str  # protobuf's, e.g. "String field had bad UTF-8"

    def detail(self) -> str:
        utf8 = "; strings must be valid UTF-8 (no lone surrogates)" if "UTF-8" in self.reason else ""
        return f"the request is not a valid {self.message_type} ({self.reason}){utf8}"


def parser(message_class: type[Message]) -> Callable[[bytes], Message | Unparseable]:
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Unparseable:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Unparseable(name, str(exc).removeprefix(f"Error parsing message with type '{name}': "))

    return parse


OnUnparseable = Callable[[str], None]  # called with the method's name


async def _checked(
    requests: AsyncIterator, context: grpc.aio.ServicerContext, method: str, on_unparseable: OnUnparseable
) -> AsyncIterator[Message]:
    async for request in requests:
        if isinstance(request, Unparseable):
            on_unparseable(method)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
        yield request


def _serializer(message_class: type[Message]) -> Callable[[Message | bytes], bytes]:
    """A reply may also be the message already serialized (a stream that sends the same bytes to many)."""
    serialize = message_class.SerializeToString

    def dump(reply: Message | bytes) -> bytes:
        return reply if type(reply) is bytes else serialize(reply)

    return dump


def _handler(method: MethodDescriptor, implementation: Callable, on_unparseable: OnUnparseable) -> grpc.RpcMethodHandler:
    """kvroute's methods are unary (Query, Route, ...), bidirectional streams (Connect, RouterSession)
    or server streams (Follow)."""
    name = method.name
    deserialize = parser(GetMessageClass(method.input_type))
    serialize = _serializer(GetMessageClass(method.output_type))
    if method.client_streaming and method.server_streaming:

        async def handle_stream(requests, context):
            async for reply in implementation(_checked(requests, context, name, on_unparseable), context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(handle_stream, deserialize, serialize)
    if method.server_streaming:

        async def handle_server_stream(request, context):
            if isinstance(request, Unparseable):
                on_unparseable(name)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
            async for reply in implementation(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(handle_server_stream, deserialize, serialize)
    if method.client_streaming:
        raise ValueError(f"{method.full_name}: client-streaming methods are not supported")

    async def handle_unary(request, context):
        if isinstance(request, Unparseable):
            on_unparseable(name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
        return await implementation(request, context)

    return grpc.unary_unary_rpc_method_handler(handle_unary, deserialize, serialize)


def add_servicer(
    server: grpc.aio.Server, service: ServiceDescriptor, servicer: object, on_unparseable: OnUnparseable = lambda method: None
) -> None:
    """Every method of `service`, served by `servicer`'s method of the same name (an async function, or an
    async generator for a stream), a request that does not parse answered INVALID_ARGUMENT."""
    handlers = {m.name: _handler(m, getattr(servicer, m.name), on_unparseable) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
