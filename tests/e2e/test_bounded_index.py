"""`kvroute control-plane --max-index-entries` against a real sim engine and its agent: the index stays
under its bound while the engine caches more, /metrics says so, and `kvroute audit` (and the periodic
audit) count the blocks the bound dropped as explained, not as divergence, while still catching what
the control plane was told falsely."""

from __future__ import annotations

import json
import subprocess

import grpc

from kvroute.prom_text import sample_value
from kvroute.tools.local_cluster import free_port, http_get, http_post_json, kvroute_argv, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import FakeAgent, run_audit

BLOCK_SIZE = 16
BOUND = 40


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    found = sample_value(text, name, labels)
    assert found is not None, f"{name}{labels or ''} not in /metrics"
    return found


async def test_a_bounded_control_plane_keeps_its_bound_and_its_audit_honest(local_fleet) -> None:
    cluster = local_fleet("bounded", heartbeat_timeout_s=30)
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    cluster.start_control_plane(
        extra_args=(
            "--max-index-entries",
            str(BOUND),
            "--metrics-port",
            str(metrics_port),
            "--audit-interval-s",
            "0.5",
            "--audit-settle-ms",
            "200",
        )
    )
    cluster.start_sim_fleet(1, "--speedup", "50", "--num-blocks", "128")
    engine = cluster.engines[0]
    for i in range(14):  # 14 prompts of 5 full blocks: ~70 blocks cached, the bound is 40
        prompt = [100 * (i + 1) + t for t in range(5 * BLOCK_SIZE)]
        status, body = http_post_json(engine.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200, body

    def evicted_enough() -> str | None:
        text = http_get(metrics_url)[1].decode()
        return text if metric(text, "kvroute_cp_index_evicted_entries_total", {"recently_matched": "false"}) >= 20 else None

    text = wait_until(evicted_enough, 20, "the bound to be passed", cluster.all_processes())
    truth = {tier: set(keys) for tier, keys in json.loads(http_get(engine.url + "/kvroute/blocks")[1])["tiers"].items()}
    assert len(truth["gpu"]) >= 60
    assert metric(text, "kvroute_cp_index_entries") <= BOUND == metric(text, "kvroute_cp_index_max_entries")
    assert 50 < metric(text, "kvroute_cp_index_bytes_per_entry") < 1000
    assert metric(text, "kvroute_cp_index_bytes") > 0
    assert metric(text, "kvroute_cp_index_workers_with_evictions") == 1
    assert metric(text, "kvroute_cp_index_evicted_entries_total", {"recently_matched": "true"}) == 0

    # GetWorkerKeys says how many of the worker's entries the bound dropped, beside the keys it kept.
    with grpc.insecure_channel(cluster.control_plane_addr) as channel:
        keys, call = pb_grpc.ControlPlaneStub(channel).GetWorkerKeys.with_call(
            pb.GetWorkerKeysRequest(worker_id=engine.worker_id), timeout=5
        )
    evicted = int(dict(call.initial_metadata())["kvroute-evicted-entries-gpu"])
    kept = {key for tier in keys.tiers for key in tier.block_keys}
    assert kept <= truth["gpu"] and len(kept) <= BOUND and evicted >= len(truth["gpu"] - kept) > 0

    code, result, output = await run_audit(cluster)
    assert code == 0, output
    (worker,) = result["workers"]
    gpu = worker["tiers"]["gpu"]
    assert gpu["missing"] > 0 and gpu["missing_beyond_evicted"] == 0 and gpu["evicted"] >= gpu["missing"]
    assert gpu["extra"] == 0 and result["divergence"] == worker["divergence"] == 0
    assert result["missing_explained_by_eviction"] == gpu["missing"]
    assert "missing blocks not counted" in output

    # What the control plane was told falsely is still found: two blocks the engine never had, and the
    # engine's blocks it was never told about. Its keys are new to the index: at the back of the clock,
    # so what their 7 entries push out is the engine worker's, and the liar loses none to the bound.
    liar = FakeAgent(cluster.control_plane_addr)
    try:
        await liar.claim("liar", engine.url, {"gpu": sorted(truth["gpu"] - kept)[:5] + [11, 12]})
        code, result, output = await run_audit(cluster, "--settle-ms", "100", "--worker", "liar")
        assert code == 1, output
        (liar_audit,) = result["workers"]
        gpu = liar_audit["tiers"]["gpu"]
        assert gpu["extra"] == 2 and gpu["evicted"] == 0 and gpu["missing"] == len(truth["gpu"]) - 5
        assert result["divergence"] == gpu["missing"] + 2
    finally:
        await liar.close()

    # The periodic audit exports the explained part apart from the divergence.
    def audited() -> str | None:
        text = http_get(metrics_url)[1].decode()
        return text if f'kind="missing_evicted",medium="gpu",worker="{engine.worker_id}"' in text else None

    text = wait_until(audited, 20, "the periodic audit", cluster.all_processes())
    labels = {"medium": "gpu", "worker": engine.worker_id}
    assert metric(text, "kvroute_cp_audit_divergent_blocks", {**labels, "kind": "missing"}) == 0
    assert metric(text, "kvroute_cp_audit_divergent_blocks", {**labels, "kind": "missing_evicted"}) > 0


def test_a_negative_bound_is_a_usage_error() -> None:
    done = subprocess.run(
        kvroute_argv("control-plane", "--max-index-entries", "-5"), check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--max-index-entries: must be >= 0" in done.stderr
