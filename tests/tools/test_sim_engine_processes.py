"""`kvroute sim-engine` as an OS process started through LocalCluster with a dialect, read over real sockets."""

from __future__ import annotations

import argparse
import json
import subprocess

import msgspec
import pytest
import zmq

from kvroute.block_keys import prompt_block_keys
from kvroute.tools.local_cluster import LocalCluster, http_get, http_post_json, kvroute_argv

pytestmark = pytest.mark.e2e  # starts kvroute processes


@pytest.fixture(scope="module")
def cluster(module_local_fleet):
    c = module_local_fleet("sim-processes")
    c.add_sim_engine(
        "sglang",
        "--speedup",
        "50",
        dialect="sglang-0.5.22",
        block_size=32,
        lora_adapters=("sql",),
        cpu_offload_blocks=16,
        start_agent=False,
    )
    c.add_sim_engine("trtllm", "--speedup", "50", dialect="trtllm-pull", start_agent=False)
    c.wait_engines_healthy()
    return c


def test_an_sglang_process_publishes_its_own_shape(cluster: LocalCluster) -> None:
    handle = cluster.engines[0]
    assert (handle.dialect, handle.block_size, handle.engine_family) == ("sglang-0.5.22", 32, "sglang")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{handle.kv_events_port}")
    try:
        prompt = list(range(200, 264))
        stored = None
        for attempt in range(20):  # the SUB may join late (ZMQ slow joiner): warm a fresh prompt until one arrives
            status, raw = http_post_json(handle.url + "/v1/completions", {"model": "sql", "prompt": prompt, "max_tokens": 1})
            assert status == 200, raw
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                prompt = [t + 64 for t in prompt]
                continue
            _ts, events, rank = msgspec.msgpack.decode(payload)
            stored = events[0]
            break
    finally:
        ctx.destroy(linger=0)
    assert stored is not None and topic == b"" and len(seq) == 8 and rank == 0
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "cache_salt",
        "session_id",
        "lora_name",
    ]
    assert stored["block_size"] == 32 and stored["lora_name"] == "sql" and len(stored["block_hashes"]) == 2
    status, raw = http_get(handle.url + "/kvroute/blocks")
    audit = json.loads(raw)
    assert set(prompt_block_keys(prompt, 32, cluster.model, "sql")) <= set(audit["tiers"]["gpu"])
    assert audit["cpu_offload_blocks"] == 16
    status, raw = http_get(handle.url + "/metrics")
    assert status == 200 and b"sglang:num_running_reqs" in raw and b"vllm:" not in raw
    assert json.loads(http_get(handle.url + "/version")[1])["dialect"] == "sglang-0.5.22"


def test_a_trtllm_pull_process_serves_its_event_queue(cluster: LocalCluster) -> None:
    handle = cluster.engines[1]
    status, raw = http_post_json(handle.url + "/kv_cache_events")
    assert status == 200 and json.loads(raw)[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [2048, 0]}
    status, raw = http_post_json(handle.url + "/v1/completions", {"prompt": list(range(1, 65)), "max_tokens": 1})
    assert status == 200
    (stored,) = json.loads(http_post_json(handle.url + "/kv_cache_events")[1])
    assert [len(b["tokens"]) for b in stored["data"]["blocks"]] == [16] * 4  # the cluster's block size
    assert stored["data"]["blocks"][0]["block_hash"] == 6052439777046529588  # v1_block_key of tokens 1..16


@pytest.mark.parametrize(
    "args,block_size", [([], 16), (["--dialect", "trtllm-pull"], 32), (["--dialect", "sglang-0.5.9", "--page-size", "64"], 64)]
)
def test_block_size_defaults_per_engine(cluster: LocalCluster, args, block_size: int) -> None:
    from kvroute.tools.sim_engine.cli import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = build_engine(parser.parse_args(["--tokenizer", str(cluster.tokenizer_dir), *args]))
    assert engine.config.block_size == engine.cache.block_size == block_size


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dialect", "vllm-0.9.1", "--cpu-offload-blocks", "8"], "cannot report a CPU offload tier"),
        (["--dialect", "trtllm-pull", "--kv-events-config", '{"enable_kv_cache_events": true}'], "no ZMQ publisher"),
        (["--dialect", "trtllm-zmq", "--event-hash-form", "bytes"], "has no 'bytes' block hashes"),
    ],
)
def test_impossible_combinations_are_refused_with_a_clear_error(cluster: LocalCluster, args, message) -> None:
    proc = subprocess.run(
        kvroute_argv("sim-engine", "--tokenizer", str(cluster.tokenizer_dir), "--port", "0", *args),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and message in proc.stderr
