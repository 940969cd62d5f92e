"""The engine's HTTP endpoints the agent polls: /metrics (load shipped with heartbeats) and /v1/models
(served model and LoRA adapters)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.v1 import kvroute_pb2 as pb
from kvroute.worker_agent.engine_metrics import (
    SGLANG_METRICS,
    EngineLoadPoller,
    EngineWork,
    parse_load,
    parse_metrics,
    parse_trtllm_metrics,
    parse_trtllm_stats,
)
from kvroute.worker_agent.engine_models import EngineModelsPoller, parse_models

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


def test_parse_kv_capacity_of_each_engine() -> None:
    # vLLM: the cache_config_info gauge's labels, num_gpu_blocks x block_size, per engine core summed.
    vllm = (
        VLLM_METRICS
        + "# TYPE vllm:cache_config_info gauge\n"
        + 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1024"} 1.0\n'
        + 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="512"} 1.0\n'
    )
    assert parse_load(vllm).kv_capacity_tokens == 1536 * 16
    # Not profiled yet ("None") or not exported (older vLLM): unknown.
    assert (
        parse_load(VLLM_METRICS + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n').kv_capacity_tokens == 0
    )
    assert parse_load(VLLM_METRICS).kv_capacity_tokens == 0
    # SGLang: max_total_num_tokens, in tokens already.
    sglang = SGLANG_TEXT + 'sglang:max_total_num_tokens{model_name="tiny",dp_rank="0"} 161721.0\n'
    assert parse_load(sglang, SGLANG_METRICS).kv_capacity_tokens == 161721
    # TensorRT-LLM: maxNumBlocks x tokensPerBlock of the newest iteration; kept while no iteration says.
    body = b'[{"numActiveRequests": 1, "kvCacheStats": {"maxNumBlocks": 200, "usedNumBlocks": 50, "tokensPerBlock": 32}}]'
    load = parse_trtllm_stats(body, pb.WorkerLoad())
    assert load.kv_capacity_tokens == 6400
    assert parse_trtllm_stats(b"[]", load).kv_capacity_tokens == 6400
    assert parse_trtllm_stats(b'[{"numActiveRequests": 4}]', load).kv_capacity_tokens == 6400


def test_parse_older_usage_name_and_no_labels() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2 1700000000000\nvllm:gpu_cache_usage_perc 0.9\n"
    load = parse_load(text)
    assert (load.running_requests, load.waiting_requests) == (1, 2) and load.kv_usage == pytest.approx(0.9)
    # the newer name wins when both are present
    assert parse_load(text + "vllm:kv_cache_usage_perc 0.1\n").kv_usage == pytest.approx(0.1)


SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="tiny",engine_type="unified",dp_rank="0"} 2.0
sglang:num_running_reqs{model_name="tiny",engine_type="unified",dp_rank="1"} 1.0
sglang:num_queue_reqs{model_name="tiny",engine_type="unified",dp_rank="0"} 5.0
sglang:token_usage{model_name="tiny",engine_type="unified",dp_rank="0"} 0.2
sglang:token_usage{model_name="tiny",engine_type="unified",dp_rank="1"} 0.4
sglang:cache_hit_rate{model_name="tiny"} 0.9
vllm:num_requests_running 99
"""


def test_parse_sglang_names() -> None:
    load = parse_load(SGLANG_TEXT, SGLANG_METRICS, now_ms=1)
    assert (load.running_requests, load.waiting_requests) == (3, 5) and load.kv_usage == pytest.approx(0.3)
    with pytest.raises(ValueError, match="sglang:num_running_reqs"):
        parse_load(VLLM_METRICS, SGLANG_METRICS)  # another engine's names are not this engine's load


def test_parse_trtllm_iteration_stats() -> None:
    last = pb.WorkerLoad(kv_usage=0.7)
    body = (
        b'[{"iter": 1, "numActiveRequests": 9, "numQueuedRequests": 9, "kvCacheStats": {"maxNumBlocks": 100, '
        b'"usedNumBlocks": 10}}, {"iter": 2, "numActiveRequests": 3, "numQueuedRequests": 2, "gpuMemUsage": 1,'
        b' "kvCacheStats": {"maxNumBlocks": 200, "usedNumBlocks": 50, "freeNumBlocks": 150, "tokensPerBlock": 32}}]'
    )
    load = parse_trtllm_stats(body, last, now_ms=5)
    assert (load.running_requests, load.waiting_requests, load.observed_unix_ms) == (3, 2, 5)
    assert load.kv_usage == pytest.approx(0.25)  # the newest entry
    partial = parse_trtllm_stats(b'[{"numActiveRequests": 4}]', last)  # fields missing: usage stays last known
    assert (partial.running_requests, partial.waiting_requests) == (4, 0) and partial.kv_usage == pytest.approx(0.7)
    idle = parse_trtllm_stats(b"[]", last)  # no iteration since the last poll: nothing ran
    assert (idle.running_requests, idle.waiting_requests) == (0, 0) and idle.kv_usage == pytest.approx(0.7)
    for bad in (b"{}", b"nope", b'[{"numActiveRequests": "x"}]'):
        with pytest.raises(ValueError):
            parse_trtllm_stats(bad, last)


def test_parse_work_counters_of_each_engine() -> None:
    vllm = VLLM_METRICS + (
        'vllm:prefix_cache_queries_total{engine="0"} 1000\nvllm:prefix_cache_queries_total{engine="1"} 600\n'
        'vllm:prefix_cache_hits_total{engine="1"} 366\n'  # + engine 0's 1234 above: 1600 - 1600 hits
        "vllm:gpu_prefix_cache_queries_total 99999\n"  # the older name is not read beside the newer one
        'vllm:time_to_first_token_seconds_count{engine="0"} 7\nvllm:time_to_first_token_seconds_sum 1.5\n'
    )
    assert parse_metrics(vllm)[1] == EngineWork(0.0, 7.0)
    older = (
        "vllm:num_requests_running 1\nvllm:gpu_prefix_cache_queries_total 500\n"
        "vllm:gpu_prefix_cache_hits_total 100\nvllm:time_to_first_token_seconds_count 3\n"
    )
    assert parse_metrics(older)[1] == EngineWork(400.0, 3.0)
    assert parse_metrics(VLLM_METRICS)[1] is None  # no request counter: no work known
    sglang = SGLANG_TEXT + (
        'sglang:prompt_tokens_total{model_name="tiny"} 900\n'
        'sglang:cached_tokens_total{model_name="tiny",cache_source="device"} 300\n'
        'sglang:cached_tokens_total{model_name="tiny",cache_source="host"} 100\n'
        'sglang:num_requests_total{model_name="tiny"} 4\n'
    )
    assert parse_metrics(sglang, SGLANG_METRICS)[1] == EngineWork(500.0, 4.0)
    assert parse_metrics(SGLANG_TEXT, SGLANG_METRICS)[1] is None  # started without --enable-metrics' counters


def test_parse_trtllm_work_of_the_drained_iterations() -> None:
    body = (
        b'[{"numActiveRequests": 1, "inflightBatchingStats": {"numContextRequests": 2, "numCtxTokens": 640}},'
        b' {"numActiveRequests": 1, "inflightBatchingStats": {"numContextRequests": 0, "numCtxTokens": 0}},'
        b' {"numActiveRequests": 1, "inflightBatchingStats": {"numContextRequests": 1, "numCtxTokens": 64}}]'
    )
    assert parse_trtllm_metrics(body, pb.WorkerLoad())[1] == EngineWork(704.0, 3.0)
    assert parse_trtllm_metrics(b"[]", pb.WorkerLoad())[1] == EngineWork(0.0, 0.0)  # idle: no work
    assert parse_trtllm_metrics(b'[{"numActiveRequests": 4}]', pb.WorkerLoad())[1] is None  # not reported


async def test_trtllm_poller_adds_up_the_work_of_each_drained_poll() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.json_response([{"inflightBatchingStats": {"numContextRequests": 1, "numCtxTokens": 100}}])

    server = await serve("/metrics", metrics)
    poller = EngineLoadPoller(str(server.make_url("")), engine="trtllm")
    try:
        async with aiohttp.ClientSession() as session:
            assert await poller.poll_once(session) and await poller.poll_once(session)
        assert poller.work == EngineWork(200.0, 2.0) and poller.work_at is not None
    finally:
        await server.close()


def test_parse_without_vllm_metrics_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_load("# nothing here\nprocess_cpu_seconds_total 3\n")


async def serve(path: str, handler) -> TestServer:
    """A real HTTP server on a loopback port answering GET `path`."""
    app = web.Application()
    app.router.add_get(path, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_poller_keeps_last_known_load_when_the_engine_goes_away() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    server = await serve("/metrics", metrics)
    poller = EngineLoadPoller(str(server.make_url("/")), timeout_s=1.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        assert await poller.poll_once(session)
        assert poller.latest.running_requests == 5 and poller.failures == 0
        observed = poller.latest.observed_unix_ms
        await server.close()  # engine gone
        assert not await poller.poll_once(session)
        assert not await poller.poll_once(session)
    assert poller.failures == 2
    assert poller.latest.running_requests == 5 and poller.latest.observed_unix_ms == observed


async def test_trtllm_poller_reads_json() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(
            [{"numActiveRequests": 2, "numQueuedRequests": 1, "kvCacheStats": {"maxNumBlocks": 10, "usedNumBlocks": 5}}]
        )

    server = await serve("/metrics", metrics)
    poller = EngineLoadPoller(str(server.make_url("")), engine="trtllm")
    try:
        async with aiohttp.ClientSession() as session:
            assert await poller.poll_once(session)
        assert (poller.latest.running_requests, poller.latest.waiting_requests) == (2, 1)
        assert poller.latest.kv_usage == pytest.approx(0.5)
    finally:
        await server.close()
    with pytest.raises(ValueError):
        EngineLoadPoller("http://x", engine="ollama")


VLLM_MODELS = b"""{"object": "list", "data": [
 {"id": "llama-70b", "object": "model", "root": "/models/llama-70b", "parent": null, "max_model_len": 8192},
 {"id": "llama", "object": "model", "root": "/models/llama-70b", "parent": null},
 {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "llama-70b"},
 {"id": "chat-lora", "object": "model", "root": "/adapters/chat", "parent": "llama-70b"},
 {"id": "other", "object": "model", "root": "llama-70b"},
 {"id": "unrelated", "object": "model", "root": "/x", "parent": "another-model"}]}"""


def test_parse_models_finds_the_base_model_and_its_adapters() -> None:
    assert parse_models(VLLM_MODELS, None) == ("llama-70b", ["chat-lora", "other", "sql-lora"])
    assert parse_models(VLLM_MODELS, "llama") == ("llama", [])  # another served name: no adapter names it
    # An adapter listed first is not taken for the base model.
    assert parse_models(b'{"data": [{"id": "a", "parent": "b"}, {"id": "b"}]}', None) == ("b", ["a"])
    assert parse_models(b'{"data": [{"id": "trt-model", "object": "model", "owned_by": "tensorrt_llm"}]}', None) == (
        "trt-model",
        [],
    )
    for bad in (b"{}", b'{"data": []}', b"<html>", b'{"data": [{"object": "model"}]}'):
        with pytest.raises(ValueError):
            parse_models(bad, None)


async def test_models_poller_reports_changes_only() -> None:
    body = {"data": [{"id": "m"}, {"id": "sql", "parent": "m"}]}

    async def models(request: web.Request) -> web.Response:
        return web.json_response(body)

    server = await serve("/v1/models", models)
    seen: list[list[str]] = []
    poller = EngineModelsPoller(str(server.make_url("")), None, seen.append)
    try:
        assert await poller.discover() == "m" and seen == [["sql"]]
        async with aiohttp.ClientSession() as session:
            assert await poller.poll_once(session) and seen == [["sql"]]
            body["data"].append({"id": "chat", "parent": "m"})
            assert await poller.poll_once(session) and seen == [["sql"], ["chat", "sql"]]
            await server.close()
            assert not await poller.poll_once(session)
        assert poller.failures == 1 and poller.adapters == ["chat", "sql"]  # last known kept
    finally:
        await server.close()
