"""--capture-trace: the router records its traffic as a Mooncake trace `kvroute simulate` replays.

Unit: block ids (shared prefixes share ids, the partial tail gets its own, dense from 0, bounded
map), output lengths from response tails, sampling, write failures. End to end: a router process
in front of sim engines captures streamed and non-streamed requests, flushes on SIGTERM, and the
simulator replays the file with prefix hits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.ops.traffic_capture import (
    TrafficCapture,
    reported_output_tokens,
    requested_output_tokens,
    trace_block_keys,
)
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import eventually

ROW_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids", "block_size"}
BIG = 7_000_000  # token ids in this range are easy to look for in the file


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def counter(metrics: RouterMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


# ---------------------------------------------------------------- unit


def test_trace_block_keys_chain_at_512_with_a_chained_tail() -> None:
    a = list(range(BIG, BIG + 1300))
    b = a[:1024] + list(range(BIG + 5000, BIG + 5276))
    ka, kb = trace_block_keys(a, "m", block_tokens=512), trace_block_keys(b, "m", block_tokens=512)
    assert len(ka) == len(kb) == 3  # two full blocks + a 276-token tail
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    # The tail depends on its length and on everything before it.
    assert trace_block_keys(a[:1299], "m", block_tokens=512)[2] != ka[2]
    c = [BIG - 1] + a[1:]
    assert trace_block_keys(c, "m", block_tokens=512)[2] != ka[2]
    assert trace_block_keys(a[:1024], "m", block_tokens=512) == ka[:2]  # exact multiple: no tail key
    # Namespaces never share keys.
    assert trace_block_keys(a, "other", block_tokens=512)[0] != ka[0]
    assert trace_block_keys(a, "m", lora_name="x", block_tokens=512)[0] != ka[0]
    assert trace_block_keys(a, "m", cache_salt="s", block_tokens=512)[0] != ka[0]
    assert trace_block_keys(a[:10], "m") != trace_block_keys(a[:11], "m")
    # The default granularity is finer: 1300 tokens are 20 blocks of 64 and a 20-token tail.
    assert len(trace_block_keys(a, "m")) == 21 and trace_block_keys(b, "m")[:16] == trace_block_keys(a, "m")[:16]


async def test_rows_share_ids_for_shared_prefixes_dense_and_content_free(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    metrics = RouterMetrics()
    cap = TrafficCapture(path, metrics=metrics, flush_interval_s=3600, block_tokens=512)  # only aclose writes
    cap.start()
    shared = list(range(BIG, BIG + 1024))
    p1 = shared + list(range(BIG + 10_000, BIG + 10_700))  # 1724 tokens: 4 blocks, tail 188
    p2 = shared + list(range(BIG + 20_000, BIG + 20_100))  # 1124 tokens: 3 blocks, tail 100
    p3 = p1 + list(range(BIG + 30_000, BIG + 30_400))  # p1's prefix then more: 2124 tokens
    cap.record(5, p1, 17, "tiny")
    cap.record(9, p2, 3, "tiny")
    cap.record(12, p3, 0, "tiny")
    cap.record(15, p1, 4, "tiny", cache_salt="tenant-b")  # same tokens, other namespace
    assert not path.read_text()  # nothing written before a flush
    await cap.aclose()

    rows = read_rows(path)
    assert [set(r) for r in rows] == [ROW_FIELDS] * 4
    assert {r["block_size"] for r in rows} == {512}
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in rows] == [
        (5, 1724, 17),
        (9, 1124, 3),
        (12, 2124, 0),
        (15, 1724, 4),
    ]
    assert [len(r["hash_ids"]) for r in rows] == [math.ceil(r["input_length"] / 512) for r in rows] == [4, 3, 5, 4]
    assert rows[0]["hash_ids"] == [0, 1, 2, 3]
    assert rows[1]["hash_ids"] == [0, 1, 4]  # shares the first 1024 tokens, own tail
    assert rows[2]["hash_ids"][:3] == [0, 1, 2]  # p1's full blocks; p1's tail (id 3) was partial
    assert rows[2]["hash_ids"][3:] == [5, 6]
    assert rows[3]["hash_ids"] == [7, 8, 9, 10]  # a different cache salt shares nothing
    all_ids = [i for r in rows for i in r["hash_ids"]]
    assert sorted(set(all_ids)) == list(range(11))  # dense, in order of first appearance
    text = path.read_text()
    assert str(BIG) not in text and "tenant" not in text and "tiny" not in text
    assert max(int(n) for n in re.findall(r"\d+", text)) < 3000  # no token id or 64-bit key, only small numbers
    assert counter(metrics, "kvroute_router_capture_rows_total") == 4
    assert counter(metrics, "kvroute_router_capture_dropped_rows_total") == 0


async def test_periodic_flush_sorting_and_bounded_id_map(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    cap = TrafficCapture(path, flush_interval_s=0.05, max_ids=2, block_tokens=512)
    cap.start()
    x, y, z = [BIG] * 512, [BIG + 1] * 512, [BIG + 2] * 512
    cap.record(30, x, 1, "m")  # recorded at completion: later arrivals can finish first
    cap.record(10, y, 1, "m")
    await eventually(lambda: len(read_rows(path)) == 2, 5)
    rows = read_rows(path)
    assert [r["timestamp"] for r in rows] == [10, 30]  # sorted within a flush, ids follow file order
    assert [r["hash_ids"] for r in rows] == [[0], [1]]  # y -> 0, x -> 1
    cap.record(40, z, 1, "m")  # a third key evicts the least recently used one (y)
    cap.record(50, x, 1, "m")  # still mapped
    cap.record(60, y, 1, "m")  # evicted: a new id, never a reused one
    await cap.aclose()
    assert [r["hash_ids"] for r in read_rows(path)] == [[0], [1], [2], [1], [3]]


async def test_sampling_is_deterministic(tmp_path: Path) -> None:
    cap = TrafficCapture(tmp_path / "s.jsonl", sample_rate=0.25)
    cap.start()
    kept = [cap.sample_arrival() is not None for _ in range(12)]
    await cap.aclose()
    assert kept == [False, False, False, True] * 3
    with pytest.raises(ValueError):
        TrafficCapture(tmp_path / "x", sample_rate=0.0)


async def test_write_failure_drops_and_counts_rows_and_logs_once(caplog) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs a device whose writes fail")
    metrics = RouterMetrics()
    cap = TrafficCapture("/dev/full", metrics=metrics, flush_interval_s=3600)
    cap.start()
    with caplog.at_level(logging.ERROR, logger="kvroute.router.capture"):
        cap.record(1, [1, 2, 3], 1, "m")
        cap.record(2, [1, 2, 3], 1, "m")
        await cap.flush()
        cap.record(3, [1, 2, 3], 1, "m")
        await cap.flush()
        await cap.aclose()  # closing retries the file's own buffer into the full device: must not raise
    assert counter(metrics, "kvroute_router_capture_dropped_rows_total") == 3
    assert counter(metrics, "kvroute_router_capture_rows_total") == 0
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


class _SlowDisk:
    """A capture file whose writes wait until `release` is set (a disk, or a machine, that is slow)."""

    def __init__(self, real) -> None:
        self.real, self.writing, self.release = real, threading.Event(), threading.Event()

    def write(self, data) -> int:
        self.writing.set()
        self.release.wait(10)
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


async def test_rows_recorded_while_a_periodic_flush_writes_are_written_at_close(tmp_path: Path) -> None:
    """Closing while the periodic flush is still writing: the rows recorded meanwhile were not in its
    batch, and the close writes them too."""
    path = tmp_path / "slow.jsonl"
    disks: list[_SlowDisk] = []

    def open_file(p: Path) -> _SlowDisk:
        disks.append(_SlowDisk(open(p, "wb", buffering=0)))  # noqa: SIM115 - the capture closes it
        return disks[-1]

    cap = TrafficCapture(path, flush_interval_s=0.01, block_tokens=512, open_file=open_file)
    cap.start()
    cap.record(1, [1] * 700, 5, "m")
    await asyncio.to_thread(disks[0].writing.wait, 10)  # the periodic flush is writing row 1
    cap.record(2, [2] * 700, 5, "m")
    cap.record(3, [3] * 700, 5, "m")
    closing = asyncio.create_task(cap.aclose())
    await asyncio.sleep(0)  # aclose has asked the flush loop to stop
    disks[0].release.set()
    await closing
    assert [r["timestamp"] for r in read_rows(path)] == [1, 2, 3]


class _DiskThatFillsUp:
    """A capture file on a disk that, while `full`, lands 10 bytes of the next write and then fails every
    write, like a disk filling up mid-line."""

    def __init__(self, real) -> None:
        self.real, self.full, self.calls = real, False, 0

    def write(self, data) -> int:
        if not self.full:
            return self.real.write(data)
        self.calls += 1
        if self.calls == 1:
            return self.real.write(data[:10])
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.real, name)


async def test_a_half_written_batch_is_cut_off_and_the_trace_stays_loadable(tmp_path: Path) -> None:
    from kvroute.tools.simulator.workloads import load_mooncake_trace

    path = tmp_path / "h.jsonl"
    metrics = RouterMetrics()
    disks: list[_DiskThatFillsUp] = []

    def open_file(p: Path) -> _DiskThatFillsUp:
        disks.append(_DiskThatFillsUp(open(p, "wb", buffering=0)))  # noqa: SIM115 - the capture closes it
        return disks[-1]

    cap = TrafficCapture(path, metrics=metrics, flush_interval_s=3600, block_tokens=512, open_file=open_file)
    cap.start()
    cap.record(1, [1] * 700, 5, "m")
    await cap.flush()
    disks[0].full = True
    cap.record(2, [2] * 700, 5, "m")
    await cap.flush()
    disks[0].full = False  # the disk recovers
    cap.record(3, [3] * 700, 5, "m")
    await cap.aclose()
    rows = read_rows(path)
    assert [r["timestamp"] for r in rows] == [1, 3]
    assert rows[1]["hash_ids"] == [4, 5]  # ids 2, 3 went to the dropped row
    assert len(load_mooncake_trace(path).requests) == 2
    assert counter(metrics, "kvroute_router_capture_dropped_rows_total") == 1
    assert counter(metrics, "kvroute_router_capture_rows_total") == 2


async def test_buffer_bound_drops_instead_of_growing(tmp_path: Path) -> None:
    metrics = RouterMetrics()
    cap = TrafficCapture(tmp_path / "b.jsonl", metrics=metrics, max_buffered_rows=2, flush_interval_s=3600)
    cap.start()
    for i in range(5):
        cap.record(i, [1] * 600, 1, "m")
    await cap.aclose()
    assert len(read_rows(tmp_path / "b.jsonl")) == 2
    assert counter(metrics, "kvroute_router_capture_dropped_rows_total") == 3


def test_output_length_from_the_response_tail() -> None:
    body = {
        "id": "x",
        "choices": [{"text": 'say "usage": {"completion_tokens": 99}'}],
        "usage": {"prompt_tokens": 10, "total_tokens": 17, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert reported_output_tokens(json.dumps(body).encode()) == 7
    assert reported_output_tokens(json.dumps(body, separators=(",", ":")).encode()) == 7
    sse = (
        b"".join(
            b"data: " + json.dumps(c).encode() + b"\n\n"
            for c in (
                {"choices": [{"text": "a"}]},
                {"choices": [{"text": "b"}], "usage": {"completion_tokens": 1}},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
            )
        )
        + b"data: [DONE]\n\n"
    )
    assert reported_output_tokens(sse) == 2  # the last usage chunk holds the totals
    assert reported_output_tokens(sse[-60:]) is None  # usage cut off: unknown, not a guess
    assert reported_output_tokens(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n') is None
    assert reported_output_tokens(b'{"usage": null}') is None
    assert requested_output_tokens({"max_tokens": 12}) == 12
    assert requested_output_tokens({"max_tokens": 12, "max_completion_tokens": 5}) == 5
    assert requested_output_tokens({"max_tokens": True}) == 0 and requested_output_tokens({}) == 0


# ---------------------------------------------------------------- end to end, real processes


def tokens(base: int, n: int) -> list[int]:
    return [10 + (base + i * 7) % 1900 for i in range(n)]  # inside the tiny model's vocabulary


@pytest.mark.e2e
def test_router_captures_live_traffic_that_the_simulator_replays(tmp_path: Path, tiny_model_dir: Path) -> None:
    trace_path = tmp_path / "captured.jsonl"
    cluster = LocalCluster(workdir=tmp_path, tokenizer_dir=tiny_model_dir, block_size=16)
    try:
        cluster.start_sim_fleet(2, "--num-blocks", "1024", "--speedup", "50")
        grpc_port = free_port()
        url = cluster.start_router(
            "cap", "kv_aware", "--capture-trace", str(trace_path), "--capture-block-tokens", "512", "--grpc-port", str(grpc_port)
        )
        router = cluster.routers["cap"]
        wait_until(lambda: json.loads(http_get(url + "/health")[1])["workers"] == 2, 15, "router knows the fleet", [router])

        shared = tokens(0, 1100)  # two full 512 blocks + 76 shared tokens
        prompts = [shared + tokens(1000 * (i + 1), 150 + 40 * i) for i in range(5)]
        # (stream, include_usage, max_tokens): streamed with and without a usage chunk, and plain JSON.
        modes = [(False, False, 6), (True, True, 5), (True, False, 7), (False, False, 3), (True, True, 4)]
        engine_prompt_tokens = []
        for prompt, (stream, usage, max_tokens) in zip(prompts, modes, strict=True):
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
            if usage:
                body["stream_options"] = {"include_usage": True}
            if not stream:
                status, raw = http_post_json(url + "/v1/completions", body)
                assert status == 200, raw
                engine_prompt_tokens.append(json.loads(raw)["usage"]["prompt_tokens"])
                continue
            req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                events = resp.read().decode().split("\n\n")
            assert events[-2] == "data: [DONE]", events[-3:]
            engine_prompt_tokens.append(len(prompt))
        # A chat request with text: its words must not reach the file.
        chat = {
            "model": cluster.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "confidential quarterly numbers " * 40}],
        }
        status, raw = http_post_json(url + "/v1/chat/completions", chat)
        assert status == 200, raw
        chat_prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
        # /v1/route is a decision probe, not traffic: not recorded.
        assert http_post_json(url + "/v1/route", chat)[0] == 200
        # A gRPC Route decision is recorded, with no output budget to report.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            decision = pb_grpc.RouterStub(channel).Route(
                pb.RouteRequest(model=cluster.model, token_ids=pb.TokenIds(ids=prompts[1])), timeout=10
            )
        assert decision.prompt_tokens == len(prompts[1])

        # The background flush writes within about a second, before any shutdown.
        wait_until(lambda: trace_path.exists() and len(read_rows(trace_path)) == 7, 10, "periodic flush", [router])
        metrics = http_get(url + "/metrics")[1].decode()
        assert "kvroute_router_capture_rows_total 7.0" in metrics
        assert "kvroute_router_capture_dropped_rows_total 0.0" in metrics
        # One more, then SIGTERM at once: the shutdown flush must keep it.
        status, raw = http_post_json(url + "/v1/completions", {"model": cluster.model, "prompt": prompts[0], "max_tokens": 2})
        assert status == 200, raw
        cluster.stop_router("cap")
        assert router.popen.returncode == 0, router.log_tail()
    finally:
        cluster.stop()

    rows = read_rows(trace_path)
    assert len(rows) == 8
    assert all(set(r) == ROW_FIELDS and r["block_size"] == 512 for r in rows)
    assert [r["input_length"] for r in rows] == engine_prompt_tokens + [chat_prompt_tokens, len(prompts[1]), len(prompts[0])]
    assert [r["output_length"] for r in rows] == [6, 5, 7, 3, 4, 2, 0, 2]
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 512) for r in rows)
    timestamps = [r["timestamp"] for r in rows]
    assert timestamps == sorted(timestamps) and timestamps[0] >= 0
    assert rows[0]["hash_ids"] == [0, 1, 2]  # dense from 0
    for r in rows[1:5]:
        assert r["hash_ids"][:2] == [0, 1]  # the shared 1024 tokens
        assert r["hash_ids"][2] not in (0, 1, 2)  # each prompt's own third block
    assert rows[6]["hash_ids"] == rows[1]["hash_ids"]  # gRPC Route on prompt 1's tokens
    assert rows[7]["hash_ids"] == rows[0]["hash_ids"]  # the same prompt again: the same ids
    assert not set(rows[5]["hash_ids"]) & {0, 1, 2}  # the chat prompt shares nothing
    all_ids = {i for r in rows for i in r["hash_ids"]}
    assert all_ids == set(range(len(all_ids)))
    assert "confidential" not in trace_path.read_text()

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "simulate",
            "--trace",
            str(trace_path),
            "--workers",
            "2",
            "--policies",
            "kv_aware,round_robin",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["oracle_hit_rate"] > 0
    assert result["policies"]["kv_aware"]["hit_rate"] > 0
