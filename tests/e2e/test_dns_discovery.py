"""Engines found by DNS, with real processes: a control plane, three sim engines (engine-0 with its
agent, the other two without), a DNS server this test controls (`tools/sim_dns.py`, on a port of its
own) publishing SRV records as a headless Service does, and two routers asking it (`--dns-server`):
a round_robin router (the control plane's ListWorkers) and a kv_aware one (its own view of the fleet).

Engines added to the answer join both routers' fleets and get requests without a restart; engines
taken out stop getting them while they still run; engine-0, found by DNS and reported by its agent,
is one worker, the agent's, decided on the index beside the others on load; a resolution that
fails keeps the fleet; an answer that comes back empty empties it only after the grace; a discovered
engine that dies is taken out by the router's health checks."""

from __future__ import annotations

import json

import pytest

from kvroute.prom_text import sample_value, sums_by_label
from kvroute.tools.local_cluster import EngineHandle, LocalCluster, http_get, http_post_json_headers, wait_until
from kvroute.tools.sim_dns import SimDns
from tests.helpers import served_by

pytestmark = pytest.mark.e2e

NAME = "_http._tcp.engines.kvroute.test"
INTERVAL_S, GRACE_S = 0.3, 2.0


def publish(dns: SimDns, *engines: EngineHandle) -> None:
    """The SRV answer: one record per engine, its port, the target localhost (127.0.0.1)."""
    dns.set("localhost", "A", ["127.0.0.1"])
    dns.set(NAME, "SRV", [f"0 0 {e.url.rsplit(':', 1)[1]} localhost." for e in engines])


def found_id(engine: EngineHandle) -> str:
    return engine.url.removeprefix("http://")  # what DNS discovery names it: ADDRESS:PORT


def metrics(router: str) -> str:
    return http_get(router + "/metrics")[1].decode()


def known(router: str) -> set[str]:
    """The workers the router knows for the model (kvroute_router_worker_healthy has one per worker)."""
    return set(sums_by_label(metrics(router), "kvroute_router_worker_healthy", "worker"))


@pytest.fixture
def dns():
    server = SimDns().start()
    yield server
    server.stop()


def test_engines_join_and_leave_the_fleet_with_the_dns_answer(local_fleet, dns: SimDns) -> None:
    cluster: LocalCluster = local_fleet("dns-discovery")
    cluster.start_control_plane()
    reported = cluster.add_sim_engine("engine-0")
    a = cluster.add_sim_engine("engine-a", start_agent=False)
    b = cluster.add_sim_engine("engine-b", start_agent=False)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(1)
    publish(dns, reported, a)
    flags = (
        "--discover-engines",
        f"dnssrv://{NAME}",
        "--dns-server",
        f"127.0.0.1:{dns.port}",
        "--discovery-interval-s",
        str(INTERVAL_S),
        "--discovery-empty-grace-s",
        str(GRACE_S),
        "--health-check-interval-s",
        "0.3",
        "--health-failure-threshold",
        "2",
    )
    rr = cluster.start_router("rr", "round_robin", *flags)
    kv = cluster.start_router("kv", "kv_aware", *flags)
    procs = cluster.all_processes()
    request = cluster.chat_request("You are terse.", "Say hi.")

    # engine-0 is found by DNS and reported by its agent: one worker, the agent's.
    for router in (rr, kv):
        wait_until(lambda r=router: known(r) == {"engine-0", found_id(a)}, 30, "engine-0 and engine-a known", procs)
    assert served_by(rr, request, 4) == {"engine-0", found_id(a)}
    # kv_aware: engine-0 on the index, engine-a on load beside it; no failing open.
    status, _, body = http_post_json_headers(kv + "/v1/route", request)
    decision = json.loads(body)
    assert status == 200 and decision["fail_open"] is False, decision
    assert {w["worker_id"] for w in decision["workers"]} == {"engine-0", found_id(a)}, decision
    assert sample_value(metrics(rr), "kvroute_router_discovered_engines", {"target": f"dnssrv://{NAME}"}) == 2

    # Joins: no restart, requests go to the new engine.
    publish(dns, reported, a, b)
    wait_until(lambda: known(rr) == {"engine-0", found_id(a), found_id(b)}, 30, "engine-b joined", procs)
    assert served_by(rr, request, 6) == {"engine-0", found_id(a), found_id(b)}

    # Leaves: engine-a still runs, but no request goes there once DNS no longer names it.
    publish(dns, reported, b)
    wait_until(lambda: known(rr) == {"engine-0", found_id(b)}, 30, "engine-a left", procs)
    assert a.engine.alive()
    assert served_by(rr, request, 6) == {"engine-0", found_id(b)}

    # A resolution that fails (SERVFAIL) keeps the fleet.
    target = {"target": f"dnssrv://{NAME}"}
    before = sample_value(metrics(rr), "kvroute_router_discovery_failures_total", target) or 0
    dns.failing = "servfail"
    wait_until(
        lambda: (sample_value(metrics(rr), "kvroute_router_discovery_failures_total", target) or 0) >= before + 3,
        30,
        "three failed resolutions",
        procs,
    )
    assert known(rr) == {"engine-0", found_id(b)}
    assert served_by(rr, request, 4) == {"engine-0", found_id(b)}
    dns.failing = None

    # A discovered engine that dies is taken out by its health checks, before a request fails on it.
    b.engine.kill()
    procs = [p for p in procs if p is not b.engine]
    wait_until(
        lambda: sample_value(metrics(rr), "kvroute_router_worker_healthy", {"worker": found_id(b)}) == 0,
        30,
        "engine-b down by its health checks",
        procs,
    )
    assert served_by(rr, request, 4) == {"engine-0"}
    assert not sample_value(metrics(rr), "kvroute_router_backend_errors_total", {"worker": found_id(b)})

    # An empty answer empties the discovered fleet, after the grace; the agent's worker stays.
    dns.clear()
    wait_until(lambda: known(rr) == {"engine-0"} and known(kv) == {"engine-0"}, 30, "the discovered engines gone", procs)
    assert sample_value(metrics(rr), "kvroute_router_discovered_engines", target) == 0
    log = cluster.routers["rr"].log_path.read_text()
    assert f"dnssrv://{NAME} answered no engine; keeping the 2 found before for {GRACE_S:g}s" in log, log[-3000:]
    assert f"left: {found_id(a)}" in log and f"cannot resolve dnssrv://{NAME}" in log, log[-3000:]
