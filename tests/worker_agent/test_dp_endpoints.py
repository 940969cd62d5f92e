"""Data-parallel port offsets (docs/wire-formats.md#data-parallel-endpoints)."""

from __future__ import annotations

import pytest

from kvroute.worker_agent.dp_endpoints import check_no_overlap, offset_endpoint, rank_endpoints


@pytest.mark.parametrize(
    "endpoint, rank, engine, expected",
    [
        ("tcp://10.0.0.8:5557", 0, "vllm", "tcp://10.0.0.8:5557"),
        ("tcp://10.0.0.8:5557", 3, "vllm", "tcp://10.0.0.8:5560"),
        ("tcp://[::1]:5557", 1, "sglang", "tcp://[::1]:5558"),
        ("tcp://*:5557", 2, "vllm", "tcp://*:5559"),
        ("inproc://kv", 2, "vllm", "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 0, "vllm", "ipc:///tmp/kv"),
        ("ipc:///tmp/kv", 1, "trtllm", "ipc:///tmp/kv_dp1"),
    ],
)
def test_offsets(endpoint: str, rank: int, engine: str, expected: str) -> None:
    assert offset_endpoint(endpoint, rank, engine) == expected


@pytest.mark.parametrize(
    "endpoint, rank, engine, message",
    [
        ("ipc:///tmp/kv", 1, "sglang", "sglang cannot publish KV events on ipc://"),
        ("tcp://h:0", 1, "vllm", "port 0 cannot be offset"),
        ("tcp://h:65535", 1, "vllm", "port 65536 > 65535"),
        ("tcp://h", 0, "vllm", "no numeric port"),
        ("tcp://:5557", 0, "vllm", "no numeric port"),
        ("http://h:1", 0, "vllm", "must be tcp://"),
        ("h:5557", 0, "vllm", "must be tcp://"),
        ("tcp://h:5557", -1, "vllm", "rank must be >= 0"),
    ],
)
def test_endpoints_a_rank_cannot_have(endpoint: str, rank: int, engine: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        offset_endpoint(endpoint, rank, engine)


def test_replay_ports_must_stay_clear_of_the_live_ones() -> None:
    live = rank_endpoints("tcp://h:5557", [0, 1, 2], "vllm")
    check_no_overlap(live, rank_endpoints("tcp://h:5560", [0, 1, 2], "vllm"))
    with pytest.raises(ValueError, match="tcp://h:5559"):
        check_no_overlap(live, rank_endpoints("tcp://h:5558", [0, 1, 2], "vllm"))
