"""Faults against live processes: after each, the audit must find the control plane agreeing with
every engine within 2 s.

Three sim engines with their agents behind one control plane: vLLM 0.22 (old replay framing
`[seq, payload]`, 16-token blocks), SGLang 0.5.22 (new framing `[topic, seq, payload]`, 32-token
pages) and TensorRT-LLM's pull path (64-token blocks, no replay). Their caches are small, so the
traffic evicts and the events include removals. Faults: a batch withheld from the PUB socket (a
gap the agent fills by replay), an engine restart (sequence back to 0 and an empty cache: the
agent drops the worker's blocks), a prefix-cache reset (AllBlocksCleared), an agent restart (the
new agent catches up by replay from seq 0) and a control-plane restart (agents reconnect and send
snapshots). The agents' own counters prove each fault took the path it is meant to, so a fault
that silently did nothing cannot pass. On the pull path a lost step cannot be replayed: there the
test checks the control plane errs only on the safe side.
"""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest

from kvroute.tools.local_cluster import EngineHandle, LocalCluster, http_ok, http_post_json, long_text, wait_until

FLEET = (("old", "vllm-0.22", 16), ("new", "sglang-0.5.22", 32), ("pull", "trtllm-pull", 64))
ZMQ = ["old", "new"]  # replayable: gaps and late agents are healed
ALL = ZMQ + ["pull"]
HEAL_S = 2.0  # the audit must be clean this long after the fault's effect
CONTROL_PLANE_OUTAGE_S = 3.0
_seeds = itertools.count(1000)


@pytest.fixture(scope="module")
def cluster(module_local_fleet):
    c = module_local_fleet("faults", heartbeat_timeout_s=5)
    c.start_control_plane()
    for name, dialect, block_size in FLEET:  # 40 blocks: a few prompts fill it, later ones evict
        c.add_sim_engine(name, "--num-blocks", "40", "--speedup", "50", dialect=dialect, block_size=block_size)
    c.wait_engines_healthy()
    c.wait_workers_registered()
    for engine in c.engines:
        traffic(c, engine, 4)
    c.wait_audit_clean(timeout=20)
    return c


@pytest.fixture
def engine(request, cluster: LocalCluster) -> EngineHandle:
    return next(e for e in cluster.engines if e.worker_id == request.param)


def traffic(cluster: LocalCluster, engine: EngineHandle, requests: int = 2) -> None:
    """Fresh prompts of ~130 tokens straight to the engine (2-8 blocks each, by block size)."""
    for _ in range(requests):
        body = cluster.chat_request(long_text(next(_seeds), 120), "hello")
        status, raw = http_post_json(engine.url + "/v1/chat/completions", body)
        assert status == 200, raw


def inject(engine: EngineHandle, **fault) -> dict:
    status, raw = http_post_json(engine.url + "/kvroute/faults", fault)
    assert status == 200, raw
    return json.loads(raw)


def grew(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


@pytest.mark.parametrize("engine", ZMQ, indirect=True)
def test_a_dropped_batch_is_filled_by_replay(cluster: LocalCluster, engine: EngineHandle) -> None:
    before = cluster.agent_counters(engine)
    assert inject(engine, drop_next_batches=1)["drop_next_batches"] == 1
    traffic(cluster, engine, 1)  # its first batch never reaches the PUB socket
    traffic(cluster, engine, 1)  # the next one shows the gap
    cluster.wait_audit_clean(HEAL_S)
    after = cluster.agent_counters(engine)
    assert grew(before, after, "gaps") == 1 and grew(before, after, "replays") == 1, after
    assert grew(before, after, "unrecoverable_gaps") == 0 and grew(before, after, "state_resets") == 0, after


@pytest.mark.parametrize("engine", ALL, indirect=True)
def test_an_engine_restart_drops_the_workers_old_blocks(cluster: LocalCluster, engine: EngineHandle) -> None:
    held = next(a for a in cluster.audit([engine.worker_id]).audits).tiers["gpu"].control_plane_blocks
    assert held > 0
    before = cluster.agent_counters(engine)
    state = inject(engine, restart_publisher=True, drop_cache=True)  # seq back to 0, cache empty, no event
    assert state.get("next_seq", state.get("next_event_id")) in (0, 1) and state["restarts"] >= 1, state
    traffic(cluster, engine, 1)  # the new "process" publishes from seq 0 (trtllm-pull: a `created` event first)
    audit = cluster.wait_audit_clean(HEAL_S)
    after = cluster.agent_counters(engine)
    assert grew(before, after, "sequence_resets") == 1 and grew(before, after, "state_resets") == 1, after
    # Only what the restarted engine cached since: one prompt, not the blocks held before.
    (worker,) = [a for a in audit.audits if a.worker_id == engine.worker_id]
    assert 0 < worker.tiers["gpu"].control_plane_blocks < held


@pytest.mark.parametrize("engine", ALL, indirect=True)
def test_reset_prefix_cache_clears_the_worker(cluster: LocalCluster, engine: EngineHandle) -> None:
    traffic(cluster, engine, 1)
    cluster.wait_audit_clean(HEAL_S)
    status, raw = http_post_json(engine.url + "/reset_prefix_cache")
    assert status == 200, raw
    audit = cluster.wait_audit_clean(HEAL_S)
    (worker,) = [a for a in audit.audits if a.worker_id == engine.worker_id]
    assert worker.tiers["gpu"].engine_blocks == 0 == worker.tiers["gpu"].control_plane_blocks
    assert {w.worker_id: w.cached_blocks for w in cluster.list_workers()}[engine.worker_id] == 0
    traffic(cluster, engine, 1)
    cluster.wait_audit_clean(HEAL_S)


@pytest.mark.parametrize("engine", ZMQ, indirect=True)
def test_a_restarted_agent_catches_up_by_replay(cluster: LocalCluster, engine: EngineHandle) -> None:
    agent = engine.agent
    if engine.worker_id == "old":
        agent.kill()
    else:  # a graceful stop exits 0
        agent.stop(sig=signal.SIGTERM)
        assert agent.popen.returncode == 0, agent.log_tail()
    traffic(cluster, engine, 3)  # stored and evicted while nobody listens
    cluster.start_agent(engine)
    wait_until(lambda: http_ok(engine.agent_metrics_url + "/health"), 30, "the new agent", [engine.agent])
    cluster.wait_audit_clean(HEAL_S)
    counters = cluster.agent_counters(engine)
    assert counters["replays"] >= 1 and counters["batches"] >= 3, counters
    assert counters["incomplete_catch_ups"] == 0, counters  # the engine's buffer still starts at seq 0


def test_a_restarted_control_plane_gets_snapshots(cluster: LocalCluster) -> None:
    """Down for 3 s, long enough for the agents' reconnect backoff to have grown past 2 s."""
    before = {e.worker_id: cluster.agent_counters(e) for e in cluster.engines}

    def outage() -> None:
        down_until = time.monotonic() + CONTROL_PLANE_OUTAGE_S
        for engine in cluster.engines:
            traffic(cluster, engine, 2)  # events while the control plane is gone
        wait_until(
            lambda: all(
                cluster.agent_counters(e)["control_plane_failures"] >= before[e.worker_id]["control_plane_failures"] + 3
                for e in cluster.engines
            ),
            10,
            "agents retrying",
        )
        time.sleep(max(0.0, down_until - time.monotonic()))

    cluster.restart_control_plane(while_down=outage, kill=True)
    cluster.wait_audit_clean(HEAL_S)
    for engine in cluster.engines:
        after = cluster.agent_counters(engine)
        assert grew(before[engine.worker_id], after, "control_plane_sessions") == 1, after


def test_a_lost_pull_batch_costs_hits_never_false_ones(cluster: LocalCluster) -> None:
    """TensorRT-LLM's pull path cannot replay: a lost step resets the worker. The control plane then
    knows less than the engine (missing blocks: a prefix hit not predicted) but never more (extra
    blocks: a request routed for a hit that will not happen), and new prompts are indexed again."""
    engine = next(e for e in cluster.engines if e.worker_id == "pull")
    traffic(cluster, engine, 2)
    cluster.wait_audit_clean(HEAL_S, [engine.worker_id])
    before = cluster.agent_counters(engine)
    inject(engine, drop_next_batches=1)
    traffic(cluster, engine, 2)
    wait_until(lambda: grew(before, cluster.agent_counters(engine), "unrecoverable_gaps") == 1, HEAL_S, "the gap seen")
    (worker,) = cluster.audit([engine.worker_id], settle_s=0.2).audits
    gpu = worker.tiers["gpu"]
    assert gpu.missing and not gpu.extra, worker.to_json()
    assert grew(before, cluster.agent_counters(engine), "state_resets") == 1
    traffic(cluster, engine, 1)  # a new prompt after the reset: its blocks are indexed again
    wait_until(
        lambda: cluster.audit([engine.worker_id]).audits[0].tiers["gpu"].control_plane_blocks > gpu.control_plane_blocks,
        HEAL_S,
        "the new prompt indexed",
    )
    (worker,) = cluster.audit([engine.worker_id], settle_s=0.2).audits
    assert not worker.tiers["gpu"].extra and worker.tiers["gpu"].missing <= gpu.missing, worker.to_json()
    assert http_post_json(engine.url + "/reset_prefix_cache")[0] == 200  # leave the fleet clean
    cluster.wait_audit_clean(HEAL_S)
