"""Two agents with one worker id: the control plane refuses the second (ALREADY_EXISTS, naming the id
and the first agent's address) and keeps the first's state; the second logs it once and backs off.
The same agent reconnecting, or re-registering, is not refused."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.tools.local_cluster import LocalCluster, http_get, http_ok, http_post_json, long_text, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.control_plane_client import ControlPlaneLink, WorkerIdentity
from kvroute.worker_agent.vllm_wire import BlockStored
from tests.helpers import eventually

MODEL = "tiny"


class Agent:
    """One agent's control-plane link over its own gRPC channels (so its own peer address)."""

    def __init__(self, port: int, endpoint: str, **options) -> None:
        self.resolver = BlockResolver(MODEL)
        self.identity = WorkerIdentity("w1", MODEL, "vllm", 4, endpoint)
        self.link = ControlPlaneLink(f"127.0.0.1:{port}", self.identity, self.resolver.snapshot_events, pb.WorkerLoad, **options)
        self.task = asyncio.create_task(self.link.run())

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_the_second_agent_is_refused_logs_once_and_gets_the_id_when_the_first_leaves(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.agent.cp")
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=2.0))
    port = await server.start()
    first = Agent(port, "http://first:8000")
    first.link.send(first.resolver.apply([BlockStored([1, 2], None, list(range(8)), 4)]))
    second = None
    try:
        await eventually(lambda: first.link.connected and first.link.acked_seq >= 1)
        record = server.registry.get("w1")
        generation, peer = record.generation, record.peer
        second = Agent(port, "http://second:8000", refused_backoff_s=0.05, backoff_max_s=0.2)
        await eventually(lambda: second.link.counters.refusals >= 4)
        # Refused, and said so once, naming the worker id and where the first agent connects from.
        refusals = [r.getMessage() for r in caplog.records if "refused worker id" in r.getMessage()]
        assert len(refusals) == 1 and "'w1'" in refusals[0] and peer in refusals[0], refusals
        assert [r.levelno for r in caplog.records if "refused worker id" in r.getMessage()] == [logging.ERROR]
        assert second.link.not_connected_reason.startswith(f"refused by control plane 127.0.0.1:{port}: worker id 'w1'")
        assert not second.link.connected and second.link.counters.sessions == 0
        # The first agent's registration and blocks are untouched.
        record = server.registry.get("w1")
        assert (record.generation, record.endpoint, record.peer) == (generation, "http://first:8000", peer)
        assert server.registry.index.worker_block_count(record.slot) == 2
        assert first.link.connected and first.link.counters.connect_failures == 0
        # The first agent goes away (its stream ends): the second one gets the id at its next try.
        await first.close()
        await eventually(lambda: second.link.connected)
        assert server.registry.get("w1").endpoint == "http://second:8000"
        assert any("accepted worker id 'w1' after" in r.getMessage() for r in caplog.records)
        assert second.link.refused is None and second.link.not_connected_reason == ""
    finally:
        await first.close()
        if second is not None:
            await second.close()
        await server.stop(0)


async def test_re_registering_with_a_new_block_size_is_not_refused() -> None:
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=2.0))
    port = await server.start()
    agent = Agent(port, "http://a:8000")
    try:
        for block_size in (8, 16, 32):  # the engine's events named another block size
            await eventually(lambda: agent.link.connected)
            sessions = agent.link.counters.sessions
            agent.identity.block_size = block_size
            agent.link.reregister()
            await eventually(lambda n=sessions + 1: agent.link.counters.sessions == n and agent.link.connected)
            assert server.registry.get("w1").block_size == block_size
        assert agent.link.counters.refusals == 0 and agent.link.counters.connect_failures == 0
    finally:
        await agent.close()
        await server.stop(0)


@pytest.fixture
def cluster(local_fleet):
    return local_fleet("duplicate-ids", heartbeat_timeout_s=3.0)


def test_two_agent_processes_with_one_worker_id(cluster: LocalCluster) -> None:
    cluster.start_control_plane()
    first = cluster.add_sim_engine("engine-0")
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(1)
    # A second engine whose agent was (wrongly) given the first one's worker id.
    second = cluster.add_sim_engine("engine-1", agent_args=("--worker-id", "engine-0"))
    cluster.wait_engines_healthy()
    for handle, seed in ((first, 1), (second, 2)):  # different prompts: different blocks on each engine
        for turn in range(3):
            status, _ = http_post_json(
                handle.url + "/v1/completions",
                {"model": cluster.model, "prompt": long_text(seed * 10 + turn, 120), "max_tokens": 2},
            )
            assert status == 200

    wait_until(lambda: http_ok(second.agent_metrics_url + "/health"), 30, "the second agent", [second.agent])
    started = time.monotonic()
    while time.monotonic() - started < 10:  # the first agent keeps the id, and the index its engine's truth
        (worker,) = cluster.list_workers()
        assert (worker.worker_id, worker.endpoint) == ("engine-0", first.url)
        time.sleep(0.5)
    audit = cluster.wait_audit_clean(workers=["engine-0"])
    assert audit.audits[0].tiers["gpu"].engine_blocks > 0
    # The second agent was refused, backed off, said so once, and its /ready says why.
    refusals = cluster.agent_counters(second).get("control_plane_refusals", 0)
    assert 1 <= refusals <= 6, f"{refusals} connection attempts in {time.monotonic() - started:.0f} s"
    log = second.agent.log_path.read_text()
    assert log.count("refused worker id 'engine-0'") == 1, log
    status, raw = http_get(second.agent_metrics_url + "/ready")
    reason = json.loads(raw)["workers"][0]["control_plane"]
    assert status == 503 and "worker id 'engine-0' is already connected from ipv4:127.0.0.1:" in reason, reason

    # The first agent stops: the second one connects within its backoff (at most ~7.5 s).
    first.agent.stop()
    wait_until(
        lambda: any(w.endpoint == second.url for w in cluster.list_workers()), 15, "the second agent registered", [second.agent]
    )
    assert "accepted worker id 'engine-0' after" in second.agent.log_path.read_text()
