"""The agent's input limits as a user sets them, and a live fuzz of a real agent process.

The fuzz (`kvroute bench fuzz --target agent-zmq`, bench/fuzz_agent.py) runs a control plane and an agent
as processes, and plays a hostile engine on the agent's KV-event endpoint: over 10,000 malformed,
random and oversize messages between valid batches with consecutive sequence numbers, junk on every
replay answer. Afterwards the agent must be alive and answer /health within 1 s, the control plane
must hold exactly the keys of the valid events, and the agent's counters must show every bad message
and no reset, unfilled gap or internal error.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import zmq

from kvroute.tools.bench.fuzz import run_target
from kvroute.worker_agent.agent import WorkerAgent
from kvroute.worker_agent.cli import add_arguments, config_from_args
from kvroute.worker_agent.limits import DEFAULT_MAX_BATCH_EVENTS, DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_POLL_BYTES

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
LIMIT_FLAGS = {
    "--kv-events-max-frame-bytes": DEFAULT_MAX_FRAME_BYTES,
    "--kv-events-max-batch-events": DEFAULT_MAX_BATCH_EVENTS,
    "--kv-events-max-poll-bytes": DEFAULT_MAX_POLL_BYTES,
}


def agent_from(*argv: str) -> WorkerAgent:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return WorkerAgent(config_from_args(parser.parse_args(["--model", "m", *argv])))


async def test_the_limit_flags_reach_the_sockets_the_decoder_and_the_poller() -> None:
    agent = agent_from(
        "--kv-events-max-frame-bytes",
        "12345",
        "--kv-events-max-batch-events",
        "77",
        "--kv-events",
        "tcp://127.0.0.1:1",
        "--replay-endpoint",
        "tcp://127.0.0.1:2",
    )
    source = agent.workers[0].source
    assert source is not None and source.max_frame_bytes == 12345 and source.decode.keywords == {"max_events": 77}
    source.open()
    try:
        assert source._sub.getsockopt(zmq.MAXMSGSIZE) == 12345
    finally:
        source._sub.disable_monitor()  # first: see zmq_source._close_monitored
        source._monitor.close(linger=0)
        source._sub.close(linger=0)
        agent._zmq.destroy(linger=0)
    pull = agent_from("--engine", "trtllm", "--kv-events-max-poll-bytes", "999", "--kv-events-max-batch-events", "5")
    assert pull.poller.max_body_bytes == 999 and pull.poller.converter.max_events == 5
    default = agent_from("--engine", "trtllm")
    assert (default.poller.max_body_bytes, default.poller.converter.max_events) == (
        DEFAULT_MAX_POLL_BYTES,
        DEFAULT_MAX_BATCH_EVENTS,
    )


def test_the_operations_doc_names_every_limit_with_its_default() -> None:
    text = OPERATIONS.read_text()
    for flag, default in LIMIT_FLAGS.items():
        assert flag in text, flag
        mib = default >> 20
        assert (
            f"{flag}` (default {mib} MiB" in text
            if default % (1 << 20) == 0 and flag.endswith("bytes")
            else f"{flag}` (default {default:,}" in text
        ), flag


@pytest.mark.slow
def test_live_fuzz_of_an_agent_process(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    report = run_target("agent-zmq", 10_000, seed=seed, workdir=tmp_path)
    summary = f"seed {seed}: {report}"
    assert report.bad_messages >= 10_000 and report.valid_messages >= 2_000, summary
    assert report.crashes == 0 and report.health_ms < 1000, summary
    assert report.applied, summary
    assert report.bad_counted == report.bad_expected, summary
    assert report.bad_counted["oversize_frames"] == 3 and report.bad_counted["oversize_batches"] > 0, summary
    assert report.ok, summary
