"""The metrics users read, checked against live processes: a control plane (replica over Redis, with its
periodic audit), a sim engine with its agent and a router (which also finds the engine by DNS), each
scraped on its /metrics after real traffic. Fails if a table of docs/metrics.md names a metric no process exposes (or with
another type or labels), if a kvroute metric is missing from its tables, or if a panel of the Grafana dashboard or an
alert rule names a metric that does not exist."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.prom_text import metric_names
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json, wait_until
from kvroute.tools.redis_harness import RedisServer, temp_workdir
from kvroute.tools.sim_dns import SimDns
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import REPO

pytestmark = pytest.mark.e2e

DASHBOARD = REPO / "deploy" / "grafana" / "kvroute-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "kvroute-alerts.yaml"
CATALOGUE = REPO / "docs" / "metrics.md"


@dataclass(frozen=True)
class Family:
    name: str  # as exposed: a counter with its _total
    type: str
    labels: frozenset[str] | None  # None: no sample yet to read them from


@dataclass
class Scrape:
    families: dict[str, Family]  # kvroute's own, by exposed name
    names: set[str]  # every name PromQL may use, across all processes (engines' included)


def _families(text: str) -> dict[str, Family]:
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created") or not family.name.startswith("kvroute_"):
            continue  # _created: prometheus_client's creation-time series beside each counter/histogram
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le") if family.samples else None
        out[name] = Family(name, family.type, labels)
    return out


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(temp_workdir()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dns() -> Iterator[SimDns]:
    server = SimDns().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scrape(module_local_fleet, redis_server: RedisServer, dns: SimDns) -> Scrape:
    cluster: LocalCluster = module_local_fleet("catalogue")
    cp_metrics = f"http://127.0.0.1:{free_port()}"
    cluster.start_control_plane(
        extra_args=("--metrics-port", cp_metrics.rsplit(":", 1)[1], "--redis", redis_server.url, "--audit-interval-s", "0.5")
    )
    wait_until(lambda: http_get(cp_metrics + "/ready")[0] == 200, 30, "the replica ready", [cluster.control_plane])
    engine = cluster.start_sim_fleet(1)[0]
    grpc_port = free_port()
    # The engine is also found by DNS (and so is one worker, its agent's): the discovery metrics exist.
    dns.set("engines.catalogue.test", "A", ["127.0.0.1"])
    router = cluster.start_router(
        "r",
        "kv_aware",
        "--grpc-port",
        str(grpc_port),
        "--discover-engines",
        f"dns://engines.catalogue.test:{engine.url.rsplit(':', 1)[1]}",
        "--dns-server",
        f"127.0.0.1:{dns.port}",
    )
    wait_until(lambda: http_get(router + "/ready")[0] == 200, 30, "the router ready", cluster.all_processes())
    chat = cluster.chat_request("You are a terse assistant. " * 20, "Say hi.")
    for body in (chat, chat, {**chat, "stream": True}):
        status, raw = http_post_json(router + "/v1/chat/completions", body)
        assert status == 200, raw
    assert http_get(router + "/nowhere")[0] == 404
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.RouterStub(channel)
        assert stub.Route(pb.RouteRequest(model=cluster.model, prompt="Say hi."), timeout=10).worker_id
        with pytest.raises(grpc.RpcError):
            stub.Route(pb.RouteRequest(model="no-such-model", prompt="x"), timeout=10)
    urls = [cp_metrics, engine.agent_metrics_url, router, engine.url]

    def audited() -> bool:
        return "kvroute_cp_audit_last_success_timestamp_seconds{" in http_get(cp_metrics + "/metrics")[1].decode()

    wait_until(audited, 20, "a periodic audit", cluster.all_processes())
    wait_until(
        lambda: "kvroute_router_discovered_engines{" in http_get(router + "/metrics")[1].decode(),
        20,
        "the engine found by DNS",
        cluster.all_processes(),
    )
    families: dict[str, Family] = {}
    names: set[str] = set()
    for url in urls:
        status, body = http_get(url + "/metrics")
        assert status == 200, url
        families |= _families(body.decode())
        names |= metric_names(body.decode())
    return Scrape(families, names)


# ---------------------------------------------------------------- docs/metrics.md's tables

ROW = re.compile(r"^\| `([a-zA-Z_:][a-zA-Z0-9_:]*)` \| (\w+) \| ([^|]*) \| [^|]+ \|$")


def catalogue_rows() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/metrics.md's tables (one per process): exposed name -> (type, label names)."""
    rows = {}
    for line in CATALOGUE.read_text().splitlines():
        if found := ROW.match(line):
            labels = frozenset(re.findall(r"`(\w+)`", found.group(3)))
            rows[found.group(1)] = (found.group(2), labels)
    return rows


def test_the_catalogue_holds_every_metric_and_only_those(scrape: Scrape) -> None:
    rows = catalogue_rows()
    assert len(rows) >= 50, "docs/metrics.md's tables were not found or not parsed"
    assert not (unknown := sorted(set(rows) - set(scrape.families))), (
        f"docs/metrics.md names metrics no process exposes: {unknown}"
    )
    assert not (missing := sorted(set(scrape.families) - set(rows))), f"metrics missing from docs/metrics.md: {missing}"
    for name, (kind, labels) in rows.items():
        family = scrape.families[name]
        assert kind == family.type, f"{name}: docs/metrics.md says {kind}, the process exposes a {family.type}"
        if family.labels is not None:
            assert labels == family.labels, (
                f"{name}: docs/metrics.md says labels {sorted(labels)}, exposed {sorted(family.labels)}"
            )


def test_only_counters_end_in_total_and_units_are_base_units(scrape: Scrape) -> None:
    for name, family in scrape.families.items():
        if family.type != "counter":
            assert not name.endswith("_total"), f"{name}: a {family.type} named like a counter"
        assert not re.search(r"_(ms|millis|milliseconds|us|micros|kb|mb|kib|mib)(_|$)", name), f"{name}: not a base unit"
        if family.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: kvroute's histograms time things, in seconds"


# ---------------------------------------------------------------- dashboard and alert rules

# What a PromQL expression may name besides metrics: functions and aggregations (followed by "("),
# keywords, and the series Prometheus itself adds when it scrapes.
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "up",
    "le",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression refers to: identifiers left once strings, label matchers, range
    selectors, grouping clauses, function calls and keywords are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers (strings inside already gone)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables ($__rate_interval)
    names = set()
    for found in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        if found.group(2) is None and found.group(1) not in PROMQL_WORDS:
            names.add(found.group(1))
    return names


def test_promql_names_are_read_out_of_expressions() -> None:
    expr = (
        'sum by (worker) (rate(kvroute_router_proxied_requests_total{policy=~"kv_.*"}[$__rate_interval])) / '
        'on (worker) group_left() max(kvroute_build_info{version!="x,y}"}) > bool 0.5 unless '
        "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m]))) "
        "or time() - kvroute_cp_audit_last_success_timestamp_seconds > 3e2"
    )
    assert promql_metric_names(expr) == {
        "kvroute_router_proxied_requests_total",
        "kvroute_build_info",
        "vllm:time_to_first_token_seconds_bucket",
        "kvroute_cp_audit_last_success_timestamp_seconds",
    }


def dashboard_expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            out.append((panel["title"], target["expr"]))
    return out


def alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_panel_and_rule_names_metrics_that_exist(scrape: Scrape, source: str) -> None:
    exprs = dashboard_expressions() if source == "dashboard" else alert_expressions()
    assert len(exprs) >= 4
    unknown = {(title, name) for title, expr in exprs for name in promql_metric_names(expr) if name not in scrape.names}
    assert not unknown, f"{source} names metrics no live process exposes: {sorted(unknown)}"
    assert all(promql_metric_names(expr) for _, expr in exprs), "an expression names no metric at all"


def test_the_alert_rules_cover_what_operators_are_paged_for() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    names = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule.get("alert")
        assert rule["labels"].get("severity") in {"page", "ticket", "info"}, rule["alert"]
        assert rule["annotations"].get("summary") and rule["annotations"].get("description"), rule["alert"]
    assert {
        "KvrouteIndexStale",
        "KvrouteIndexDivergent",
        "KvrouteFailOpenRateHigh",
        "KvrouteAgentDisconnected",
        "KvrouteReplicaLagging",
        "KvrouteReplicaRouterSessionsDiverge",
    } <= names


def test_the_dashboard_is_importable_json_with_one_routing_quality_panel() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["panels"], list)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    quality = [p for p in board["panels"] if p["title"].startswith("Routing quality")]
    assert len(quality) == 1
    exprs = " ".join(t["expr"] for t in quality[0]["targets"])
    assert "kvroute_router_predicted_cached_tokens_total" in exprs and "kvroute_router_engine_cached_tokens_total" in exprs
