"""The control plane over mTLS (real TLS sockets): a worker's blocks are written only by a certificate
that names the worker; a router certificate queries and reserves but never writes; a refusal is
PERMISSION_DENIED, counted, and leaves the index (and the replicas' Redis log) untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.identity import router_uri, worker_uri
from kvroute.tls import ClientTls, TlsFiles, open_channel
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.tls_certs import CertFiles, TestCA

MODEL = "tiny"


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, CertFiles]:
    ca = TestCA(tmp_path / "pki")
    return {
        "server": ca.issue("control-plane"),
        "agent_a": ca.issue("agent-a", uris=[worker_uri("node-a:8000")]),
        "agent_b": ca.issue("agent-b", uris=[worker_uri("node-b:8000")]),
        "router": ca.issue("router-1", uris=[router_uri("router-1")]),
        "stranger": TestCA(tmp_path / "other-pki", "other-ca").issue("stranger", uris=[worker_uri("node-a:8000")]),
    }


def files(cert: CertFiles) -> TlsFiles:
    return TlsFiles(str(cert.cert), str(cert.key), str(cert.ca))


async def start(certs: dict[str, CertFiles], **options) -> ControlPlaneServer:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", tls=files(certs["server"]), **options))
    await server.start()
    return server


def stub(server: ControlPlaneServer, cert: CertFiles) -> tuple[grpc.aio.Channel, pb_grpc.ControlPlaneStub]:
    channel = open_channel(f"localhost:{server.port}", ClientTls(files(cert)))
    return channel, pb_grpc.ControlPlaneStub(channel)


async def connect(control_plane: pb_grpc.ControlPlaneStub, worker_id: str, keys: list[int]) -> pb.ControlMessage:
    """Register `worker_id` and send one snapshot of `keys`; the ack (raises AioRpcError when refused)."""
    call = control_plane.Connect()
    try:
        await call.write(
            pb.AgentMessage(
                register=pb.RegisterWorker(
                    worker_id=worker_id, model=MODEL, engine="sim", block_size=4, endpoint=f"http://{worker_id}"
                )
            )
        )
        registered = await call.read()
        if registered is grpc.aio.EOF:
            await call  # the status
        await call.write(
            pb.AgentMessage(
                batch=pb.EventBatch(
                    seq=1, snapshot=True, events=[pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, tier=pb.TIER_GPU))]
                )
            )
        )
        return await call.read()
    finally:
        call.cancel()


def denied(server: ControlPlaneServer, reason: str) -> float:
    return server.metrics_registry.get_sample_value("kvroute_cp_auth_denied_total", {"reason": reason}) or 0.0


async def matched(control_plane: pb_grpc.ControlPlaneStub, keys: list[int]) -> dict[str, int]:
    response = await control_plane.Query(pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=keys)]))
    return {w.worker_id: w.matched_blocks for w in response.workers}


async def test_agent_writes_only_its_own_worker_and_a_router_never(certs):
    server = await start(certs)
    channels = []
    try:
        (ca, agent_a), (cb, agent_b), (cr, router) = (stub(server, certs[n]) for n in ("agent_a", "agent_b", "router"))
        channels += [ca, cb, cr]
        keys_a, keys_b = [1, 2, 3], [7, 8, 9]
        # B writes its own worker: the index holds it.
        stream_b = agent_b.Connect()
        await stream_b.write(
            pb.AgentMessage(
                register=pb.RegisterWorker(worker_id="node-b:8000", model=MODEL, engine="sim", block_size=4, endpoint="http://b")
            )
        )
        assert (await stream_b.read()).HasField("registered")
        await stream_b.write(
            pb.AgentMessage(
                batch=pb.EventBatch(
                    seq=1, snapshot=True, events=[pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys_b, tier=pb.TIER_GPU))]
                )
            )
        )
        assert (await stream_b.read()).ack.seq == 1
        before = await matched(router, keys_b)
        assert before == {"node-b:8000": 3}

        # A's certificate tries to write worker B: refused, nothing applied.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(agent_a, "node-b:8000", keys_a)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "node-b:8000" in refused.value.details() and "spiffe://kvroute/worker/" in refused.value.details()
        assert denied(server, "worker_not_in_certificate") == 1
        # ... and a new worker the certificate does not name either.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(agent_a, "node-c:8000", keys_a)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert denied(server, "worker_not_in_certificate") == 2

        # A router certificate cannot write at all.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(router, "node-b:8000", keys_a)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router" in refused.value.details()
        assert denied(server, "router_cannot_write") == 1
        assert b'kvroute_cp_auth_denied_total{reason="router_cannot_write"} 1.0' in generate_latest(server.metrics_registry)

        # Index unchanged: B still holds exactly its keys, A's keys are nowhere, B's stream is still live.
        assert await matched(router, keys_b) == before
        assert await matched(router, keys_a) == {"node-b:8000": 0}
        assert [w.worker_id for w in (await router.ListWorkers(pb.ListWorkersRequest())).workers] == ["node-b:8000"]

        # A writes its own worker; the router may query and reserve.
        ack = await connect(agent_a, "node-a:8000", keys_a)
        assert ack.ack.applied_events == 1
        session = router.RouterSession()
        await session.write(pb.RouterMessage(hello=pb.RouterHello(router_id="router-1")))
        assert (await session.read()).HasField("welcome")
        await session.write(
            pb.RouterMessage(
                reserve=pb.Reservation(reservation_id=1, worker_id="node-b:8000", block_size=4, prefill_tokens=8, ttl_ms=5000)
            )
        )
        await session.write(
            pb.RouterMessage(query=pb.QueryRequest(model=MODEL, chains=[pb.KeyChain(block_size=4, block_keys=keys_b)]))
        )
        reply = await session.read()
        assert {w.worker_id: w.matched_blocks for w in reply.result.workers}["node-b:8000"] == 3
        session.cancel()
        # An agent certificate may not open a router session (reservations are routing traffic).
        agent_session = agent_a.RouterSession()
        await agent_session.write(pb.RouterMessage(hello=pb.RouterHello(router_id="sneaky")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await agent_session.read()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert denied(server, "not_a_router") == 1
        stream_b.cancel()
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)


async def test_certificates_the_ca_did_not_sign_and_plaintext_do_not_connect(certs):
    server = await start(certs)
    try:
        for channel in (
            open_channel(f"localhost:{server.port}", ClientTls(files(certs["stranger"]))),
            open_channel(f"localhost:{server.port}", ClientTls(TlsFiles(ca=str(certs["server"].ca)))),
            open_channel(f"localhost:{server.port}", None),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=3)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(server.registry) == 0
    finally:
        await server.stop(0)


async def test_refusal_appends_nothing_to_the_replicas_log(certs, redis_single):
    server = await start(certs, redis_url=redis_single.url, replica_id="r1", redis_shards=2)
    channel, router = stub(server, certs["router"])
    try:
        assert await server.redis_log.wait_ready(10)
        redis = server.redis_log.redis

        async def log_size() -> int:
            keys = [k async for k in redis.scan_iter("*")]
            total = 0
            for key in keys:
                if await redis.type(key) in (b"stream", "stream"):
                    total += await redis.xlen(key)
            return total

        before = await log_size()
        _, agent_a = stub(server, certs["agent_a"])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(agent_a, "node-b:8000", [1, 2, 3])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await asyncio.sleep(0.2)
        assert await log_size() == before
        assert denied(server, "worker_not_in_certificate") == 1
        assert (await router.ListWorkers(pb.ListWorkersRequest())).workers == []
        # The same stream with its own worker id is appended and applied.
        await connect(agent_a, "node-a:8000", [1, 2, 3])
        assert await log_size() > before
    finally:
        await channel.close()
        await server.stop(0)


async def test_only_a_router_identity_may_follow_the_fleet(certs) -> None:
    """The follow stream hands over the whole index and every router's reservations: routers only."""
    server = await start(certs)
    try:
        channel, as_router = stub(server, certs["router"])
        call = as_router.Follow(pb.FollowRequest(router_id="router-1"))
        first = await asyncio.wait_for(call.read(), 5)
        assert first.snapshot_begin and first.snapshot_end  # an empty fleet: one message
        call.cancel()
        await channel.close()
        channel, as_agent = stub(server, certs["agent_a"])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(as_agent.Follow(pb.FollowRequest(router_id="sneaky")).read(), 5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router identity" in refused.value.details() and denied(server, "not_a_router") == 1
        await channel.close()
    finally:
        await server.stop(0)
