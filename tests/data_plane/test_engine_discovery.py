"""Engines found by DNS (`engine_discovery.py`) against a DNS server on a local port that the test
controls (`tools/sim_dns.py`), and how they join the router's known fleet (`ControlPlaneClient`,
with ListWorkers and with a view, against a control plane in this process), its candidates and its
decisions."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvroute.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, KnownWorker
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.candidates import build_candidates
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.engines.engine_discovery import (
    DiscoveryError,
    EngineDiscovery,
    make_resolver,
    parse_dns_server,
    parse_target,
)
from kvroute.data_plane.service.readiness import router_readiness
from kvroute.data_plane.service.routing import Router
from kvroute.data_plane.service.routing_service import unmonitored_workers
from kvroute.fleet.answer import IndexColumns
from kvroute.tools.sim_dns import SimDns, parse_records
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import MODEL, BidiStream, eventually


@pytest.fixture
def dns():
    server = SimDns().start()
    yield server
    server.stop()


def discovery(dns: SimDns, *specs: str, grace_s: float = 30.0, timeout_s: float = 2.0, clock=None) -> EngineDiscovery:
    return EngineDiscovery(
        [parse_target(s) for s in specs],
        make_resolver(f"127.0.0.1:{dns.port}", timeout_s),
        interval_s=0.05,
        empty_grace_s=grace_s,
        **({"clock": clock} if clock else {}),
    )


# ---------------------------------------------------------------- targets and servers


def test_targets_name_a_port_for_addresses_and_none_for_srv() -> None:
    assert (parse_target("dns://vllm.llm.svc.cluster.local:8000").name, parse_target("dns://v:8000").port) == (
        "vllm.llm.svc.cluster.local",
        8000,
    )
    srv = parse_target("dnssrv://_http._tcp.vllm.llm.svc.cluster.local")
    assert srv.srv and srv.name == "_http._tcp.vllm.llm.svc.cluster.local"
    for bad, why in (
        ("vllm:8000", "neither dns://NAME:PORT nor dnssrv://NAME"),
        ("http://v:8000", "neither"),
        ("dns://vllm", "needs the engines' port"),
        ("dns://vllm:0", "needs the engines' port"),
        ("dns://vllm:http", "needs the engines' port"),
        ("dnssrv://_http._tcp.v:8000", "takes no port"),
        ("dns://:8000", "no DNS name"),
        ("dns://a..b:8000", "is not a DNS name"),
        (f"dns://{'x' * 64}.test:1", "is not a DNS name"),
    ):
        with pytest.raises(DiscoveryError, match=why):
            parse_target(bad)
    assert parse_dns_server("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_dns_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_dns_server("[fd00::a]:53") == ("fd00::a", 53) and parse_dns_server("fd00::a") == ("fd00::a", 53)
    for bad in ("kube-dns.kube-system", "127.0.0.1:dns", "127.0.0.1:70000", "[fd00::a]x"):
        with pytest.raises(DiscoveryError):
            parse_dns_server(bad)


def test_the_router_refuses_bad_discovery_flags_with_one_line(tiny_model_dir, capsys) -> None:
    from kvroute.cli import main

    for argv, said in (
        (["--discover-engines", "vllm:8000"], "argument --discover-engines: 'vllm:8000' is neither"),
        (["--dns-server", "kube-dns"], "argument --dns-server: 'kube-dns': the DNS server must be an IP"),
        (["--dns-server", "127.0.0.1:5353"], "--dns-server needs --discover-engines"),
        (["--discover-engines", "dns://v:1", "--discovery-interval-s", "0"], "must be positive"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(["router", "--tokenizer", str(tiny_model_dir), "--port", "0", "--grpc-port", "off", *argv])
        assert stop.value.code == 2 or said in str(stop.value.code), argv
        err = capsys.readouterr().err + str(stop.value.code)
        assert said in err, (argv, err)


# ---------------------------------------------------------------- resolving


async def test_address_records_give_an_engine_per_address_at_the_port(dns: SimDns) -> None:
    dns.set("engines.test", "A", ["10.1.2.4", "10.1.2.3"])
    dns.set("engines.test", "AAAA", ["fd00::1"])  # IPv4 first, as for --control-plane names
    dns.set("v6.test", "AAAA", ["fd00::2"])
    d = discovery(dns, "dns://engines.test:8000", "dns://v6.test:9000")
    await d.resolve_once()
    assert d.engines() == {
        "10.1.2.3:8000": "http://10.1.2.3:8000",
        "10.1.2.4:8000": "http://10.1.2.4:8000",
        "[fd00::2]:9000": "http://[fd00::2]:9000",
    }
    assert d.version == 1 and d.states["dns://engines.test:8000"].last_success_unix > 0


async def test_srv_records_give_each_target_at_its_own_port(dns: SimDns) -> None:
    dns.set(
        "_http._tcp.engines.test",
        "SRV",
        ["0 0 8001 pod-a.engines.test.", "0 0 8002 pod-b.engines.test.", "0 0 8003 gone.engines.test.", "0 0 0 ."],
    )
    dns.set("pod-a.engines.test", "A", ["10.0.0.1"])
    dns.set("pod-b.engines.test", "A", ["10.0.0.2"])  # gone.engines.test: NXDOMAIN, a pod that just left
    d = discovery(dns, "dnssrv://_http._tcp.engines.test")
    await d.resolve_once()
    assert d.engines() == {"10.0.0.1:8001": "http://10.0.0.1:8001", "10.0.0.2:8002": "http://10.0.0.2:8002"}


async def test_joins_and_leaves_are_logged_and_move_the_version(dns: SimDns, caplog) -> None:
    caplog.set_level(logging.INFO, "kvroute.router.discovery")
    dns.set("engines.test", "A", ["10.0.0.1", "10.0.0.2"])
    d = discovery(dns, "dns://engines.test:8000")
    await d.resolve_once()
    await d.resolve_once()  # the same answer: nothing changed
    assert d.version == 1
    dns.set("engines.test", "A", ["10.0.0.2", "10.0.0.3"])
    await d.resolve_once()
    assert d.version == 2 and set(d.engines()) == {"10.0.0.2:8000", "10.0.0.3:8000"}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dns://engines.test:8000: 2 engines (joined: 10.0.0.1:8000, 10.0.0.2:8000; left: -)",
        "dns://engines.test:8000: 2 engines (joined: 10.0.0.3:8000; left: 10.0.0.1:8000)",
    ], lines


@pytest.mark.parametrize("failing", ["servfail", "drop"])
async def test_a_failed_resolution_keeps_the_engines_counts_and_logs_once(dns: SimDns, failing: str, caplog) -> None:
    caplog.set_level(logging.INFO, "kvroute.router.discovery")
    dns.set("engines.test", "A", ["10.0.0.1"])
    d = discovery(dns, "dns://engines.test:8000", timeout_s=0.3)
    await d.resolve_once()
    dns.failing = failing
    for _ in range(3):
        await d.resolve_once()
    state = d.states["dns://engines.test:8000"]
    assert d.engines() == {"10.0.0.1:8000": "http://10.0.0.1:8000"} and d.version == 1 and state.failures == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("cannot resolve dns://engines.test:8000 (A engines.test")
    assert "keeping its 1 engines" in warned[0]
    assert ("SERVFAIL" if failing == "servfail" else "no answer within 0.3s") in warned[0], warned
    dns.failing = None
    await d.resolve_once()
    assert "dns://engines.test:8000 resolves again (1 engines)" in caplog.text


async def test_an_empty_answer_empties_the_target_only_after_the_grace(dns: SimDns, caplog) -> None:
    caplog.set_level(logging.INFO, "kvroute.router.discovery")
    now = [100.0]
    dns.set("engines.test", "A", ["10.0.0.1"])
    d = discovery(dns, "dns://engines.test:8000", grace_s=10.0, clock=lambda: now[0])
    await d.resolve_once()
    dns.clear()  # NXDOMAIN
    await d.resolve_once()
    now[0] += 9.0
    await d.resolve_once()
    assert d.engines() == {"10.0.0.1:8000": "http://10.0.0.1:8000"}
    dns.set("engines.test", "A", ["10.0.0.1"])  # back within the grace: nothing changed
    await d.resolve_once()
    assert d.version == 1 and "dns://engines.test:8000 answers again" in caplog.text
    dns.set("engines.test", "A", [])
    dns.set("engines.test", "TXT", ['"no address"'])  # the name exists, with no A or AAAA record: NODATA
    await d.resolve_once()
    now[0] += 9.0
    await d.resolve_once()
    assert d.engines() and d.version == 1
    now[0] += 1.0
    await d.resolve_once()
    assert d.engines() == {} and d.version == 2
    assert "answered no engine; keeping the 1 found before for 10s (--discovery-empty-grace-s)" in caplog.text
    assert "dns://engines.test:8000: 0 engines (joined: -; left: 10.0.0.1:8000)" in caplog.text


async def test_the_discovery_loop_follows_the_answer_until_closed(dns: SimDns) -> None:
    dns.set("engines.test", "A", ["10.0.0.1"])
    d = discovery(dns, "dns://engines.test:8000")
    d.start()
    try:
        await eventually(lambda: d.engines(), 10, what="the first answer")
        dns.set("engines.test", "A", ["10.0.0.1", "10.0.0.2"])
        await eventually(lambda: len(d.engines()) == 2, 10, what="the second engine")
    finally:
        await d.close()
    rounds = d.rounds
    await asyncio.sleep(0.2)
    assert d.rounds == rounds  # closed: no more queries


def test_the_records_file_is_zone_file_lines() -> None:
    records = parse_records("# engines\nengines.test A 10.0.0.1\n_http._tcp.e.test SRV 0 0 8001 pod.e.test.\n\n")
    assert len(records) == 2
    with pytest.raises(ValueError, match="line 1"):
        parse_records("engines.test A not-an-address")


# ---------------------------------------------------------------- the known fleet


@pytest.fixture
async def control_plane():
    server = ControlPlaneServer(ControlPlaneConfig(listen="127.0.0.1:0", heartbeat_timeout_s=30))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.ControlPlaneStub(channel), f"127.0.0.1:{port}"
    await channel.close()
    await server.stop(0)


async def register(stub: pb_grpc.ControlPlaneStub, worker_id: str, endpoint: str) -> BidiStream:
    agent = BidiStream(stub.Connect, pb.AgentMessage)
    await agent.send(register=pb.RegisterWorker(worker_id=worker_id, model=MODEL, engine="sim", block_size=16, endpoint=endpoint))
    await agent.recv()
    return agent


@pytest.mark.parametrize("index", ["remote", "local"])
async def test_found_engines_join_the_known_fleet_and_one_an_agent_reports_is_its_worker(
    control_plane, dns: SimDns, index: str, caplog
) -> None:
    caplog.set_level(logging.INFO, "kvroute.router.cp")
    stub, address = control_plane
    agent = await register(stub, "gpu-0", "http://10.0.0.1:8000/")
    dns.set("engines.test", "A", ["10.0.0.1", "10.0.0.2"])
    found = discovery(dns, "dns://engines.test:8000")
    await found.resolve_once()
    view = FleetView("r", models={MODEL}) if index == "local" else None
    client = ControlPlaneClient(address, use_session=False, view=view, discovery=found)
    client.start()
    try:
        await eventually(lambda: client.reachable and (view is None or view.synced), 10, what="the control plane")
        known = client.workers_for(MODEL)
        assert [(w.worker_id, w.model, w.endpoint) for w in known] == [
            ("gpu-0", MODEL, "http://10.0.0.1:8000"),
            ("10.0.0.2:8000", "", "http://10.0.0.2:8000"),
        ]
        if view is not None:
            assert client.workers_for(MODEL) is known  # a decision reads it: cached while neither side changes
        assert [w.worker_id for w in client.workers_for(MODEL, "some-adapter")] == ["10.0.0.2:8000"]
        assert unmonitored_workers(known) == {"10.0.0.2:8000": "http://10.0.0.2:8000"}  # health-checked
        assert client.fleet_source(MODEL) == ("view" if view else "control_plane")
        assert (
            "found by DNS and known already as another worker (an agent reports on it, routed as that worker): 10.0.0.1:8000"
        ) in caplog.text
    finally:
        await agent.close()
        await client.close()


async def test_with_engines_found_by_dns_alone_the_router_is_ready_and_routes_on_load(dns: SimDns) -> None:
    dns.set("engines.test", "A", ["10.0.0.1", "10.0.0.2"])
    found = discovery(dns, "dns://engines.test:8000")
    await found.resolve_once()
    view = FleetView("r", models={MODEL})
    client = ControlPlaneClient("127.0.0.1:1", use_session=False, view=view, discovery=found)  # never reached
    assert client.fleet_source(MODEL) == "discovered"
    readiness = router_readiness(client, MODEL, BackendHealth())
    assert readiness.ready and readiness.status == "degraded", readiness.body()
    assert readiness.details["fleet"] == "discovered" and readiness.details["workers"] == 2
    assert any("routing on load over the DNS-discovered fleet" in p for p in readiness.problems), readiness.problems

    router = Router(client, make_policy("kv_aware"), RouterInflight())
    decision = await router.decide(MODEL, list(range(64)))
    assert decision.worker_id in found.engines() and decision.fail_open  # the control plane is down: it shows
    client.reachable = True  # reachable, and no agent reports on any of them: the index is not asked
    decision = await router.decide(MODEL, list(range(64)))
    assert not decision.fail_open and {c.worker_id for c in decision.candidates} == set(found.engines())

    dns.clear()
    empty = discovery(dns, "dns://engines.test:8000")
    await empty.resolve_once()
    client = ControlPlaneClient("127.0.0.1:1", use_session=False, discovery=empty)
    readiness = router_readiness(client, MODEL, BackendHealth())
    assert not readiness.ready
    assert "--discover-engines: dns://engines.test:8000 found none" in readiness.problems[0], readiness.problems


def test_engines_no_agent_reports_on_follow_the_index_answer_on_load() -> None:
    known = [
        KnownWorker("gpu-0", "m", "http://10.0.0.1:8000", 16, pb.WorkerLoad(running_requests=3)),
        KnownWorker("10.0.0.2:8000", "", "http://10.0.0.2:8000", 16, pb.WorkerLoad()),
    ]

    def columns(*ids: str) -> IndexColumns:
        n = len(ids)
        return IndexColumns(list(ids), [2] * n, [0] * n, [0] * n, [0] * n, [0] * n, [0] * n, [3] * n, [0] * n, [0.0] * n)

    out = build_candidates(known, RouterInflight(), {}, 64, columns("gpu-0"))
    assert [(c.worker_id, c.cached_tokens, c.running_requests) for c in out] == [("gpu-0", 32, 3), ("10.0.0.2:8000", 0, 0)]
    # An answer naming no known worker: none from it (the decision fails open over every known worker).
    assert build_candidates(known, RouterInflight(), {}, 64, columns("elsewhere")) == []
