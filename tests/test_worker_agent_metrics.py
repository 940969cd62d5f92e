"""Engine /metrics parsing and polling (load shipped with heartbeats)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from worker_agent.engine_metrics import EngineLoadPoller, parse_load

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny llama"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny llama"} 0.25
vllm:prefix_cache_hits_total{engine="0",model_name="tiny llama"} 1234.0
this line is garbage {{{
vllm:num_requests_running{broken 7
vllm:num_requests_waiting NaN
"""


def test_parse_sums_counts_and_averages_usage() -> None:
    load = parse_load(VLLM_METRICS, now_ms=42)
    assert (load.running_requests, load.waiting_requests) == (5, 4)
    assert load.kv_usage == pytest.approx(0.375) and load.observed_unix_ms == 42


def test_parse_older_usage_name_and_no_labels() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2 1700000000000\nvllm:gpu_cache_usage_perc 0.9\n"
    load = parse_load(text)
    assert (load.running_requests, load.waiting_requests) == (1, 2) and load.kv_usage == pytest.approx(0.9)
    # the newer name wins when both are present
    assert parse_load(text + "vllm:kv_cache_usage_perc 0.1\n").kv_usage == pytest.approx(0.1)


def test_parse_without_vllm_metrics_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_load("# nothing here\nprocess_cpu_seconds_total 3\n")


async def test_poller_keeps_last_known_load_when_the_engine_goes_away() -> None:
    app = web.Application()
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    poller = EngineLoadPoller(f"http://127.0.0.1:{port}/", timeout_s=1.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        assert await poller.poll_once(session)
        assert poller.latest.running_requests == 5 and poller.failures == 0
        observed = poller.latest.observed_unix_ms
        await runner.cleanup()  # engine gone
        assert not await poller.poll_once(session)
        assert not await poller.poll_once(session)
    assert poller.failures == 2
    assert poller.latest.running_requests == 5 and poller.latest.observed_unix_ms == observed
