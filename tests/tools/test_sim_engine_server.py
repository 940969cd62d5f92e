"""The sim engine over HTTP, in-process: OpenAI streaming, vLLM metrics, errors, aborts, tracing."""

from __future__ import annotations

import json

import aiohttp
import pytest

from kvroute.prom_text import sample_sums
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.engine import EngineConfig, SimEngine
from kvroute.tools.sim_engine.kv_publisher import KvEventPublisher
from kvroute.tools.sim_engine.server import start_server
from kvroute.tools.sim_engine.tokenizer import load_engine_tokenizer
from tests.helpers import eventually

LONG_SYSTEM = " ".join(["the cache router keeps every prefix block of the system prompt warm"] * 12)


@pytest.fixture
async def engine(tiny_model_dir):
    tokenizer = load_engine_tokenizer(tiny_model_dir)
    publisher = KvEventPublisher(
        {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}, block_size=16
    )
    eng = SimEngine(EngineConfig(num_blocks=256, max_model_len=1024, speedup=20), tokenizer, CostModel(), publisher)
    runner, port = await start_server(eng, "127.0.0.1", 0)
    eng.url = f"http://127.0.0.1:{port}"
    try:
        yield eng
    finally:
        await runner.cleanup()
        await eng.stop()


def metric(text: str, name: str) -> float:
    return sample_sums(text, {name}).get(name, 0.0)


async def sse_chunks(resp: aiohttp.ClientResponse) -> list[str]:
    raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def chat(user: str, **kw) -> dict:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": user}],
        **kw,
    }


async def test_streaming_chat_completion(engine) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            engine.url + "/v1/chat/completions",
            json=chat("hello", max_tokens=5, stream=True, stream_options={"include_usage": True}),
        ) as resp,
    ):
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = await sse_chunks(resp)
    assert chunks[-1] == "[DONE]"
    bodies = [json.loads(c) for c in chunks[:-1]]
    assert all(b["object"] == "chat.completion.chunk" and b["model"] == "tiny-llama" for b in bodies)
    assert len({b["id"] for b in bodies}) == 1
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = bodies[1:-1]
    assert len(tokens) == 5 and all(b["choices"][0]["delta"]["content"] for b in tokens)
    assert [b["choices"][0]["finish_reason"] for b in tokens] == [None] * 4 + ["length"]
    usage = bodies[-1]["usage"]
    assert bodies[-1]["choices"] == [] and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5 and usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_repeated_prompt_hits_the_cache_and_metrics_rise(engine) -> None:
    async with aiohttp.ClientSession() as http:
        usages = []
        for _ in range(2):
            async with http.post(engine.url + "/v1/chat/completions", json=chat("what is cached?", max_tokens=3)) as r:
                body = await r.json()
                assert r.status == 200 and body["object"] == "chat.completion"
                assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["role"] == "assistant"
                usages.append(body["usage"])
        async with http.get(engine.url + "/metrics") as r:
            text = await r.text()
        async with http.post(engine.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}) as r:
            completion = await r.json()
        async with http.get(engine.url + "/kvroute/blocks") as r:
            blocks = await r.json()
    prompt_tokens = usages[0]["prompt_tokens"]
    assert prompt_tokens > 100 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    hit = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert hit == (prompt_tokens - 1) // 16 * 16 and hit > 0
    assert metric(text, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens
    assert metric(text, "vllm:prefix_cache_hits_total") == hit
    assert metric(text, "vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert metric(text, "vllm:generation_tokens_total") == 6
    assert metric(text, "vllm:request_success_total") == 2
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 2
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0
    assert 'vllm:num_requests_waiting{model_name="tiny-llama"}' in text
    assert completion["object"] == "text_completion" and completion["usage"]["prompt_tokens"] == 3
    assert blocks["counts"]["gpu"] == len(blocks["tiers"]["gpu"]) >= prompt_tokens // 16 and blocks["block_size"] == 16
    assert blocks["tiers"]["cpu"] == [] and blocks["model"] == "tiny-llama"


async def test_errors_are_vllm_like(engine) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + "/v1/completions", json={"prompt": list(range(10, 1100))}) as r:
            too_long = (r.status, await r.json())
        async with http.post(engine.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1024}) as r:
            too_many = (r.status, await r.json())
        async with http.post(engine.url + "/v1/chat/completions", json=chat("x", model="other")) as r:
            wrong_model = (r.status, await r.json())
        async with http.post(engine.url + "/v1/chat/completions", data=b"{not json") as r:
            bad_json = r.status
        async with http.get(engine.url + "/v1/models") as r:
            models = await r.json()
        async with http.get(engine.url + "/health") as r:
            health = r.status
    assert too_long[0] == 400 and "maximum context length is 1024 tokens" in too_long[1]["error"]["message"]
    assert too_long[1]["error"]["type"] == "BadRequestError" and too_long[1]["error"]["code"] == 400
    assert too_many[0] == 400 and "max_tokens" in too_many[1]["error"]["message"]
    assert wrong_model[0] == 404 and "does not exist" in wrong_model[1]["error"]["message"]
    assert bad_json == 400 and health == 200
    assert models["data"][0]["id"] == "tiny-llama" and models["data"][0]["max_model_len"] == 1024


async def test_client_disconnect_aborts_the_request(engine) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 800, "stream": True}) as r,
    ):
        await r.content.readline()  # first token is out
        assert engine.cache.usage() > 0
    await eventually(lambda: not engine.scheduler.has_work(), 2, what="the abandoned request's work gone")
    assert engine.cache.usage() == 0


async def test_incoming_traceparent_parents_the_server_span(engine, monkeypatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvroute.tools.sim_engine import server

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(server, "tracer", provider.get_tracer("test"))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers) as r,
    ):
        assert r.status == 200
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent_id
    assert span.attributes["kvroute.prompt_tokens"] > 0
