"""Active health checks of a static fleet, with real processes: a router whose control plane is
never reachable routes over `--static-workers` (two sim engines, no agents). One engine is killed:
the router's health checks take it out of routing before any request is sent there (no backend
error, no retry), the metric and /ready show it, requests keep succeeding on the other; restarted
on the same port, it is brought back and chosen again. With every engine dead the router is not
ready and a request's 502 says why."""

from __future__ import annotations

import json
import time

from kvroute.prom_text import sample_value
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json_headers, wait_until
from tests.helpers import served_by as served_by_router

INTERVAL_S, FAILURES, SUCCESSES = 0.3, 2, 2


def _metrics(router: str) -> str:
    return http_get(router + "/metrics")[1].decode()


def _healthy(router: str, worker: str) -> float | None:
    return sample_value(_metrics(router), "kvroute_router_worker_healthy", {"worker": worker})


def _ready(router: str) -> dict:
    return json.loads(http_get(router + "/ready")[1])


def test_a_dead_static_engine_is_routed_around_before_a_request_fails_on_it(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("static-health")
    cluster.control_plane_addr = f"127.0.0.1:{free_port()}"  # nothing listens: the static fleet is used
    alive = cluster.add_sim_engine("engine-0", start_agent=False)
    doomed = cluster.add_sim_engine("engine-1", start_agent=False)
    cluster.wait_engines_healthy()
    router = cluster.start_router(
        "r",
        "round_robin",
        "--static-workers",
        f"engine-0={alive.url},engine-1={doomed.url}",
        "--health-check-interval-s",
        str(INTERVAL_S),
        "--health-check-timeout-s",
        "2",
        "--health-failure-threshold",
        str(FAILURES),
        "--health-success-threshold",
        str(SUCCESSES),
    )
    request = cluster.chat_request("You are terse.", "Say hi.")

    def served_by(n: int) -> set[str]:
        return served_by_router(router, request, n)

    wait_until(
        lambda: _healthy(router, "engine-0") == 1 and _healthy(router, "engine-1") == 1,
        30,
        "both static engines checked healthy",
        [alive.engine, doomed.engine, cluster.routers["r"]],
    )
    assert served_by(4) == {"engine-0", "engine-1"}

    doomed.engine.kill()
    killed_at = time.monotonic()
    wait_until(
        lambda: _healthy(router, "engine-1") == 0,
        30,
        "engine-1 marked down by its health checks",
        [cluster.routers["r"]],
        interval=0.05,
    )
    # FAILURES x INTERVAL_S after the kill, plus probes and scrapes on a busy machine.
    assert time.monotonic() - killed_at < 15
    metrics = _metrics(router)
    assert sample_value(metrics, "kvroute_router_worker_sitting_out", {"worker": "engine-1"}) == 0  # no request failed
    assert sample_value(metrics, "kvroute_router_worker_healthy", {"worker": "engine-0"}) == 1
    ready = _ready(router)
    assert ready["failing_health_checks"] == ["engine-1"] and ready["healthy_workers"] == 1, ready
    assert any("1 of 2 workers failing their health checks (engine-1)" in p for p in ready["problems"]), ready

    assert served_by(6) == {"engine-0"}  # never engine-1: no failed attempt, no retry
    metrics = _metrics(router)
    assert not sample_value(metrics, "kvroute_router_backend_errors_total", {"worker": "engine-1"})
    assert not sample_value(metrics, "kvroute_router_retries_total")

    doomed.engine.start()  # the same port (pinned in its argv)
    wait_until(
        lambda: _healthy(router, "engine-1") == 1,
        30,
        "engine-1 back after its health checks pass",
        [doomed.engine, cluster.routers["r"]],
        interval=0.05,
    )
    assert _ready(router)["failing_health_checks"] == []
    assert served_by(4) == {"engine-0", "engine-1"}

    # Every engine dead: not ready, and a request (tried on all, as none is better) says why it failed.
    alive.engine.kill()
    doomed.engine.kill()
    wait_until(
        lambda: _ready(router)["failing_health_checks"] == ["engine-0", "engine-1"],
        30,
        "both engines marked down",
        [cluster.routers["r"]],
        interval=0.05,
    )
    status, ready = http_get(router + "/ready")
    assert (
        status == 503
        and "no worker of model 'tiny-llama' is healthy (failing their health checks: engine-0, engine-1)"
        in json.loads(ready)["problems"]
    ), ready
    status, _, body = http_post_json_headers(router + "/v1/chat/completions", request)
    error = json.loads(body)["error"]
    assert status == 502 and error["code"] == "backend_unavailable", body
    assert "all 2 workers tried failed, as every one fails its health checks" in error["message"], body
