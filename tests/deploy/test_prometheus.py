"""deploy/prometheus: the PrometheusRule is the plain rules file's groups, exactly (one source), and every
ServiceMonitor and PodMonitor scrapes a port the rendered manifests name."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy import prometheus_rules
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import by_kind, pod_labels, render, selects, workloads


def test_the_prometheus_rule_is_generated_from_the_rules_file() -> None:
    assert prometheus_rules.PROMETHEUS_RULE.read_text() == prometheus_rules.render(), (
        "deploy/prometheus/kvroute-prometheusrule.yaml differs from kvroute-alerts.yaml's rules: "
        "run .venv/bin/python -m tests.deploy.prometheus_rules"
    )
    rules = yaml.safe_load(prometheus_rules.RULES.read_text())
    assert yaml.safe_load(prometheus_rules.PROMETHEUS_RULE.read_text())["spec"]["groups"] == rules["groups"]


def test_a_changed_rule_is_a_difference(tmp_path: Path) -> None:
    """The comparison above sees an edit of the rules file (a threshold)."""
    edited = tmp_path / "alerts.yaml"
    edited.write_text(prometheus_rules.RULES.read_text().replace("> 900", "> 901"))
    assert prometheus_rules.render(edited) != prometheus_rules.PROMETHEUS_RULE.read_text()


def test_every_monitor_scrapes_a_named_port(deploy_tools: DeployTools, tmp_path: Path) -> None:
    docs = render(deploy_tools, "ha", ("gateway", "prometheus-operator"), tmp_path)
    services, pods = by_kind(docs, "Service"), workloads(docs)
    for name, monitor in by_kind(docs, "ServiceMonitor").items():
        matched = [s for s in services.values() if selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert len(matched) == 1, (name, [s["metadata"]["name"] for s in matched])
        ports = {p["name"] for p in matched[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports, (name, ports)
    for name, monitor in by_kind(docs, "PodMonitor").items():
        matched = [w for w in pods.values() if selects(monitor["spec"]["selector"], pod_labels(w))]
        assert len(matched) == 1, name
        ports = {p["name"] for c in matched[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports, (name, ports)
