"""Every control plane gone for a minute under load: routers keep deciding on their own view of the
fleet (no request fails, no decision falls back to load alone, the hit rate holds) and follow the
control plane again within 2 s of its return."""

from __future__ import annotations

import time

from kvroute.prom_text import sample_sums
from kvroute.tools.bench.kill import RetryingLoad
from kvroute.tools.local_cluster import LocalCluster, engine_prefix_counters, http_get, http_ok, wait_until

OUTAGE_S = 60.0


def _hits(cluster: LocalCluster) -> tuple[float, float]:
    counters = [engine_prefix_counters(e.url) for e in cluster.engines]
    return sum(q for q, _ in counters), sum(h for _, h in counters)


def _router_sums(url: str, *names: str) -> dict[str, float]:
    status, raw = http_get(url + "/metrics")
    assert status == 200
    return {name: 0.0 for name in names} | sample_sums(raw.decode(), names)


def test_routers_decide_on_their_view_through_a_control_plane_outage(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("outage")
    cluster.start_control_plane()
    cluster.start_sim_fleet(3, "--speedup", "20", "--num-blocks", "2048")
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(3)
    urls = [cluster.start_router(f"r{i}", "kv_aware") for i in range(2)]
    for url in urls:
        wait_until(lambda u=url: http_ok(u + "/ready"), 30, "router ready")
    load = RetryingLoad(cluster, urls, rate=20.0)
    load.start()
    try:
        time.sleep(8.0)  # warm: every group's system prompt cached somewhere
        queries0, hits0 = _hits(cluster)
        time.sleep(10.0)
        queries1, hits1 = _hits(cluster)
        fail_open_before = [_router_sums(u, "kvroute_router_fail_open_total") for u in urls]
        snapshots_before = [_router_sums(u, "kvroute_router_view_snapshots_total") for u in urls]

        cluster.control_plane.kill()
        time.sleep(OUTAGE_S)
        queries2, hits2 = _hits(cluster)
        fail_open_during = [_router_sums(u, "kvroute_router_fail_open_total") for u in urls]
        for url in urls:  # degraded, still serving
            status, _ = http_get(url + "/ready")
            assert status == 200

        cluster.control_plane.start()
        cluster.control_plane.wait_ports()  # written once it serves: it is back
        returned = time.monotonic()

        def resynced() -> bool:
            return all(
                _router_sums(u, "kvroute_router_view_snapshots_total")["kvroute_router_view_snapshots_total"]
                > before["kvroute_router_view_snapshots_total"]
                for u, before in zip(urls, snapshots_before)
            )

        wait_until(resynced, 10, "both routers' views resynchronised")
        resync_s = time.monotonic() - returned
    finally:
        sent = load.stop()
    failed = [s for s in sent if s.status != 200]
    assert not failed, sorted({s.error for s in failed})[:5]
    assert fail_open_during == fail_open_before  # every decision of the outage read the last view
    hit_before = (hits1 - hits0) / (queries1 - queries0)
    hit_during = (hits2 - hits1) / (queries2 - queries1)
    assert hit_during >= hit_before - 0.05, (hit_before, hit_during)
    assert resync_s <= 2.0, f"views resynchronised {resync_s:.2f}s after the control plane came back"
