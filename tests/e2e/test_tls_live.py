"""TLS against live processes: certificate files that do not load under a running router and agent
keep the control-plane link up (the previous certificate stays in use) until a valid one replaces
them; a client whose TLS handshake fails says so, naming the flags, instead of "Socket closed"."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvroute.identity import router_uri, worker_uri
from kvroute.tls import ClientTls, TlsFiles
from kvroute.tools.local_cluster import LocalCluster, http_get, http_post_json, kvroute_argv, long_text, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.tls_certs import CertFiles, TestCA

HINT = "TLS handshake failed"
FLAGS = "--tls-cert/--tls-key/--tls-ca (or KVROUTE_TLS_CERT/KVROUTE_TLS_KEY/KVROUTE_TLS_CA)"


def tls_args(cert: CertFiles | None, ca: Path) -> tuple[str, ...]:
    return (*(("--tls-cert", str(cert.cert), "--tls-key", str(cert.key)) if cert else ()), "--tls-ca", str(ca))


def listed_workers(address: str, observer: CertFiles, ca: Path) -> list[str]:
    """Worker ids the control plane lists to a client with `observer`'s certificate ([] when it cannot)."""
    credentials = ClientTls(TlsFiles(str(observer.cert), str(observer.key), str(ca))).grpc_credentials()
    try:
        with grpc.secure_channel(address, credentials) as channel:
            reply = pb_grpc.ControlPlaneStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=2)
            return [w.worker_id for w in reply.workers]
    except grpc.RpcError:
        return []


def log_count(cluster: LocalCluster, name: str, text: str) -> int:
    path = cluster.workdir / f"{name}.log"
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def kv_aware(router_url: str, body: dict) -> dict | None:
    """The router's decision for `body` when it used the index and found the prompt cached, else None."""
    status, raw = http_post_json(router_url + "/v1/route", body)
    decision = json.loads(raw) if status == 200 else {}
    return decision if decision.get("cached_tokens", 0) > 0 and decision.get("fail_open") is False else None


def ready_control_plane(router_url: str) -> dict:
    return json.loads(http_get(router_url + "/ready")[1])["control_plane"]


def replace_pair(target: CertFiles, new: CertFiles) -> None:
    for src, dst in ((new.cert, target.cert), (new.key, target.key)):
        os.replace(src, dst)


@pytest.mark.timeout(300)
def test_client_certificates_that_do_not_load_keep_the_link_until_a_valid_one(tmp_path, local_fleet) -> None:
    """A router and an agent over mTLS; their certificate files are overwritten with garbage. The router
    keeps its control-plane link (refreshes go on, decisions keep using the index) and the agent
    re-registers after a control-plane restart, both with the previous certificate, each saying the
    new files do not load. Then valid certificates from a second CA replace the garbage, and the
    control plane is restarted trusting only that CA: both come back, so they use the new ones."""
    old_ca, new_ca = TestCA(tmp_path / "old", "old-ca"), TestCA(tmp_path / "new", "new-ca")
    both = tmp_path / "both-cas.pem"  # what clients verify the control plane with, and it its clients at first
    both.write_bytes(old_ca.ca_path.read_bytes() + new_ca.ca_path.read_bytes())
    served = old_ca.issue("control-plane")
    router_cert = old_ca.issue("router-1", uris=[router_uri("router-1")])
    agent_cert = old_ca.issue("agent-sim-0", uris=[worker_uri("sim-0")])
    observer = new_ca.issue("observer", uris=[router_uri("observer")])
    cluster = local_fleet("tls-reload", heartbeat_timeout_s=30)
    address = cluster.start_control_plane(extra_args=tls_args(served, both))
    workers = lambda: listed_workers(address, observer, both)
    engine = cluster.add_sim_engine("sim-0", "--speedup", "50", start_agent=False)
    cluster.start_agent(engine, *tls_args(agent_cert, both))
    cluster.wait_engines_healthy()
    wait_until(lambda: workers() == ["sim-0"], 60, "sim-0 registered over mTLS", cluster.all_processes())
    router = cluster.start_router("kv", "kv_aware", *tls_args(router_cert, both))
    body = cluster.chat_request(long_text(0), "a question about the document")
    status, raw = http_post_json(engine.url + "/v1/chat/completions", cluster.chat_request(long_text(0), "warm up"))
    assert status == 200, raw
    wait_until(lambda: kv_aware(router, body), 30, "a kv-aware decision", cluster.all_processes())

    for pair in (router_cert, agent_cert):
        pair.cert.write_text("not a certificate at all\n")
    wait_until(lambda: log_count(cluster, "router-kv", "do not load"), 30, "the router's warning", cluster.all_processes())
    warned = time.monotonic()
    # Refreshes after the warning succeed (a refresh less old than the warning), and decisions use the index.
    wait_until(
        lambda: (
            (cp := ready_control_plane(router))["reachable"]
            and cp["last_refresh_s_ago"] is not None
            and cp["last_refresh_s_ago"] < time.monotonic() - warned - 1.0
        ),
        30,
        "a control-plane refresh after the warning",
        cluster.all_processes(),
    )
    assert kv_aware(router, body), "the router stopped using the index"
    assert log_count(cluster, "router-kv", "unreachable") == 0, cluster.routers["kv"].log_tail()
    assert log_count(cluster, "router-kv", "TLS files reloaded") == 0

    cluster.restart_control_plane()
    wait_until(
        lambda: workers() == ["sim-0"], 60, "sim-0 registered again with the previous certificate", cluster.all_processes()
    )
    assert log_count(cluster, "agent-sim-0", "do not load") == 1, engine.agent.log_tail()
    assert log_count(cluster, "agent-sim-0", "TLS files reloaded") == 0
    wait_until(lambda: kv_aware(router, body), 30, "kv-aware decisions after the restart", cluster.all_processes())

    # Valid certificates from the new CA; then a control plane that trusts only that CA.
    replace_pair(router_cert, new_ca.issue("router-1-new", uris=[router_uri("router-1")]))
    replace_pair(agent_cert, new_ca.issue("agent-sim-0-new", uris=[worker_uri("sim-0")]))
    wait_until(
        lambda: log_count(cluster, "router-kv", "TLS files reloaded"),
        30,
        "the router taking the new files",
        cluster.all_processes(),
    )
    cluster.restart_control_plane(while_down=lambda: cluster.control_plane.pin("--tls-ca", str(new_ca.ca_path)))
    wait_until(lambda: workers() == ["sim-0"], 60, "sim-0 registered with the new certificate", cluster.all_processes())
    assert log_count(cluster, "agent-sim-0", "TLS files reloaded") == 1, engine.agent.log_tail()
    wait_until(
        lambda: kv_aware(router, body) and ready_control_plane(router)["reachable"],
        30,
        "the router back with the new certificate",
        cluster.all_processes(),
    )


def audit(address: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTE_TLS_", "GRPC_VERBOSITY"))}
    return subprocess.run(
        kvroute_argv("audit", "--control-plane", address, *args), capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.mark.timeout(240)
def test_failed_tls_handshakes_say_so_and_name_the_flags(tmp_path, local_fleet) -> None:
    """`kvroute audit` against an mTLS control plane without a client certificate, with one from another
    CA, with another CA altogether and in plaintext: one line on stderr saying the handshake failed and
    naming the flags, exit 2. A router without a client certificate and an agent with one from another CA
    say the same in their logs (and the router on /ready)."""
    ca, other = TestCA(tmp_path / "pki", "kvroute-ca"), TestCA(tmp_path / "other", "other-ca")
    served = ca.issue("control-plane")
    cluster = local_fleet("tls-hints")
    address = cluster.start_control_plane(extra_args=tls_args(served, ca.ca_path))
    stranger = other.issue("stranger", uris=[router_uri("stranger")])
    cases = {
        "no client certificate": (("--tls-ca", str(ca.ca_path)), "requires a client certificate"),
        "a certificate from another CA": (tls_args(stranger, ca.ca_path), "refused this client's certificate"),
        "another CA altogether": (tls_args(stranger, other.ca_path), "CERTIFICATE_VERIFY_FAILED"),
        "plaintext": ((), "it probably serves TLS and this client has none"),
    }
    for case, (args, cause) in cases.items():
        done = audit(address, *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, f"{case}: {done.returncode}\n{done.stderr}"
        assert lines[0].startswith(f"error: control plane {address}: ListWorkers UNAVAILABLE: {HINT}"), (case, lines)
        assert cause in lines[0] and FLAGS in lines[0] and "Traceback" not in done.stdout, (case, lines)

    router = cluster.start_router("no-cert", "kv_aware", "--tls-ca", str(ca.ca_path))
    wait_until(lambda: HINT in (ready_control_plane(router)["error"] or ""), 30, "the router's /ready", cluster.all_processes())
    wait_until(
        lambda: log_count(cluster, "router-no-cert", f"unreachable ({HINT}"), 30, "the router's log", cluster.all_processes()
    )
    assert "requires a client certificate" in ready_control_plane(router)["error"]
    engine = cluster.add_sim_engine("sim-0", start_agent=False)
    cluster.start_agent(engine, *tls_args(other.issue("agent-sim-0", uris=[worker_uri("sim-0")]), ca.ca_path))
    wait_until(
        lambda: log_count(cluster, "agent-sim-0", f"unavailable (attempt 1): UNAVAILABLE: {HINT}"),
        30,
        "the agent's log",
        cluster.all_processes(),
    )
    assert "refused this client's certificate" in engine.agent.log_tail(50)
