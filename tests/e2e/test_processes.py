"""Every plane as its own OS process over real sockets: control plane, sim engines with agents, router.

Prompts are warmed directly on chosen engines (bypassing the router); once their KV events have
flowed engine -> agent -> control plane, the router must send requests with those prefixes to
exactly the engine that cached them.
"""

from __future__ import annotations

import json
import time

import pytest

from kvroute.tools.local_cluster import LocalCluster, http_post_json, long_text, wait_until


@pytest.fixture(scope="module")
def cluster(module_local_fleet):
    c = module_local_fleet("e2e", block_size=16)
    c.start_sim_fleet(3, "--num-blocks", "512", "--speedup", "50")
    c.start_router("kv", "kv_aware", ready=True)
    return c


def route(cluster: LocalCluster, body: dict) -> dict:
    status, raw = http_post_json(cluster.router_urls["kv"] + "/v1/route", body)
    assert status == 200, raw
    return json.loads(raw)


def test_routing_follows_the_cache_after_events_arrive(cluster: LocalCluster) -> None:
    for i, engine in enumerate(cluster.engines):
        status, raw = http_post_json(engine.url + "/v1/chat/completions", cluster.chat_request(long_text(i), "warm up"))
        assert status == 200, raw
    for i, engine in enumerate(cluster.engines):
        body = cluster.chat_request(long_text(i), "a different question about the same document")
        decision = wait_until(
            lambda body=body: (d := route(cluster, body)) and d["cached_tokens"] > 0 and d,
            15,
            f"events of {engine.worker_id} reach the router",
        )
        assert decision["worker_id"] == engine.worker_id, decision
        assert decision["cached_tokens"] >= 300
        assert decision["fail_open"] is False
        by_worker = {w["worker_id"]: w["cached_tokens"] for w in decision["workers"]}
        assert set(by_worker) == {e.worker_id for e in cluster.engines}
        assert all(v == 0 for w, v in by_worker.items() if w != engine.worker_id)
        # The proxied request lands there too, and the engine's own counters see the hit.
        status, raw = http_post_json(cluster.router_urls["kv"] + "/v1/chat/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300


def test_unknown_prefix_spreads_by_load_and_header_names_worker(cluster: LocalCluster) -> None:
    import urllib.request

    seen = set()
    for i in range(12):
        body = cluster.chat_request(f"unique {i} " + long_text(100 + i, 30), "hi")
        req = urllib.request.Request(
            cluster.router_urls["kv"] + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            seen.add(resp.headers["x-kvroute-worker"])
    assert len(seen) >= 2  # random tie-break among idle engines, never "always the first"


def test_control_plane_down_fails_open(cluster: LocalCluster) -> None:
    # Its own warm-up (the module's first test may not have run, e.g. under -k): engine 1 holds long_text(1).
    engine = cluster.engines[1]
    status, raw = http_post_json(engine.url + "/v1/chat/completions", cluster.chat_request(long_text(1), "warm up"))
    assert status == 200, raw
    cluster.control_plane.stop()
    try:
        started = time.monotonic()
        status, raw = http_post_json(
            cluster.router_urls["kv"] + "/v1/chat/completions", cluster.chat_request(long_text(0), "still there?")
        )
        assert status == 200, raw
        assert time.monotonic() - started < 5
    finally:
        cluster.control_plane.start()
        wait_until(lambda: len(cluster.list_workers()) == len(cluster.engines), 20, "agents re-register", cluster.all_processes())
    # After the restart the agents' snapshots rebuild the index: routing follows the cache again.
    decision = wait_until(
        lambda: (d := route(cluster, cluster.chat_request(long_text(1), "again"))) and d["cached_tokens"] > 0 and d,
        15,
        "index rebuilt from agent snapshots",
    )
    assert decision["worker_id"] == cluster.engines[1].worker_id


def test_only_a_router_whose_policy_reads_the_index_opens_a_router_session(local_fleet) -> None:
    from kvroute.prom_text import sample_value
    from kvroute.tools.local_cluster import free_port, http_get, http_ok

    cluster = local_fleet("sessions")
    metrics_port = free_port()
    cluster.start_control_plane(extra_args=("--metrics-port", str(metrics_port)))
    cluster.start_sim_fleet(1, "--speedup", "1000")
    cluster.start_router("rr", "round_robin")
    cluster.start_router("kv", "kv_aware")

    def sessions() -> float:
        text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1].decode()
        value = sample_value(text, "kvroute_cp_router_sessions", {"origin": "local"})
        return -1 if value is None else value

    wait_until(lambda: sessions() == 1, 15, "the kv_aware router's session")
    for name in ("rr", "kv"):
        wait_until(lambda name=name: http_ok(cluster.router_urls[name] + "/ready"), 30, f"router {name} ready")
    for name in ("rr", "kv"):  # both route; round_robin's requests are neither queried nor announced
        status, raw = http_post_json(
            cluster.router_urls[name] + "/v1/completions", {"model": cluster.model, "prompt": "hello", "max_tokens": 2}
        )
        assert status == 200, raw
    time.sleep(0.5)  # a second session would have opened by now
    assert sessions() == 1
