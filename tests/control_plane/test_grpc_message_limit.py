"""--grpc-max-message-bytes on the control plane: a message over it is refused with RESOURCE_EXHAUSTED
(nothing applied), one under it is applied."""

from __future__ import annotations

import grpc
import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

LIMIT = 64 * 1024


async def snapshot(stub: pb_grpc.ControlPlaneStub, worker_id: str, keys: int) -> pb.ControlMessage:
    call = stub.Connect()
    try:
        await call.write(
            pb.AgentMessage(
                register=pb.RegisterWorker(
                    worker_id=worker_id, model="tiny", engine="sim", block_size=4, endpoint=f"http://{worker_id}"
                )
            )
        )
        assert (await call.read()).HasField("registered")
        await call.write(
            pb.AgentMessage(
                batch=pb.EventBatch(
                    seq=1,
                    snapshot=True,
                    events=[pb.BlockEvent(stored=pb.BlocksStored(block_keys=list(range(1, keys + 1)), tier=pb.TIER_GPU))],
                )
            )
        )
        reply = await call.read()
        if reply is grpc.aio.EOF:
            await call
        return reply
    finally:
        call.cancel()


async def test_a_message_over_the_limit_is_refused_and_not_applied():
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", grpc_max_message_bytes=LIMIT))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControlPlaneStub(channel)
            assert (await snapshot(stub, "small", 1000)).ack.applied_events == 1  # ~8 KB
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await snapshot(stub, "large", 20_000)  # ~160 KB of varint keys
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            workers = {w.worker_id: w.cached_blocks for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
            assert workers.get("small") == 1000 and workers.get("large", 0) == 0
    finally:
        await server.stop(0)
