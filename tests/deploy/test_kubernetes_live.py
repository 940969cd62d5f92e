"""Each overlay's configuration and probes against live processes: the control plane (three replicas
for `ha`), a router, an agent and components/gateway's picker run with their containers' own arguments
(`--config` the rendered ConfigMap's files) and environment, a sim engine stands in for vLLM, and every
readiness and liveness probe the manifests declare answers as a kubelet needs (HTTP 200 / gRPC
SERVING). In `ha`, redis-server runs with its container's own arguments, so with the password of the
Secret kvroute-redis, which the control planes take from their environment; its readiness probe runs
too. Only what a pod's network namespace would give differently is set on top, through the
environment: loopback addresses and free ports (and the Redis Service's name resolved to that port)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.tools.local_cluster import ManagedProcess, free_port, http_get, http_ok, http_post_json, kvroute_argv, wait_until
from kvroute.tools.redis_harness import redis_binary
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import (
    CONFIG_DIR,
    config_files,
    container_env,
    expand_args,
    kvroute_containers,
    render,
    workloads,
)

REDIS_SERVICE = "kvroute-redis:6379"  # what the control planes' KVROUTE_REDIS names (the ha overlay's Service)
# The Secret kvroute-redis as the README makes it (hex, so URL-safe).
SECRETS = {("kvroute-redis", "password"): "5f4dcc3b5aa765d61d8327deb882cf99"}

pytestmark = pytest.mark.e2e


def grpc_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def redis_cli(port: int, env: dict[str, str], *command: str) -> str:
    done = subprocess.run(
        [redis_binary("redis-cli"), "-p", str(port), *command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return done.stdout.strip() + done.stderr.strip()


def start_redis(docs: list[dict[str, Any]], proc: ManagedProcess, port: int) -> None:
    """`proc` started as redis-server with the ha overlay's Redis container's arguments and environment (its
    password; its port is `port`), and that container's readiness probe passing as the kubelet runs it."""
    container = workloads(docs)["kvroute-redis"]["spec"]["template"]["spec"]["containers"][0]
    env = container_env(container, {}, SECRETS)
    proc.argv = [
        redis_binary(),
        *expand_args(container, env),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(proc.log_path.parent),
    ]
    proc.start()
    wait_until(
        lambda: "NOAUTH" in redis_cli(port, {}, "ping"),
        10,
        "redis-server refusing a client without the password",
        [proc],
        interval=0.05,
    )
    assert "WRONGPASS" in redis_cli(port, {"REDISCLI_AUTH": "not-the-password"}, "ping")
    command = container["readinessProbe"]["exec"]["command"]
    assert redis_cli(port, {"REDISCLI_AUTH": env["REDISCLI_AUTH"]}, *command[1:]) == "PONG"


def probe_ok(probe: dict[str, Any], ports: dict[str | int, int]) -> bool:
    """One probe as the kubelet runs it, its port (name or number) mapped to where the process listens."""
    if "grpc" in probe:
        return grpc_serving(ports[probe["grpc"]["port"]])
    get = probe["httpGet"]
    return http_ok(f"http://127.0.0.1:{ports[get['port']]}{get['path']}")


@pytest.mark.parametrize("overlay", ["single", "ha"])
def test_an_overlay_runs_and_every_probe_passes(
    deploy_tools: DeployTools, tmp_path: Path, tiny_model_dir: Path, overlay: str
) -> None:
    docs = render(deploy_tools, overlay, ("gateway",), tmp_path)
    containers = {c["args"][0]: (pod, c) for pod, c in kvroute_containers(docs)}
    replicas = next(d for d in docs if d["metadata"]["name"] == "kvroute-control-plane" and d["kind"] == "StatefulSet")["spec"][
        "replicas"
    ]
    model = "llama-3.1-8b-instruct"  # the name 10-kvroute.toml routes; the sim engine serves it under that name
    cps = [(free_port(), free_port()) for _ in range(replicas)]  # (gRPC, metrics) per control-plane replica
    control_plane = ",".join(f"127.0.0.1:{grpc_port}" for grpc_port, _ in cps)
    http, router_grpc, agent_metrics = free_port(), free_port(), free_port()
    epp_grpc, epp_metrics = free_port(), free_port()
    engine, events, replay = free_port(), free_port(), free_port()
    redis_port = free_port()
    procs = [ManagedProcess("redis", [], tmp_path / "redis.log")] if overlay == "ha" else []
    # (process name, command, environment on top of the container's, probe ports, downward-API values)
    instances: list[tuple[str, str, dict[str, str], dict[str | int, int], dict[str, str]]] = [
        (
            f"control-plane-{i}",
            "control-plane",
            {
                "KVROUTE_LISTEN": f"127.0.0.1:{grpc_port}",
                "KVROUTE_METRICS_PORT": str(metrics),
                "KVROUTE_METRICS_HOST": "127.0.0.1",
            },
            {50051: grpc_port, "grpc": grpc_port, "metrics": metrics, 9090: metrics},
            {"metadata.name": f"kvroute-control-plane-{i}"},
        )
        for i, (grpc_port, metrics) in enumerate(cps)
    ]
    instances.append(
        (
            "agent",
            "agent",
            {
                "KVROUTE_CONTROL_PLANE": control_plane,
                "KVROUTE_METRICS_PORT": str(agent_metrics),
                "KVROUTE_METRICS_HOST": "127.0.0.1",
                "KVROUTE_ENGINE_URL": f"http://127.0.0.1:{engine}",
                "KVROUTE_KV_EVENTS": f"tcp://127.0.0.1:{events}",
                "KVROUTE_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
            },
            {"agent-metrics": agent_metrics, 9091: agent_metrics},
            {"metadata.name": "kvroute-engine-0", "status.podIP": "127.0.0.1"},
        )
    )
    instances.append(
        (
            "router",
            "router",
            {
                "KVROUTE_HOST": "127.0.0.1",
                "KVROUTE_PORT": str(http),
                "KVROUTE_GRPC_PORT": str(router_grpc),
                "KVROUTE_CONTROL_PLANE": control_plane,
                "KVROUTE_TOKENIZER": str(tiny_model_dir),
            },
            {"http": http, 8080: http, "grpc": router_grpc, 50052: router_grpc},
            {"metadata.name": "kvroute-router-0"},
        )
    )
    instances.append(
        (
            "epp",
            "epp",
            {
                "KVROUTE_HOST": "127.0.0.1",
                "KVROUTE_GRPC_PORT": str(epp_grpc),
                "KVROUTE_METRICS_PORT": str(epp_metrics),
                "KVROUTE_CONTROL_PLANE": control_plane,
                "KVROUTE_TOKENIZER": str(tiny_model_dir),
            },
            {"http-metrics": epp_metrics, 9090: epp_metrics, "grpc-ext-proc": epp_grpc, 9002: epp_grpc},
            {"metadata.name": "kvroute-epp-0"},
        )
    )
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    procs.append(
        ManagedProcess(
            "sim-engine",
            kvroute_argv(
                "sim-engine",
                "--host",
                "127.0.0.1",
                "--port",
                str(engine),
                "--model",
                model,
                "--tokenizer",
                str(tiny_model_dir),
                "--block-size",
                "16",
                "--kv-events-config",
                json.dumps(kv_events),
            ),
            tmp_path / "sim-engine.log",
        )
    )
    probes: list[tuple[str, dict[str, Any], dict[str | int, int]]] = []
    envs: dict[str, dict[str, str]] = {}
    for name, command, overrides, ports, field_refs in instances:
        pod, container = containers[command]
        config_dir = tmp_path / "etc" / name
        config_dir.mkdir(parents=True)
        for file, text in config_files(docs, pod, container).items():
            (config_dir / file).write_text(text)
        argv = [str(config_dir) if a == CONFIG_DIR else a for a in container["args"]]
        env = container_env(container, field_refs, SECRETS)
        if "KVROUTE_REDIS" in env:  # the Service's name, resolved: the URL (and its password) otherwise as the pod has it
            assert REDIS_SERVICE in env["KVROUTE_REDIS"], env["KVROUTE_REDIS"]
            env["KVROUTE_REDIS"] = env["KVROUTE_REDIS"].replace(REDIS_SERVICE, f"127.0.0.1:{redis_port}")
        envs[name] = {**env, **overrides}
        procs.append(ManagedProcess(name, kvroute_argv(*argv), tmp_path / f"{name}.log"))
        probes += [
            (f"{name}'s {kind} ({json.dumps(container[kind])})", container[kind], ports)
            for kind in ("livenessProbe", "readinessProbe")
        ]
    assert ("KVROUTE_REDIS" in envs["control-plane-0"]) == (overlay == "ha")
    try:
        for proc in procs:
            if proc.name == "redis":
                start_redis(docs, proc, redis_port)
            else:
                proc.start(env=envs.get(proc.name))
        for what, probe, ports in probes:
            wait_until(lambda p=probe, m=ports: probe_ok(p, m), 60, what, procs)
        # The agent registered the engine under the pod's name and address; a request goes through.
        status, body = http_post_json(
            f"http://127.0.0.1:{http}/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        )
        assert status == 200, body
        health = json.loads(http_get(f"http://127.0.0.1:{http}/health")[1])
        assert (health["workers"], health["model"], health["control_plane"]) == (1, model, "reachable")
        # Every replica knows the worker (in `ha` through the Redis log, not only the agent's own replica)
        # and names itself after its pod (KVROUTE_REPLICA_ID from the downward API).
        for i, (_, metrics) in enumerate(cps):

            def replica_ready(url: str = f"http://127.0.0.1:{metrics}/ready") -> dict[str, Any] | None:
                body = json.loads(http_get(url)[1])
                return body if body["status"] == "ready" and body["workers"] == 1 else None

            body = wait_until(replica_ready, 30, f"control-plane-{i} ready with the worker", procs)
            assert body.get("replica_id", f"kvroute-control-plane-{i}") == f"kvroute-control-plane-{i}"
            assert ("replica_id" in body) == (overlay == "ha")
    finally:
        for proc in reversed(procs):
            proc.stop()
