"""The `single` overlay's configuration and probes against live processes: the control plane, a router
and an agent run with their containers' own arguments (`--config` the rendered ConfigMap's files) and
environment, a sim engine stands in for vLLM, and every readiness and liveness probe the manifests
declare answers as a kubelet needs (HTTP 200 / gRPC SERVING). Only what a pod's network namespace
would give differently is set on top, through the environment: loopback addresses and free ports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.tools.local_cluster import ManagedProcess, free_port, http_get, http_ok, http_post_json, kvroute_argv, wait_until
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import CONFIG_DIR, config_files, container_env, kvroute_containers, render

pytestmark = pytest.mark.e2e


def grpc_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def probe_ok(probe: dict[str, Any], ports: dict[str | int, int]) -> bool:
    """One probe as the kubelet runs it, its port (name or number) mapped to where the process listens."""
    if "grpc" in probe:
        return grpc_serving(ports[probe["grpc"]["port"]])
    get = probe["httpGet"]
    return http_ok(f"http://127.0.0.1:{ports[get['port']]}{get['path']}")


def test_the_single_overlay_runs_and_every_probe_passes(deploy_tools: DeployTools, tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    docs = render(deploy_tools, "single", (), tmp_path)
    containers = {c["args"][0]: (pod, c) for pod, c in kvroute_containers(docs)}
    model = "llama-3.1-8b-instruct"  # the name 10-kvroute.toml routes; the sim engine serves it under that name
    cp, cp_metrics, http, grpc_port, agent_metrics = (free_port() for _ in range(5))
    engine, events, replay = free_port(), free_port(), free_port()
    loopback = {"metadata.name": "kvroute-engine-0", "status.podIP": "127.0.0.1"}
    # Ports the manifests name -> where this test's process listens (a pod would have them all to itself).
    ports: dict[str, dict[str | int, int]] = {
        "control-plane": {50051: cp, "grpc": cp, "metrics": cp_metrics, 9090: cp_metrics},
        "router": {"http": http, 8080: http, "grpc": grpc_port, 50052: grpc_port},
        "agent": {"agent-metrics": agent_metrics, 9091: agent_metrics},
    }
    overrides = {
        "control-plane": {"KVROUTE_LISTEN": f"127.0.0.1:{cp}", "KVROUTE_METRICS_PORT": str(cp_metrics),
                          "KVROUTE_METRICS_HOST": "127.0.0.1"},
        "router": {"KVROUTE_HOST": "127.0.0.1", "KVROUTE_PORT": str(http), "KVROUTE_GRPC_PORT": str(grpc_port),
                   "KVROUTE_CONTROL_PLANE": f"127.0.0.1:{cp}", "KVROUTE_TOKENIZER": str(tiny_model_dir)},
        "agent": {"KVROUTE_CONTROL_PLANE": f"127.0.0.1:{cp}", "KVROUTE_METRICS_PORT": str(agent_metrics),
                  "KVROUTE_METRICS_HOST": "127.0.0.1", "KVROUTE_ENGINE_URL": f"http://127.0.0.1:{engine}",
                  "KVROUTE_KV_EVENTS": f"tcp://127.0.0.1:{events}", "KVROUTE_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"},
    }
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                 "replay_endpoint": f"tcp://*:{replay}"}
    procs = [ManagedProcess("sim-engine", kvroute_argv(
        "sim-engine", "--host", "127.0.0.1", "--port", str(engine), "--model", model, "--tokenizer", str(tiny_model_dir),
        "--block-size", "16", "--kv-events-config", json.dumps(kv_events)), tmp_path / "sim-engine.log")]
    envs: dict[str, dict[str, str]] = {}
    for command in ("control-plane", "agent", "router"):
        pod, container = containers[command]
        config_dir = tmp_path / "etc" / command
        config_dir.mkdir(parents=True)
        for name, text in config_files(docs, pod, container).items():
            (config_dir / name).write_text(text)
        argv = [str(config_dir) if a == CONFIG_DIR else a for a in container["args"]]
        envs[command] = {**container_env(container, loopback), **overrides[command]}
        procs.append(ManagedProcess(command, kvroute_argv(*argv), tmp_path / f"{command}.log"))
    try:
        procs[0].start()
        for proc in procs[1:]:
            proc.start(env=envs[proc.name])
        for command in ("control-plane", "agent", "router"):
            container = containers[command][1]
            for kind in ("livenessProbe", "readinessProbe"):
                wait_until(lambda c=container, k=kind, n=command: probe_ok(c[k], ports[n]), 60,
                           f"{command}'s {kind} ({json.dumps(container[kind])})", procs)
        # The agent registered under the pod's name with the engine's address; a request goes through.
        status, body = http_post_json(f"http://127.0.0.1:{http}/v1/chat/completions",
                                      {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert status == 200, body
        health = json.loads(http_get(f"http://127.0.0.1:{http}/health")[1])
        assert (health["workers"], health["model"], health["control_plane"]) == (1, model, "reachable")
    finally:
        for proc in reversed(procs):
            proc.stop()
