"""Two models behind one router, every plane its own process over real sockets.

A control plane, four sim engines with their agents, two serving `tiny-llama` (the router's default
model, tokenizer from --tokenizer) and two serving `kvroute-test/tiny-chat` (no --model-tokenizer:
found under its own id in the Hugging Face cache the router is pointed at), and one kv_aware router.
Each engine is warmed directly with documents of its own; then a request for either model that
extends one of them goes to the engine that cached it, among that model's workers only, over HTTP,
over the gRPC Route API and through the endpoint picker (`kvroute epp`). /v1/models lists both models, an unknown model gets OpenAI's 404
`model_not_found`, and the router's metrics say it loaded two tokenizers, once each.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.prom_text import samples, sums_by_label
from kvroute.tools.ext_proc_client import EnvoyExtProcStream
from kvroute.tools.local_cluster import (
    LocalCluster,
    free_port,
    grpc_health_serving,
    http_get,
    http_post_json,
    http_post_json_headers,
    long_text,
    wait_until,
)
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

CHAT_MODEL = "kvroute-test/tiny-chat"
ENGINES = {"llama-0": "tiny-llama", "llama-1": "tiny-llama", "chat-0": CHAT_MODEL, "chat-1": CHAT_MODEL}
DOC_WORDS = 300


def _hub_cache_with(model_id: str, model_dir: Path, hub: Path) -> Path:
    """A Hugging Face hub cache holding `model_dir` as `model_id`'s snapshot (its on-disk layout)."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    return hub


@pytest.fixture(scope="module")
def cluster(module_local_fleet, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    c = module_local_fleet("many-models")
    c.start_control_plane()
    for worker_id, model in ENGINES.items():
        c.add_sim_engine(worker_id, "--num-blocks", "512", "--speedup", "50", "--model", model, agent_args=("--model", model))
    c.wait_engines_healthy()
    c.wait_workers_registered()
    for engine in c.engines:  # warm each engine directly, bypassing the router
        for doc in _documents(engine.worker_id):
            status, raw = http_post_json(engine.url + "/v1/chat/completions", _body(ENGINES[engine.worker_id], doc, "warm up"))
            assert status == 200, raw
    c.wait_audit_clean(timeout=20)
    hub = _hub_cache_with(CHAT_MODEL, tiny_model_dir, tmp_path_factory.mktemp("hf") / "hub")
    # A generous index deadline: on two shared cores a 20 ms query can time out and fail open.
    c.start_router("kv", "kv_aware", "--query-timeout-ms", "500", "--grpc-port", str(free_port()), env={"HF_HUB_CACHE": str(hub)})
    ready = c.router_urls["kv"] + "/ready"
    wait_until(
        lambda: (
            http_get(ready)[0] == 200 and all(json.loads(http_get(ready)[1])["models"].get(m) for m in ("tiny-llama", CHAT_MODEL))
        ),
        30,
        "the router knows both models' workers",
        c.all_processes(),
    )
    return c


def _body(model: str, document: str, question: str) -> dict:
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
    }


def _documents(worker_id: str) -> list[str]:
    return [long_text(10 * list(ENGINES).index(worker_id) + k, DOC_WORDS) for k in range(2)]


def test_each_model_is_routed_among_its_own_workers_to_its_cache(cluster: LocalCluster) -> None:
    router = cluster.router_urls["kv"]
    for engine in cluster.engines:
        model = ENGINES[engine.worker_id]
        own = {w for w, m in ENGINES.items() if m == model}
        for doc in _documents(engine.worker_id):
            body = _body(model, doc, "a different question about the same document")
            status, raw = http_post_json(router + "/v1/route", body)
            assert status == 200, raw
            decision = json.loads(raw)
            assert decision["worker_id"] == engine.worker_id and decision["fail_open"] is False, decision
            by_worker = {w["worker_id"]: w["cached_tokens"] for w in decision["workers"]}
            assert set(by_worker) == own, by_worker  # candidates: that model's workers only
            assert by_worker[engine.worker_id] >= DOC_WORDS - engine.block_size, by_worker

            status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
            assert status == 200, raw
            assert headers["x-kvroute-worker"] == engine.worker_id, (engine.worker_id, headers)
            answer = json.loads(raw)
            assert answer["model"] == model and answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, answer
    # The hit rate, as predicted and as the engines report it, per model.
    text = http_get(router + "/metrics")[1].decode()
    for name in ("kvroute_router_predicted_cached_tokens_total", "kvroute_router_engine_cached_tokens_total"):
        by_model = sums_by_label(text, name, "model")
        assert set(by_model) == {"tiny-llama", CHAT_MODEL} and min(by_model.values()) > 0, (name, by_model)


def test_the_grpc_route_api_routes_by_the_requests_model(cluster: LocalCluster) -> None:
    grpc_port = cluster.routers["kv"].wait_ports()["grpc"]  # --grpc-port was given: the router wrote it
    doc = _documents("chat-1")[0]

    async def route(model: str) -> pb.RouteResponse:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            return await pb_grpc.RouterStub(channel).Route(
                pb.RouteRequest(
                    model=model,
                    messages=pb.ChatMessages(
                        messages=[pb.ChatMessage(role="system", content=doc), pb.ChatMessage(role="user", content="q")]
                    ),
                ),
                timeout=10,
            )

    answer = asyncio.run(route(CHAT_MODEL))
    assert answer.worker_id in ("chat-0", "chat-1") and answer.cached_tokens > 0, answer
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(route("no-such-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in (err.value.details() or "")


def test_models_lists_both_and_an_unknown_model_is_openais_404(cluster: LocalCluster) -> None:
    router = cluster.router_urls["kv"]
    status, raw = http_get(router + "/v1/models")
    assert status == 200, raw
    assert [m["id"] for m in json.loads(raw)["data"]] == ["tiny-llama", CHAT_MODEL], raw

    status, raw = http_post_json(router + "/v1/chat/completions", _body("gpt-unknown", "hello", "hi"))
    assert status == 404, raw
    assert json.loads(raw) == {
        "error": {  # OpenAI's answer to a model it does not serve, word for word
            "message": "The model `gpt-unknown` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }

    status, raw = http_get(router + "/ready")
    ready = json.loads(raw)
    assert status == 200 and ready["models"] == {"tiny-llama": 2, CHAT_MODEL: 2} and ready["workers"] == 4, ready

    for model in ("tiny-llama", CHAT_MODEL):  # each model asked for (again): its tokenizer stays loaded, once
        assert http_post_json(router + "/v1/route", _body(model, "hello", "hi"))[0] == 200
    status, raw = http_get(router + "/metrics")
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples(raw.decode())}
    assert metrics[("kvroute_router_tokenizers_loaded", ())] == 2, raw
    for model in ("tiny-llama", CHAT_MODEL):  # each loaded once: at start (the default one), on its first request
        assert metrics[("kvroute_router_tokenizer_loads_total", (("model", model),))] == 1


def test_static_workers_name_their_model(cluster: LocalCluster) -> None:
    """A router that never reached its control plane routes on its --static-workers: each entry serves
    the model it names (ID@MODEL=URL), else the default one."""
    url_of = {e.worker_id: e.url for e in cluster.engines}
    router = cluster.start_router(
        "static",
        "round_robin",
        "--control-plane",
        f"127.0.0.1:{free_port()}",
        "--static-workers",
        f"llama-0={url_of['llama-0']},chat-1@{CHAT_MODEL}={url_of['chat-1']}",
        "--health-check-interval-s",
        "0",
    )
    for model, worker in (("tiny-llama", "llama-0"), (CHAT_MODEL, "chat-1"), ("tiny-llama", "llama-0")):
        status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", _body(model, "hello", "hi"))
        assert status == 200 and headers["x-kvroute-worker"] == worker, (model, headers, raw)
    status, raw = http_get(router + "/v1/models")
    assert [m["id"] for m in json.loads(raw)["data"]] == ["tiny-llama", CHAT_MODEL], raw
    status, raw = http_post_json(router + "/v1/chat/completions", _body("gpt-unknown", "hello", "hi"))
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found", raw


def test_the_endpoint_picker_routes_by_the_requests_model(cluster: LocalCluster, tiny_model_dir: Path) -> None:
    picker = cluster.start_epp(
        "many", "kv_aware", "--query-timeout-ms", "500", "--model-tokenizer", f"{CHAT_MODEL}={tiny_model_dir}"
    )
    # Open for connections before its view of the fleet has synced: until then it has no worker to pick.
    wait_until(lambda: grpc_health_serving(picker, "readiness"), 30, "epp ready", cluster.all_processes())

    async def pick(body: dict):
        async with grpc.aio.insecure_channel(picker) as channel:
            stream = EnvoyExtProcStream(ext_grpc.ExternalProcessorStub(channel), "streamed")
            picked = await asyncio.wait_for(stream.request("/v1/chat/completions", json.dumps(body).encode()), 10)
            if not picked.status:
                await asyncio.wait_for(stream.close(), 10)
            return picked

    for engine in cluster.engines:
        body = _body(ENGINES[engine.worker_id], _documents(engine.worker_id)[1], "one more question")
        picked = asyncio.run(pick(body))
        assert picked.endpoint == engine.url.removeprefix("http://"), (engine.worker_id, picked)
    unknown = asyncio.run(pick(_body("gpt-unknown", "hello", "hi")))
    assert unknown.status == 404 and json.loads(unknown.error_body)["error"]["code"] == "model_not_found"


def test_serve_models_limits_a_router_to_the_models_it_names(cluster: LocalCluster) -> None:
    """--serve-models: a router that follows (or, --index remote, lists) only the default model's workers
    answers only for it; the other model the fleet serves is a 404 there."""
    for name, index in (("only-view", "local"), ("only-remote", "remote")):
        router = cluster.start_router(
            name, "kv_aware", "--query-timeout-ms", "500", "--index", index, "--serve-models", "tiny-llama"
        )
        wait_until(lambda router=router: http_get(router + "/ready")[0] == 200, 30, f"{name} ready", cluster.all_processes())
        status, raw = http_get(router + "/v1/models")
        assert [m["id"] for m in json.loads(raw)["data"]] == ["tiny-llama"], (name, raw)
        status, raw = http_post_json(router + "/v1/route", _body(CHAT_MODEL, "hello", "hi"))
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found", (name, raw)
        doc = _documents("llama-1")[0]
        status, raw = http_post_json(router + "/v1/route", _body("tiny-llama", doc, "another question"))
        decision = json.loads(raw)
        assert status == 200 and decision["worker_id"] == "llama-1" and not decision["fail_open"], (name, decision)
        assert {w["worker_id"] for w in decision["workers"]} == {"llama-0", "llama-1"}, (name, decision)
        cluster.stop_router(name)
