"""SilenceWatch: a stream is silent only when the engine's own counters prove it stored new blocks
that no KV event announced within the window."""

from __future__ import annotations

import pytest

from kvroute.worker_agent.engine_metrics import EngineWork
from kvroute.worker_agent.event_silence import MIN_BLOCKS, SILENCE_WINDOWS_S, SilenceWatch

BLOCK = 16


def feed(watch: SilenceWatch, samples: list[tuple[float, float, float]], last_event_at: float | None = None) -> bool:
    """(at, computed tokens, requests) samples, in order; returns `silent` after the last."""
    for at, tokens, requests in samples:
        watch.observe(at, EngineWork(tokens, requests), last_event_at, BLOCK)
    return watch.silent


def steady(seconds: int, tokens_per_s: float, requests_per_s: float) -> list[tuple[float, float, float]]:
    """One sample every 0.5 s, from 0 s on, of an engine doing the same work each second."""
    return [(t / 2, tokens_per_s * t / 2, requests_per_s * t / 2) for t in range(2 * seconds + 1)]


def test_work_without_events_for_a_window_is_silent_and_says_what_the_engine_did() -> None:
    watch = SilenceWatch(10.0)
    samples = steady(12, 400, 1)
    assert not feed(watch, samples[:20])  # up to 9.5 s: not a window of history yet
    assert feed(watch, samples[20:21])  # 10 s
    assert watch.since == pytest.approx(10.0)
    assert watch.reason.startswith("the engine computed 4000 uncached prompt tokens for 10 requests in the last 10s")


def test_an_idle_engine_is_never_silent() -> None:
    watch = SilenceWatch(10.0)
    assert not feed(watch, [(t / 2, 5000.0, 20.0) for t in range(200)])  # counters from before, none moving


def test_prompts_cached_but_for_their_last_block_are_not_silence() -> None:
    """A load test repeating one prompt: each request computes only its partial last block (15 tokens),
    or, its length a multiple of the block size, its whole last block again (16): no new block."""
    for per_request in (BLOCK - 1, BLOCK):
        watch = SilenceWatch(10.0)
        assert not feed(watch, steady(60, per_request * 50, 50)), per_request
    # The bound: one request of MIN_BLOCKS + 1 blocks' worth of uncached tokens proves MIN_BLOCKS new blocks.
    watch = SilenceWatch(10.0)
    assert not feed(watch, [(0.0, 0.0, 0.0), (11.0, (MIN_BLOCKS + 1) * BLOCK - 1, 1.0)])
    assert feed(watch, [(12.0, (MIN_BLOCKS + 1) * BLOCK, 1.0)])


def test_events_within_the_window_mean_the_stream_follows() -> None:
    watch = SilenceWatch(10.0)
    assert not feed(watch, steady(30, 400, 1), last_event_at=25.0)
    # and a batch after the stream turned silent ends it, with or without a new sample
    silent = SilenceWatch(10.0)
    assert feed(silent, steady(12, 400, 1))
    assert silent.events_seen(9.5)  # before it turned silent (at 10 s): changes nothing
    assert not silent.events_seen(12.5) and silent.reason == ""


def test_silence_stays_while_the_engine_goes_idle() -> None:
    watch = SilenceWatch(10.0)
    assert feed(watch, steady(12, 400, 1))
    assert feed(watch, [(12.0 + t / 2, 4800.0, 12.0) for t in range(1, 100)])  # idle since: still no event


def test_counters_that_go_back_start_the_history_over() -> None:
    watch = SilenceWatch(10.0)
    feed(watch, steady(5, 400, 1))
    # The engine restarted: its counters begin at 0 again; a window of its own work is needed.
    assert not feed(watch, [(6.0, 0.0, 0.0), (15.5, 3800.0, 9.5)])
    assert feed(watch, [(16.5, 4200.0, 10.5)])


def test_windows_cover_every_engine() -> None:
    assert set(SILENCE_WINDOWS_S) == {"vllm", "sglang", "trtllm"}
    with pytest.raises(ValueError):
        SilenceWatch(0.0)
