"""A mixed fleet end to end: three engines of different kinds and block sizes behind one control
plane and one kv_aware router, every plane its own process over real sockets.

vLLM 0.24 (16-token blocks, ZMQ, old replay framing), SGLang 0.5.22 (32-token pages, ZMQ, new
framing) and TensorRT-LLM's pull path (64-token blocks, POST /kv_cache_events), each with its own
agent. Each engine is warmed directly with documents of its own; once the audit finds the control
plane agreeing with all three, requests through the router's OpenAI API that extend a document
must be served by the engine that cached it (`x-kvroute-worker`), and that engine's own counter
must report the hit. The router hashes each prompt once per block size in the fleet, so each
engine is matched at its own block size.
"""

from __future__ import annotations

import json

import pytest

from kvroute.tools.local_cluster import LocalCluster, http_post_json, http_post_json_headers, long_text

FLEET = (("vllm", "vllm-0.24", 16), ("sglang", "sglang-0.5.22", 32), ("trtllm", "trtllm-pull", 64))
DOC_WORDS = 600  # ~610 prompt tokens: 9 blocks of 64, 19 of 32, 38 of 16
DOCS_PER_ENGINE = 2


@pytest.fixture(scope="module")
def cluster(module_local_fleet):
    c = module_local_fleet("mixed-fleet")
    c.start_control_plane()
    for name, dialect, block_size in FLEET:
        c.add_sim_engine(name, "--num-blocks", "512", "--speedup", "50", dialect=dialect, block_size=block_size)
    c.wait_engines_healthy()
    c.wait_workers_registered()
    # A generous index deadline: on two shared cores a 20 ms query can time out and fail open.
    c.start_router("kv", "kv_aware", "--query-timeout-ms", "500", ready=True)
    return c


def documents(engine_index: int) -> list[str]:
    return [long_text(10 * engine_index + k, DOC_WORDS) for k in range(DOCS_PER_ENGINE)]


def test_each_request_goes_to_the_engine_holding_its_prefix(cluster: LocalCluster) -> None:
    assert sorted({e.block_size for e in cluster.engines}) == [16, 32, 64]
    for i, engine in enumerate(cluster.engines):  # warm each engine directly, bypassing the router
        for doc in documents(i):
            status, raw = http_post_json(engine.url + "/v1/chat/completions", cluster.chat_request(doc, "warm up"))
            assert status == 200, raw

    cluster.wait_audit_clean(timeout=20)
    cached = {w.worker_id: w.cached_blocks for w in cluster.list_workers()}
    for engine in cluster.engines:  # the index holds every document's blocks at the engine's own block size
        assert cached[engine.worker_id] >= DOCS_PER_ENGINE * (DOC_WORDS // engine.block_size), cached

    router = cluster.router_urls["kv"]
    for i, engine in enumerate(cluster.engines):
        for doc in documents(i):
            body = cluster.chat_request(doc, "a different question about the same document")
            status, raw = http_post_json(router + "/v1/route", body)
            assert status == 200, raw
            decision = json.loads(raw)
            assert decision["worker_id"] == engine.worker_id and decision["fail_open"] is False, decision
            by_worker = {w["worker_id"]: w["cached_tokens"] for w in decision["workers"]}
            assert set(by_worker) == {e.worker_id for e in cluster.engines}
            assert all(tokens == 0 for worker, tokens in by_worker.items() if worker != engine.worker_id), by_worker
            # Matched on this engine's chain: whole blocks of its size, nearly the whole document.
            assert by_worker[engine.worker_id] % engine.block_size == 0
            assert by_worker[engine.worker_id] >= DOC_WORDS - engine.block_size, by_worker

            status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
            assert status == 200, raw
            assert headers["x-kvroute-worker"] == engine.worker_id, (engine.worker_id, headers)
            # The engine's own prefix-cache hit agrees with the router's expectation.
            hit = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hit >= by_worker[engine.worker_id], (hit, by_worker)

    # The routed requests cached more blocks; the control plane follows every engine exactly.
    audit = cluster.wait_audit_clean(timeout=2)
    assert {a.worker_id for a in audit.audits} == {"vllm", "sglang", "trtllm"}
    assert all(a.tiers["gpu"].engine_blocks > 0 for a in audit.audits)
