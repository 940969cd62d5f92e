"""A bare gRPC bidi-stream echo between two Python processes: the floor under the decision's query.

`kvroute bench decision` times the router's query over its session stream to the control plane. How
much of that is kvroute and how much is two Python gRPC stacks handing a message across a socket?
This server answers every request message on one stream with a fixed-size reply and does nothing
else, on the same event loop (uvloop) and gRPC build as the control plane; the bench writes messages
of the query's size and times the round trip, in the same processes' places (pinned to the same
cores), so `query_p50_ms - grpc_echo_p50_ms` is what the control plane's work and kvroute's own code
add to the query.

    python -m kvroute.tools.bench.grpc_echo --port 23456 --reply-bytes 1500
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from kvroute.addresses import port
from kvroute.listeners import GrpcListener, run_service

METHOD = "/kvroute.bench.Echo/Stream"


def _echo_handler(reply: bytes) -> grpc.GenericRpcHandler:
    async def stream(request_iterator, context):
        async for _ in request_iterator:
            yield reply

    # No serializers: messages stay bytes, so nothing but gRPC itself is measured.
    handler = grpc.stream_stream_rpc_method_handler(stream)
    return grpc.method_handlers_generic_handler("kvroute.bench.Echo", {"Stream": handler})


async def serve(port: int, reply_bytes: int) -> None:
    listener = GrpcListener("--port", f"127.0.0.1:{port}")  # as every kvroute gRPC server: no SO_REUSEPORT
    listener.server.add_generic_rpc_handlers([_echo_handler(b"\x01" * reply_bytes)])
    await listener.start()
    await listener.server.wait_for_termination()


async def round_trips_ms(address: str, request_bytes: int, iterations: int, warmup: int = 50) -> list[float]:
    """Milliseconds per write-then-read on one stream, after `warmup` untimed ones."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        call = channel.stream_stream(METHOD)()
        payload = b"\x02" * request_bytes
        samples: list[float] = []
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            await call.write(payload)
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise RuntimeError(f"echo server at {address} ended the stream after {i} replies")
            if i >= warmup:
                samples.append((time.perf_counter() - t0) * 1000)
        await call.done_writing()
        return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=port, required=True)
    p.add_argument("--reply-bytes", type=int, default=1024)
    args = p.parse_args()
    return run_service("bench grpc-echo", serve(args.port, args.reply_bytes))


if __name__ == "__main__":
    raise SystemExit(main())
