"""deploy/kubernetes: every overlay, alone and with each component, renders with `kubectl kustomize` and
validates offline against the Kubernetes schemas (`kubernetes-validate --strict`); every kvroute
container's command, flags, KVROUTE_* environment and TOML configuration parse with the real CLI; the
probes, budgets and overlays are what the README says. The Dockerfile passes hadolint."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute import cli
from kvroute.config import has_key
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import (
    CONFIG_DIR,
    by_kind,
    config_files,
    container_env,
    kvroute_containers,
    render,
    validate,
    workloads,
)
from tests.helpers import REPO, pyproject

OVERLAYS = ("single", "ha")
COMPONENTS = ((), ("sglang",), ("trtllm",), ("mtls",), ("sglang", "mtls"), ("trtllm", "mtls"))
KVROUTE_COMMANDS = ("control-plane", "router", "agent")
# What the downward API would give a pod, for expanding $(POD_NAME)-style references.
FIELD_REFS = {"metadata.name": "kvroute-pod-0", "status.podIP": "10.0.0.7"}


TLS_MOUNT = "/etc/kvroute/tls"
TLS_FILES = ("tls.crt", "tls.key", "ca.crt")  # what the Secret holds (cert-manager's names)


def write_test_certificates(directory: Path) -> None:
    """A self-signed certificate as the Secret would hold it, for flags that check their file at start."""
    directory.mkdir(parents=True)
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                           "-nodes", "-days", "1", "-subj", "/CN=kvroute-control-plane",
                           "-keyout", str(directory / "tls.key"), "-out", str(directory / "tls.crt")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert made.returncode == 0, f"openssl could not make a test certificate: {made.stderr}"
    (directory / "ca.crt").write_bytes((directory / "tls.crt").read_bytes())


def tls_flags_exist() -> bool:
    """The security work adds --tls-cert/--tls-key/--tls-ca; until it has landed, components/mtls names
    keys no command has, and the check below must fail on exactly that (strict xfail)."""
    return all(has_key(cli.command_parser(name)[0], key) for name in KVROUTE_COMMANDS
               for key in ("tls_cert", "tls_key", "tls_ca"))


def variants() -> Iterator[Any]:
    for overlay in OVERLAYS:
        for components in COMPONENTS:
            marks = []
            if "mtls" in components and not tls_flags_exist():
                marks.append(pytest.mark.xfail(strict=True, raises=AssertionError,
                                               reason="tls_cert/tls_key/tls_ca: the TLS flags are not in the CLI yet"))
            yield pytest.param(overlay, components, id="+".join((overlay, *components)), marks=marks)


@pytest.mark.parametrize(("overlay", "components"),
                         [pytest.param(o, c, id="+".join((o, *c))) for o in OVERLAYS for c in COMPONENTS])
def test_every_overlay_renders_and_validates_offline(deploy_tools: DeployTools, tmp_path: Path, overlay: str,
                                                     components: tuple[str, ...]) -> None:
    docs = render(deploy_tools, overlay, components, tmp_path)
    result = validate(deploy_tools, tmp_path / "rendered.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "kvroute-control-plane"), ("Deployment", "kvroute-router"), ("Deployment", "kvroute-engine"),
            ("Service", "kvroute-control-plane"), ("Service", "kvroute-router")} <= kinds
    assert by_kind(docs, "Service")["kvroute-control-plane"]["spec"]["clusterIP"] == "None"  # headless


def test_the_validator_rejects_what_the_api_server_would(deploy_tools: DeployTools, tmp_path: Path) -> None:
    """The validation is a real check: a misspelt field and a wrong type in a rendered overlay fail it."""
    docs = render(deploy_tools, "single", (), tmp_path)
    router = workloads(docs)["kvroute-router"]
    router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = {"name": "http"}
    router["spec"]["replica"] = 2
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump_all(docs))
    result = validate(deploy_tools, tmp_path / "broken.yaml")
    assert result.returncode != 0
    assert "deployment/kvroute-router" in result.stdout + result.stderr


def parse_container(command: str, container: dict[str, Any], config_dir: Path,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The container's arguments and environment through the real CLI, its config directory (the
    ConfigMap's files) at `config_dir`. Fails with the CLI's own one-line error."""
    args = [str(config_dir) if a == CONFIG_DIR else a for a in container["args"][1:]]
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)
    for name, value in container_env(container, FIELD_REFS).items():
        monkeypatch.setenv(name, value)
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            return cli.parse_configured(command, args)
    except SystemExit:
        raise AssertionError(f"{command}: {stderr.getvalue().strip()}") from None


@pytest.mark.parametrize(("overlay", "components"), list(variants()))
def test_every_flag_env_and_config_key_the_manifests_use_exists(deploy_tools: DeployTools, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, overlay: str,
                                                                components: tuple[str, ...]) -> None:
    docs = render(deploy_tools, overlay, components, tmp_path)
    seen = set()
    for pod, container in kvroute_containers(docs):
        command = container["args"][0]
        assert command in KVROUTE_COMMANDS, container["args"]
        assert "command" not in container, "the image's entrypoint is kvroute; containers pass arguments only"
        # The ConfigMap mounted at /etc/kvroute, as the directory the container reads.
        config_dir = tmp_path / "config" / command
        config_dir.mkdir(parents=True)
        tls_dir = tmp_path / "tls"  # where the kvroute-tls Secret would be mounted (components/mtls)
        for name, text in config_files(docs, pod, container).items():
            tomllib.loads(text)
            (config_dir / name).write_text(text.replace(TLS_MOUNT, str(tls_dir)))
        if "mtls" in components and not tls_dir.exists():
            write_test_certificates(tls_dir)
        # Every KVROUTE_* variable is a key of this command (the config layer itself ignores others).
        parser = cli.command_parser(command)[0]
        for env in container.get("env", []):
            if env["name"].startswith("KVROUTE_"):
                key = env["name"].removeprefix("KVROUTE_").lower()
                assert has_key(parser, key), f"{command}: {env['name']} sets no flag of kvroute {command}"
        args, effective = parse_container(command, container, config_dir, monkeypatch)
        sources = {s.key: s.source for s in effective.settings}
        seen.add(command)
        if command == "agent":
            assert args.worker_id == FIELD_REFS["metadata.name"] and sources["worker_id"] == "env KVROUTE_WORKER_ID"
            assert args.engine_url == f"http://{FIELD_REFS['status.podIP']}:8000"
            assert args.engine == ("sglang" if "sglang" in components else "trtllm" if "trtllm" in components else "vllm")
        if command in ("router", "agent"):
            assert args.control_plane == "kvroute-control-plane:50051"
        if command == "control-plane":
            assert bool(args.redis) == (overlay == "ha"), args.redis
        if "mtls" in components:
            assert (args.tls_cert, args.tls_key, args.tls_ca) == tuple(str(tls_dir / f) for f in TLS_FILES), command
            assert any(m["mountPath"] == TLS_MOUNT for m in container["volumeMounts"]), command
    assert seen == set(KVROUTE_COMMANDS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_resources_budgets_and_replicas(deploy_tools: DeployTools, tmp_path: Path, overlay: str) -> None:
    docs = render(deploy_tools, overlay, (), tmp_path)
    pods = workloads(docs)
    for name, workload in pods.items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert {"readinessProbe", "livenessProbe", "resources"} <= set(container), (name, container["name"])
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], name
    # The gRPC server is probed with gRPC health checking, the HTTP processes on /ready and /health.
    control_plane = pods["kvroute-control-plane"]["spec"]["template"]["spec"]["containers"][0]
    assert control_plane["readinessProbe"]["grpc"]["port"] == 50051
    assert control_plane["livenessProbe"]["httpGet"]["path"] == "/health"
    router = pods["kvroute-router"]["spec"]["template"]["spec"]["containers"][0]
    assert (router["readinessProbe"]["httpGet"]["path"], router["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    agent = next(c for c in pods["kvroute-engine"]["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
    assert (agent["readinessProbe"]["httpGet"]["path"], agent["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    # Every workload has a PodDisruptionBudget selecting exactly its pods.
    budgets = by_kind(docs, "PodDisruptionBudget")
    for name, workload in pods.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(set(b["spec"]["selector"]["matchLabels"].items()) <= set(labels.items()) for b in budgets.values()), name
    replicas = pods["kvroute-control-plane"]["spec"]["replicas"]
    if overlay == "single":
        assert replicas == 1 and "kvroute-redis" not in pods
    else:
        assert replicas == 3 and "kvroute-redis" in pods and "kvroute-redis" in by_kind(docs, "Service")
        config = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
        redis = tomllib.loads(config["20-ha.toml"])["control-plane"]["redis"]
        assert redis.startswith("redis://kvroute-redis:")


def test_the_dockerfile_is_multi_stage_non_root_and_lints_clean(deploy_tools: DeployTools) -> None:
    dockerfile = REPO / "Dockerfile"
    result = subprocess.run([str(deploy_tools.hadolint), str(dockerfile)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    stages = re.split(r"(?m)^FROM ", dockerfile.read_text())[1:]
    assert len(stages) >= 2, "multi-stage: build, then a final stage holding the virtualenv only"
    final = stages[-1]
    assert re.search(r"(?m)^USER (\d+)(:\d+)?$", final) and not re.search(r"(?m)^USER 0\b", final), "numeric non-root"
    assert re.search(r"(?m)^COPY --from=build ", final)
    assert not re.search(r"(?m)^RUN ", final), "the final stage installs nothing (no compiler, no pip run)"
    # The build stage copies every folder the wheel packages.
    copied = set(re.findall(r"(?m)^COPY (\S+) ", stages[0]))
    assert set(pyproject()["tool"]["setuptools"]["package-dir"].values()) <= copied
    ignored = (REPO / ".dockerignore").read_text()
    for folder in pyproject()["tool"]["setuptools"]["package-dir"].values():
        assert f"!{folder}/" in ignored, f".dockerignore leaves {folder}/ out of the build context"
