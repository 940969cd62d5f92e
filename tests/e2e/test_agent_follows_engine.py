"""An agent says when it does not follow its engine, and advertises a worker only while the engine
answers: sim engines, agents, a control plane and a router as processes.

- an agent whose `--kv-events` names a port where no publisher listens: requests still flow to its
  engine (routed there), and the agent warns, answers /ready 503 and sets
  `kvroute_agent_event_stream_silent`; an agent beside it, on the right port, stays ready and quiet;
- a publisher that is connected but withholds every batch (the sim engine's fault hook): the same,
  until the engine is restarted and its events flow again;
- an agent whose engine URL answers nothing never registers its worker, says why, and registers
  as soon as an engine answers there;
- an engine that stops answering for `--engine-gone-after-s`: the agent withdraws the worker (the
  control plane drops it) and registers it again when the engine is back.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvroute.prom_text import sample_value
from kvroute.tools.local_cluster import (
    EngineHandle,
    LocalCluster,
    ManagedProcess,
    free_port,
    http_get,
    http_post_json,
    http_post_json_headers,
    kvroute_argv,
    long_text,
    wait_until,
)
from tests.helpers import get_ready

_seeds = itertools.count(7000)


def agent_gauge(agent_url: str, name: str) -> float | None:
    try:
        status, raw = http_get(agent_url + "/metrics")
    except OSError:
        return None
    return sample_value(raw.decode(), name) if status == 200 else None


def log_of(process: ManagedProcess | None) -> str:
    assert process is not None
    return process.log_path.read_text(errors="replace")


@contextmanager
def traffic(cluster: LocalCluster, url: str) -> Iterator[None]:
    """Chat requests with fresh ~400-token prompts to `url` (a router or an engine), one after another,
    until the block ends."""
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            try:
                http_post_json(url + "/v1/chat/completions", cluster.chat_request(long_text(next(_seeds)), "hello"))
            except OSError:
                pass  # an engine restarting
            time.sleep(0.05)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join(30)


def served_by(router_url: str, cluster: LocalCluster) -> str:
    """One chat request through the router: the worker it went to ("" while the router answers 503,
    learning the fleet)."""
    req = cluster.chat_request(long_text(next(_seeds)), "hi")
    status, headers, raw = http_post_json_headers(router_url + "/v1/chat/completions", req)
    assert status in (200, 503), raw
    return headers.get("x-kvroute-worker", "")


def test_an_agent_on_a_wrong_kv_events_port_warns_and_is_not_ready_while_requests_flow(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("wrong-port", heartbeat_timeout_s=3.0)
    cluster.start_control_plane()
    good = cluster.add_sim_engine("good", "--speedup", "20")
    bad = cluster.add_sim_engine("bad", "--speedup", "20", start_agent=False)
    wrong = free_port()  # no publisher there
    cluster.start_agent(bad, "--kv-events", f"tcp://127.0.0.1:{wrong}")  # argparse: the last --kv-events counts
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered()  # both engines answer: both workers are advertised
    router = cluster.start_router("rr", "round_robin")
    wait_until(
        lambda: {served_by(router, cluster) for _ in range(4)} == {"good", "bad"},
        30,
        "requests routed to both workers",
        cluster.all_processes(),
    )

    with traffic(cluster, router):
        silent = wait_until(
            lambda: agent_gauge(bad.agent_metrics_url, "kvroute_agent_event_stream_silent") == 1,
            60,
            "the agent on the wrong port to find its stream silent",
            cluster.all_processes(),
        )
        assert silent
        text = log_of(bad.agent)
        assert "KV event stream silent: the engine computed" in text and f"--kv-events tcp://127.0.0.1:{wrong}" in text
        wait_until(
            lambda: f"bad: no connection to the engine's publisher at tcp://127.0.0.1:{wrong} for" in log_of(bad.agent),
            30,
            "the publisher warning",
            [bad.agent],
        )
        status, body = get_ready(bad.agent_metrics_url)
        assert status == 503 and body["event_stream_silent"] is True, body
        assert any(p.startswith("KV event stream silent: the engine computed") for p in body["problems"]), body
        assert any(
            f"bad: not receiving KV events (no connection to the engine's publisher at tcp://127.0.0.1:{wrong})" in p
            for p in body["problems"]
        ), body
        # Its neighbour on the right port, under the same traffic, follows its engine: ready and quiet.
        status, body = get_ready(good.agent_metrics_url)
        assert status == 200 and body["problems"] == [] and body["event_stream_silent"] is False, body
        assert agent_gauge(good.agent_metrics_url, "kvroute_agent_event_stream_silent") == 0
    assert "KV event stream silent" not in log_of(good.agent)
    assert "no connection to the engine's publisher" not in log_of(good.agent)


def test_a_connected_publisher_that_withholds_its_events_is_a_silent_stream_until_events_flow(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("withheld", heartbeat_timeout_s=3.0)
    cluster.start_control_plane()
    engine = cluster.add_sim_engine("engine-0", "--speedup", "20")
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered()
    wait_until(lambda: get_ready(engine.agent_metrics_url)[0] == 200, 30, "agent ready", cluster.all_processes())
    status, raw = http_post_json(engine.url + "/kvroute/faults", {"drop_next_batches": 1_000_000})
    assert status == 200, raw

    with traffic(cluster, engine.url):
        wait_until(
            lambda: get_ready(engine.agent_metrics_url)[1].get("event_stream_silent"),
            60,
            "the agent to find its stream silent",
            cluster.all_processes(),
        )
    status, body = get_ready(engine.agent_metrics_url)
    assert status == 503 and body["workers"][0]["following_events"] is True, body  # connected, yet nothing arrives
    assert any(p.startswith("KV event stream silent") for p in body["problems"]), body
    assert "KV event stream silent" in log_of(engine.agent)
    # Idle now: it stays silent (going idle does not repair a stream) ...
    assert agent_gauge(engine.agent_metrics_url, "kvroute_agent_event_stream_silent") == 1

    # ... until events arrive: a restarted engine publishes again.
    engine.engine.kill()
    engine.engine.start()
    cluster.wait_engines_healthy()
    with traffic(cluster, engine.url):
        wait_until(lambda: get_ready(engine.agent_metrics_url)[0] == 200, 60, "the agent ready again", cluster.all_processes())
    assert agent_gauge(engine.agent_metrics_url, "kvroute_agent_event_stream_silent") == 0
    assert "KV events arrive again" in log_of(engine.agent)


def _sim_engine(cluster: LocalCluster, name: str, port: int, events: int, replay: int) -> ManagedProcess:
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
    )
    return ManagedProcess(
        name,
        kvroute_argv(
            "sim-engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            cluster.model,
            "--tokenizer",
            str(cluster.tokenizer_dir),
            "--kv-events-config",
            config,
        ),
        cluster.workdir / f"{name}.log",
    )


def test_an_agent_never_registers_a_worker_for_a_dead_engine_url(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("dead-engine")
    cluster.start_control_plane()
    port, events, replay, metrics = free_port(), free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    agent = ManagedProcess(
        "agent",
        kvroute_argv(
            "agent",
            "--control-plane",
            cluster.control_plane_addr,
            "--engine",
            "vllm",
            "--engine-url",
            url,
            "--kv-events",
            f"tcp://127.0.0.1:{events}",
            "--replay-endpoint",
            f"tcp://127.0.0.1:{replay}",
            "--worker-id",
            "ghost",
            "--model",
            cluster.model,
            "--metrics-port",
            str(metrics),
        ),
        cluster.workdir / "agent.log",
    )
    agent.start()
    engine: ManagedProcess | None = None
    metrics_url = f"http://127.0.0.1:{metrics}"
    try:
        # It keeps asking the engine (backing off) and, all the while, registers nothing.
        def asked_three_times() -> bool:
            assert cluster.list_workers() == [], "a worker was registered for an engine that does not answer"
            return (agent_gauge(metrics_url, "kvroute_agent_engine_models_failures_total") or 0) >= 3

        wait_until(asked_three_times, 60, "three attempts to reach the engine", [agent, cluster.control_plane])
        status, body = get_ready(metrics_url)
        assert status == 503 and body["engine_answering"] is False and body["workers"][0]["registered"] is False
        assert any(
            p.startswith(f"engine {url}/v1/models does not answer (") and "ghost not registered until it answers" in p
            for p in body["problems"]
        ), body
        assert agent_gauge(metrics_url, "kvroute_agent_engine_answering") == 0
        text = log_of(agent)
        assert f"{url}/v1/models unavailable" in text and "register once the engine answers GET /v1/models" in text
        assert "registered with control plane" not in text

        # An engine comes up there: the worker registers, and the agent follows it.
        engine = _sim_engine(cluster, "engine", port, events, replay)
        engine.start()
        wait_until(
            lambda: [w.worker_id for w in cluster.list_workers()] == ["ghost"],
            60,
            "the worker registered",
            [agent, engine, cluster.control_plane],
        )
        wait_until(lambda: get_ready(metrics_url)[0] == 200, 30, "the agent ready", [agent, engine])
        assert f"engine {url} answers (model {cluster.model}): registering ghost" in log_of(agent)
    finally:
        agent.stop()
        if engine is not None:
            engine.stop()


def test_an_engine_gone_for_longer_than_the_bound_is_withdrawn_and_comes_back(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("gone-engine", heartbeat_timeout_s=3.0)
    cluster.start_control_plane()
    engine: EngineHandle = cluster.add_sim_engine("engine-0", agent_args=("--engine-gone-after-s", "2"))
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered()
    engine.engine.kill()
    wait_until(
        lambda: cluster.list_workers() == [], 60, "the worker dropped by the control plane", [engine.agent, cluster.control_plane]
    )
    text = log_of(engine.agent)
    assert f"engine {engine.url} has not answered GET /v1/models for 2s" in text and "withdrawing engine-0" in text
    status, body = get_ready(engine.agent_metrics_url)
    assert status == 503 and any("engine-0 withdrawn from the control plane until it answers" in p for p in body["problems"]), (
        body
    )

    engine.engine.start()  # the same ports
    wait_until(
        lambda: [w.worker_id for w in cluster.list_workers()] == ["engine-0"],
        60,
        "the worker back",
        [engine.agent, engine.engine, cluster.control_plane],
    )
    wait_until(lambda: get_ready(engine.agent_metrics_url)[0] == 200, 30, "the agent ready again", [engine.agent])
