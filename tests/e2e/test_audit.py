"""Audit: the comparison on its own, then `kvroute audit` and the control plane's periodic audit
against a real sim-engine process with its agent (and a lying fake agent)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvroute.control_plane.audit import TierDivergence, compare, settle
from kvroute.tools.local_cluster import free_port, http_get, http_post_json, kvroute_argv, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import FakeAgent, run_audit


def test_compare_reports_missing_and_extra_per_tier() -> None:
    result = compare({"gpu": {1, 2, 3}, "cpu": {7}, "disk": set()}, {"gpu": {2, 3, 4}, "cpu": {7}})
    assert result == {
        "cpu": TierDivergence(set(), set(), 1, 1),
        "disk": TierDivergence(set(), set(), 0, 0),
        "gpu": TierDivergence({4}, {1}, 3, 3),
    }


def test_settle_keeps_only_divergence_seen_both_times() -> None:
    first = {"gpu": TierDivergence({4, 5}, {1}, 3, 4)}
    second = {"gpu": TierDivergence({5}, {1, 9}, 4, 4), "cpu": TierDivergence({8}, set(), 0, 1)}
    # 4 arrived in between (transient), 9 diverged only once, 8 is new: only 5 and 1 stay.
    assert settle(first, second) == {"gpu": TierDivergence({5}, {1}, 4, 4), "cpu": TierDivergence(set(), set(), 0, 1)}


# ---------------------------------------------------------------- against processes

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def fleet(module_local_fleet):
    """A control plane auditing itself every 0.5 s (and serving /metrics), one sim engine with its agent."""
    c = module_local_fleet("audit", heartbeat_timeout_s=30)
    metrics_port = free_port()
    c.start_control_plane(
        extra_args=("--metrics-port", str(metrics_port), "--audit-interval-s", "0.5", "--audit-settle-ms", "200")
    )
    # A small GPU cache with a CPU tier, so both tiers hold blocks.
    c.start_sim_fleet(1, "--speedup", "50", "--num-blocks", "24", cpu_offload_blocks=16)
    engine = c.engines[0]
    for i in range(6):
        prompt = [100 * (i + 1) + t for t in range(5 * BLOCK_SIZE)]  # the tiny model's vocabulary is 2048
        status, body = http_post_json(engine.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200, body
    return c, f"http://127.0.0.1:{metrics_port}"


def engine_truth(url: str) -> dict[str, set[int]]:
    return {tier: set(keys) for tier, keys in json.loads(http_get(url + "/kvroute/blocks")[1])["tiers"].items()}


def control_plane_keys(address: str, worker_id: str) -> dict[str, set[int]]:
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.ControlPlaneStub(channel).GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id=worker_id), timeout=5)
    return {pb.Tier.Name(tier.tier).removeprefix("TIER_").lower(): set(tier.block_keys) for tier in response.tiers}


async def test_audit_of_a_truthful_fleet_finds_no_divergence(fleet) -> None:
    cluster, _ = fleet
    engine = cluster.engines[0]
    truth = engine_truth(engine.url)
    assert truth["gpu"] and truth["cpu"]  # both tiers are exercised
    # Let the agent's events land, then audit with the real command.
    wait_until(
        lambda: control_plane_keys(cluster.control_plane_addr, engine.worker_id).get("cpu") == truth["cpu"],
        20,
        "the control plane to catch up",
        cluster.all_processes(),
    )
    code, result, output = await run_audit(cluster)
    assert code == 0, output
    assert result["divergence"] == 0 and result["audited"] == 1 and result["errors"] == []
    (worker,) = result["workers"]
    assert worker["worker_id"] == engine.worker_id and worker["status"] == "ok"
    assert worker["tiers"]["gpu"]["engine"] == len(truth["gpu"]) == worker["tiers"]["gpu"]["control_plane"]
    assert worker["tiers"]["cpu"]["engine"] == len(truth["cpu"]) > 0
    assert "divergence: 0 blocks" in output


async def test_audit_finds_what_the_control_plane_was_told_falsely(fleet) -> None:
    cluster, metrics_url = fleet
    engine = cluster.engines[0]
    truth = engine_truth(engine.url)
    real_gpu = sorted(truth["gpu"])
    liar, no_endpoint = FakeAgent(cluster.control_plane_addr), FakeAgent(cluster.control_plane_addr)
    try:
        # "liar" points at the real engine but claims 2 of its gpu blocks are gone, and two it never had.
        await liar.claim("liar", engine.url, {"gpu": real_gpu[2:] + [11, 12], "cpu": sorted(truth["cpu"])})
        # "opaque" is an engine without /kvroute/blocks (a real vLLM answers 404): not auditable.
        await no_endpoint.claim("opaque", metrics_url, {"gpu": [5]})
        code, result, output = await run_audit(cluster, "--settle-ms", "100")
        assert code == 1, output
        workers = {w["worker_id"]: w for w in result["workers"]}
        assert workers["liar"]["divergence"] == 4 == result["divergence"]
        assert workers["liar"]["tiers"]["gpu"]["missing"] == 2 and workers["liar"]["tiers"]["gpu"]["extra"] == 2
        assert workers["liar"]["tiers"]["gpu"]["extra_sample"] == [11, 12]
        assert set(workers["liar"]["tiers"]["gpu"]["missing_sample"]) == set(real_gpu[:2])
        assert workers["liar"]["tiers"]["cpu"]["missing"] == workers["liar"]["tiers"]["cpu"]["extra"] == 0
        assert workers["opaque"]["status"] == "not_auditable" and "404" in workers["opaque"]["detail"]
        assert workers[engine.worker_id]["divergence"] == 0
        assert result["not_auditable"] == 1 and result["audited"] == 2
        # Only the named worker; an unknown one is an error (exit 2).
        code, result, _ = await run_audit(cluster, "--worker", engine.worker_id, "--json")
        assert code == 0 and [w["worker_id"] for w in result["workers"]] == [engine.worker_id]
        code, result, _ = await run_audit(cluster, "--worker", "nobody", "--json")
        assert code == 2 and "nobody" in result["errors"][0]

        # The control plane's own periodic audit exports the same per worker, tier and kind.
        def divergence_exported():
            text = http_get(metrics_url + "/metrics")[1].decode()
            return 'kvroute_cp_audit_divergent_blocks{kind="missing",medium="gpu",worker="liar"} 2.0' in text and text

        text = wait_until(divergence_exported, 20, "the periodic audit to report the liar", cluster.all_processes())
        assert 'kvroute_cp_audit_divergent_blocks{kind="extra",medium="gpu",worker="liar"} 2.0' in text
        assert f'kvroute_cp_audit_divergent_blocks{{kind="missing",medium="gpu",worker="{engine.worker_id}"}} 0.0' in text
        assert f'kvroute_cp_audit_last_success_timestamp_seconds{{worker="{engine.worker_id}"}}' in text
        assert 'kvroute_cp_audit_last_success_timestamp_seconds{worker="opaque"}' not in text
        assert 'kvroute_cp_audit_runs_total{result="not_auditable"}' in text
    finally:
        await liar.close()
        await no_endpoint.close()


async def test_audit_exits_2_when_the_control_plane_is_unreachable() -> None:
    proc = await asyncio.create_subprocess_exec(
        *kvroute_argv("audit", "--control-plane", f"127.0.0.1:{free_port()}", "--timeout-s", "1", "--json"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and "ListWorkers" in json.loads(out.decode().splitlines()[-1])["errors"][0]


async def test_an_audit_that_audits_nothing_says_so_and_exits_2_unless_allowed() -> None:
    """A control plane that lists no worker: "audited 0, divergence 0" is not a clean audit."""
    from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer

    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0"))
    port = await server.start()
    try:

        async def audit(*args: str) -> tuple[int, dict, str]:
            proc = await asyncio.create_subprocess_exec(
                *kvroute_argv("audit", "--control-plane", f"127.0.0.1:{port}", *args),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode, json.loads(out.decode().splitlines()[-1]), err.decode()

        code, result, err = await audit()
        assert code == 2 and result["audited"] == 0, (code, result, err)
        assert result["errors"] == ["nothing audited: the control plane lists no worker (--allow-empty accepts that)"]
        assert "error: nothing audited: the control plane lists no worker" in err
        code, result, err = await audit("--allow-empty", "--json")
        assert code == 0 and result["audited"] == 0 and result["errors"] == [], (code, result, err)
    finally:
        await server.stop(0)
