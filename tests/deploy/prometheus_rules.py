"""deploy/prometheus/kvroute-prometheusrule.yaml from deploy/prometheus/kvroute-alerts.yaml, the one source
of kvroute's alert rules: the PrometheusRule (prometheus-operator) holds exactly its groups.

    .venv/bin/python -m tests.deploy.prometheus_rules   # write the PrometheusRule after editing the rules

tests/deploy/test_prometheus.py fails while the written file differs from what this makes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.helpers import REPO

RULES = REPO / "deploy" / "prometheus" / "kvroute-alerts.yaml"
PROMETHEUS_RULE = REPO / "deploy" / "prometheus" / "kvroute-prometheusrule.yaml"
HEADER = (
    "# Generated from kvroute-alerts.yaml by `python -m tests.deploy.prometheus_rules`: edit that file, then run it\n"
    "# (tests/deploy/test_prometheus.py fails while the two differ). A Prometheus selects PrometheusRules by\n"
    "# its ruleSelector: add the labels yours requires (kustomize `labels`).\n"
)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line expressions stay literal blocks, as in the rules file.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def prometheus_rule(rules: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvroute"},
        "spec": {"groups": rules["groups"]},
    }


def render(rules_path: Path = RULES) -> str:
    rules = yaml.safe_load(rules_path.read_text())
    return HEADER + yaml.dump(prometheus_rule(rules), Dumper=_Dumper, sort_keys=False, width=1000)


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(render())
