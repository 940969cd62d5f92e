"""Rendering deploy/kubernetes and reading what it renders (shared by the tests in this folder)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.deploy import custom_resources
from tests.deploy.conftest import DeployTools
from tests.helpers import REPO

KUSTOMIZE = REPO / "deploy" / "kubernetes"
CONFIG_DIR = "/etc/kvroute"  # where every kvroute container mounts the kvroute-config ConfigMap


def render(tools: DeployTools, overlay: str, components: tuple[str, ...], workdir: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of the overlay with the components, as users combine them: a kustomization of
    their own that names the overlay as its resource (paths relative: kustomize refuses absolute ones)."""
    root = workdir / "kustomization"
    root.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(KUSTOMIZE, root))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(rel / "overlays" / overlay)],
        "components": [str(rel / "components" / c) for c in components],
    }
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run(
        [str(tools.kubectl), "kustomize", str(root)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay} {components}:\n{result.stderr}"
    (workdir / "rendered.yaml").write_text(result.stdout)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# kubernetes-validate's line for a kind it has no schema for (a custom resource): a warning, exit 0.
NO_SCHEMA = re.compile(r"^WARN .* Couldn't find schema for kind (\S+) with api version (\S+) ", re.MULTILINE)


def validate(tools: DeployTools, path: Path) -> subprocess.CompletedProcess[str]:
    """Every object of `path` against its schema, strictly (an unknown field fails): the built-in kinds
    with kubernetes-validate, the custom resources with tests/deploy/custom_resources.py. A kind neither
    has a schema for fails too (kubernetes-validate alone would only warn)."""
    builtin = subprocess.run(
        [str(tools.kubernetes_validate), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    unknown = {(api, kind) for kind, api in NO_SCHEMA.findall(builtin.stdout)} - set(custom_resources.SCHEMAS)
    custom = subprocess.run(
        [str(tools.python), str(Path(custom_resources.__file__)), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    failed = builtin.returncode or custom.returncode or unknown
    return subprocess.CompletedProcess(
        builtin.args,
        1 if failed else 0,
        builtin.stdout
        + custom.stdout
        + "".join(f"ERROR no schema for {k} {a}: add one to custom_resources.py\n" for a, k in sorted(unknown)),
        builtin.stderr + custom.stderr,
    )


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def kvroute_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in workloads(docs).values():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if container["image"].split(":")[0].rsplit("/", 1)[-1] == "kvroute":
                yield pod, container


def container_env(
    container: dict[str, Any], field_refs: Mapping[str, str], secrets: Mapping[tuple[str, str], str] | None = None
) -> dict[str, str]:
    """The container's environment as Kubernetes sets it: downward-API values from `field_refs`, Secret
    keys from `secrets` ((secret name, key) -> value), and $(NAME) expanded from the variables defined
    before it."""
    values: dict[str, str] = {}
    for env in container.get("env", []):
        if "secretKeyRef" in env.get("valueFrom", {}):
            ref = env["valueFrom"]["secretKeyRef"]
            values[env["name"]] = (secrets or {})[(ref["name"], ref["key"])]
        elif "valueFrom" in env:
            values[env["name"]] = field_refs[env["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            values[env["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), env["value"])
    return values


def expand_args(container: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    """The container's args with $(NAME) expanded from its environment, as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container.get("args", [])]


def selects(selector: dict[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In / NotIn / Exists / DoesNotExist) matches `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, present = labels.get(e["key"]), e["key"] in labels
        if not {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]:
            return False
    return True


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def config_files(docs: list[dict[str, Any]], pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The files of the ConfigMap the container mounts at /etc/kvroute."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]["data"]
