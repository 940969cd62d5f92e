"""deploy/kubernetes: every overlay, alone and with each component, renders with `kubectl kustomize` and
validates offline and strictly (`kubernetes-validate --strict` for Kubernetes' kinds, the schemas of
tests/deploy/custom_resources.py for InferencePool, HTTPRoute and prometheus-operator's kinds); every
kvroute container's command, flags, KVROUTE_* environment and TOML configuration parse with the real
CLI; the probes, budgets, network policies, the gateway's objects and the overlays are what the
README says."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvroute import cli
from kvroute.addresses import parse_redis_url
from kvroute.config import has_key
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import (
    CONFIG_DIR,
    by_kind,
    config_files,
    container_env,
    expand_args,
    kvroute_containers,
    pod_labels,
    render,
    selects,
    validate,
    workloads,
)

OVERLAYS = ("single", "ha")
COMPONENTS = (
    (),
    ("sglang",),
    ("trtllm",),
    ("mtls",),
    ("sglang", "mtls"),
    ("trtllm", "mtls"),
    ("gateway",),
    ("prometheus-operator",),
    ("gateway", "mtls", "prometheus-operator"),
)
KVROUTE_COMMANDS = ("control-plane", "router", "agent")  # and "epp" with components/gateway
# The Secret the ha overlay reads (yours to create; README): its password goes into the Redis URL as is.
REDIS_SECRET = {("kvroute-redis", "password"): "0123456789abcdef0123456789abcdef"}
# What the downward API would give a pod, for expanding $(POD_NAME)-style references.
FIELD_REFS = {"metadata.name": "kvroute-pod-0", "status.podIP": "10.0.0.7"}


TLS_MOUNT = "/etc/kvroute/tls"
TLS_FILES = ("tls.crt", "tls.key", "ca.crt")  # what the Secret holds (cert-manager's names)


def write_test_certificates(directory: Path) -> None:
    """A self-signed certificate as the Secret would hold it, for flags that check their file at start."""
    directory.mkdir(parents=True)
    made = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=kvroute-control-plane",
            "-keyout",
            str(directory / "tls.key"),
            "-out",
            str(directory / "tls.crt"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, f"openssl could not make a test certificate: {made.stderr}"
    (directory / "ca.crt").write_bytes((directory / "tls.crt").read_bytes())


def tls_flags_exist() -> bool:
    """The security work adds --tls-cert/--tls-key/--tls-ca; until it has landed, components/mtls names
    keys no command has, and the check below must fail on exactly that (strict xfail)."""
    return all(
        has_key(cli.command_parser(name)[0], key)
        for name in (*KVROUTE_COMMANDS, "epp")
        for key in ("tls_cert", "tls_key", "tls_ca")
    )


def variants() -> Iterator[Any]:
    for overlay in OVERLAYS:
        for components in COMPONENTS:
            marks = []
            if "mtls" in components and not tls_flags_exist():
                marks.append(
                    pytest.mark.xfail(
                        strict=True, raises=AssertionError, reason="tls_cert/tls_key/tls_ca: the TLS flags are not in the CLI yet"
                    )
                )
            yield pytest.param(overlay, components, id="+".join((overlay, *components)), marks=marks)


@pytest.mark.parametrize(
    ("overlay", "components"), [pytest.param(o, c, id="+".join((o, *c))) for o in OVERLAYS for c in COMPONENTS]
)
def test_every_overlay_renders_and_validates_offline(
    deploy_tools: DeployTools, tmp_path: Path, overlay: str, components: tuple[str, ...]
) -> None:
    docs = render(deploy_tools, overlay, components, tmp_path)
    result = validate(deploy_tools, tmp_path / "rendered.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("StatefulSet", "kvroute-control-plane"),
        ("Deployment", "kvroute-router"),
        ("Deployment", "kvroute-engine"),
        ("Service", "kvroute-control-plane"),
        ("Service", "kvroute-router"),
        ("NetworkPolicy", "kvroute-control-plane"),
    } <= kinds
    assert by_kind(docs, "Service")["kvroute-control-plane"]["spec"]["clusterIP"] == "None"  # headless
    if "gateway" in components:
        assert {
            ("InferencePool", "kvroute"),
            ("HTTPRoute", "kvroute"),
            ("Deployment", "kvroute-epp"),
            ("Service", "kvroute-epp"),
            ("PodDisruptionBudget", "kvroute-epp"),
        } <= kinds
    if "prometheus-operator" in components:
        assert {
            ("PrometheusRule", "kvroute"),
            ("ServiceMonitor", "kvroute-control-plane"),
            ("ServiceMonitor", "kvroute-router"),
            ("ServiceMonitor", "kvroute-epp"),
            ("PodMonitor", "kvroute-agent"),
        } <= kinds


def broken(docs: list[dict[str, Any]], kind: str, name: str, edit: Callable[[dict[str, Any]], object]) -> list[dict[str, Any]]:
    """A deep copy of `docs` with `edit` applied to one object."""
    docs = copy.deepcopy(docs)
    edit(next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name))
    return docs


# One way each to break a custom resource as an API server with the CRD installed would refuse it.
CUSTOM_BREAKS = {
    "misspelt InferencePool field": ("InferencePool", "kvroute", lambda d: d["spec"].update(targetPort=[{"number": 8000}])),
    "InferencePool without targetPorts": ("InferencePool", "kvroute", lambda d: d["spec"].pop("targetPorts")),
    "unknown failureMode": ("InferencePool", "kvroute", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Open")),
    "picker Service without a port": ("InferencePool", "kvroute", lambda d: d["spec"]["endpointPickerRef"].pop("port")),
    "port out of range": ("InferencePool", "kvroute", lambda d: d["spec"]["targetPorts"][0].update(number=70000)),
    "misspelt HTTPRoute field": ("HTTPRoute", "kvroute", lambda d: d["spec"]["rules"][0].update(backendRef=[])),
    "bad Gateway API duration": ("HTTPRoute", "kvroute", lambda d: d["spec"]["rules"][0]["timeouts"].update(request="10 min")),
    "ServiceMonitor without endpoints": ("ServiceMonitor", "kvroute-router", lambda d: d["spec"].pop("endpoints")),
    "misspelt PodMonitor field": ("PodMonitor", "kvroute-agent", lambda d: d["spec"]["podMetricsEndpoints"][0].update(prot="x")),
    "rule both alerting and recording": (
        "PrometheusRule",
        "kvroute",
        lambda d: d["spec"]["groups"][0]["rules"][0].update(record="kvroute:x"),
    ),
}


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


def test_the_custom_resources_validator_rejects_what_the_crds_would(deploy_tools: DeployTools, tmp_path: Path) -> None:
    """Each custom resource kind is checked for real (kubernetes-validate only warns about them): each break
    alone fails, naming its object, while the intact render passes; a custom kind without a schema fails."""
    docs = render(deploy_tools, "single", ("gateway", "prometheus-operator"), tmp_path)
    for what, (kind, name, edit) in CUSTOM_BREAKS.items():
        (tmp_path / "broken.yaml").write_text(yaml.safe_dump_all(broken(docs, kind, name, edit)))
        result = validate(deploy_tools, tmp_path / "broken.yaml")
        assert result.returncode != 0, what
        assert f"{kind.lower()}/{name}" in result.stdout, (what, result.stdout)
    unknown = [*docs, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}]
    (tmp_path / "unknown.yaml").write_text(yaml.safe_dump_all(unknown))
    result = validate(deploy_tools, tmp_path / "unknown.yaml")
    assert result.returncode != 0 and "no schema for Widget example.com/v1" in result.stdout, result.stdout


def parse_container(
    command: str, container: dict[str, Any], config_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any]:
    """The container's arguments and environment through the real CLI, its config directory (the
    ConfigMap's files) at `config_dir`. Fails with the CLI's own one-line error."""
    args = [str(config_dir) if a == CONFIG_DIR else a for a in container["args"][1:]]
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)
    for name, value in container_env(container, FIELD_REFS, REDIS_SECRET).items():
        monkeypatch.setenv(name, value)
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            return cli.parse_configured(command, args)
    except SystemExit:
        raise AssertionError(f"{command}: {stderr.getvalue().strip()}") from None


@pytest.mark.parametrize(("overlay", "components"), list(variants()))
def test_every_flag_env_and_config_key_the_manifests_use_exists(
    deploy_tools: DeployTools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlay: str, components: tuple[str, ...]
) -> None:
    docs = render(deploy_tools, overlay, components, tmp_path)
    seen = set()
    parsed: dict[str, Any] = {}
    for pod, container in kvroute_containers(docs):
        command = container["args"][0]
        assert command in (*KVROUTE_COMMANDS, "epp"), container["args"]
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
        parsed[command] = args
        if command == "agent":
            assert args.worker_id == FIELD_REFS["metadata.name"] and sources["worker_id"] == "env KVROUTE_WORKER_ID"
            assert args.engine_url == f"http://{FIELD_REFS['status.podIP']}:8000"
            assert args.engine == ("sglang" if "sglang" in components else "trtllm" if "trtllm" in components else "vllm")
        if command in ("router", "agent", "epp"):
            assert args.control_plane == "kvroute-control-plane:50051"
        if command == "control-plane" and overlay == "ha":
            # The URL carries the Secret's password (KVROUTE_REDIS from the environment), as the parser reads it.
            target = parse_redis_url(args.redis)
            assert (target.hosts, target.password) == ((("kvroute-redis", 6379),), REDIS_SECRET[("kvroute-redis", "password")])
            assert sources["redis"] == "env KVROUTE_REDIS"
        if command == "control-plane" and overlay == "single":
            assert not args.redis
        if "mtls" in components:
            assert (args.tls_cert, args.tls_key, args.tls_ca) == tuple(str(tls_dir / f) for f in TLS_FILES), command
            assert any(m["mountPath"] == TLS_MOUNT for m in container["volumeMounts"]), command
    assert seen == set(KVROUTE_COMMANDS) | ({"epp"} if "gateway" in components else set())
    if "gateway" in components:
        check_gateway(docs, parsed["epp"], parsed["router"], parsed["agent"])


def check_gateway(docs: list[dict[str, Any]], epp: Any, router: Any, agent: Any) -> None:
    """components/gateway fits together: the pool holds the engine pods at the port their agents register,
    its picker is the kvroute-epp Service on the port the picker listens on, with the same failure mode,
    the route sends to the pool, and the picker decides as the routers do."""
    pool, route = by_kind(docs, "InferencePool")["kvroute"], by_kind(docs, "HTTPRoute")["kvroute"]
    engine = workloads(docs)["kvroute-engine"]
    assert selects(pool["spec"]["selector"], pod_labels(engine))
    assert not selects(pool["spec"]["selector"], pod_labels(workloads(docs)["kvroute-epp"]))
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [urlsplit(agent.engine_url).port]
    ref = pool["spec"]["endpointPickerRef"]
    service = by_kind(docs, "Service")[ref["name"]]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(workloads(docs)["kvroute-epp"]))
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    container = workloads(docs)["kvroute-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert next(c["containerPort"] for c in container["ports"] if c["name"] == port["targetPort"]) == epp.grpc_port
    assert ref["failureMode"] == epp.failure_mode
    assert [b["name"] for b in route["spec"]["rules"][0]["backendRefs"]] == [pool["metadata"]["name"]]
    assert (epp.tokenizer, epp.model, epp.policy, epp.host) == (router.tokenizer, router.model, router.policy, "0.0.0.0")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_resources_budgets_policies_and_replicas(deploy_tools: DeployTools, tmp_path: Path, overlay: str) -> None:
    docs = render(deploy_tools, overlay, ("gateway",), tmp_path)
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
    epp = pods["kvroute-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert (epp["readinessProbe"]["httpGet"]["path"], epp["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    # Every workload has a PodDisruptionBudget selecting exactly its pods.
    budgets = by_kind(docs, "PodDisruptionBudget")
    for name, workload in pods.items():
        assert any(selects(b["spec"]["selector"], pod_labels(workload)) for b in budgets.values()), name
    # The control plane's gRPC port admits every kvroute pod that dials it, and nothing else of the fleet's.
    policies = by_kind(docs, "NetworkPolicy")
    grpc_rule = next(r for r in policies["kvroute-control-plane"]["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    assert selects(policies["kvroute-control-plane"]["spec"]["podSelector"], pod_labels(pods["kvroute-control-plane"]))
    for name, workload in pods.items():
        admitted = any(selects(peer["podSelector"], pod_labels(workload)) for peer in grpc_rule["from"])
        assert admitted == (name != "kvroute-redis"), name
    replicas = pods["kvroute-control-plane"]["spec"]["replicas"]
    if overlay == "single":
        assert replicas == 1 and "kvroute-redis" not in pods and "kvroute-redis" not in policies
    else:
        assert replicas == 3 and "kvroute-redis" in pods and "kvroute-redis" in by_kind(docs, "Service")
        # Redis: a password from the Secret (its server's and its probe's), and only the control planes admitted.
        redis = pods["kvroute-redis"]["spec"]["template"]["spec"]["containers"][0]
        env = container_env(redis, FIELD_REFS, REDIS_SECRET)
        args = expand_args(redis, env)
        assert args[args.index("--requirepass") + 1] == REDIS_SECRET[("kvroute-redis", "password")]
        assert env["REDISCLI_AUTH"] == REDIS_SECRET[("kvroute-redis", "password")]
        assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"
        (rule,) = policies["kvroute-redis"]["spec"]["ingress"]
        assert selects(policies["kvroute-redis"]["spec"]["podSelector"], pod_labels(pods["kvroute-redis"]))
        assert [p["port"] for p in rule["ports"]] == ["redis"]
        for name, workload in pods.items():
            admitted = any(selects(peer["podSelector"], pod_labels(workload)) for peer in rule["from"])
            assert admitted == (name == "kvroute-control-plane"), name
        config = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
        assert "redis" not in tomllib.loads(config["20-ha.toml"])["control-plane"], "the URL with its password is env only"
