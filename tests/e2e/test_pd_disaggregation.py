"""Prefill/decode disaggregation end to end, once per engine protocol (vLLM's kv_transfer_params,
SGLang's bootstrap fields): a control plane, two prefill and two decode sim engines (each with its
agent, registering its role) and a router in P/D mode, every one its own process over real sockets.

Requests succeed streamed and not; the prefill worker is chosen on the index (a repeated prefix
lands on the prefill worker that holds it) among prefill workers only; the decode worker gets what
the prefill leg handed over (the sim's `x-sim-kv-transfer` names its source and block count); a
killed engine on either leg is retried on another worker, with every leg dead the client gets one
502 that names the leg, and nothing is left in flight.
"""

from __future__ import annotations

import json

import pytest

from kvroute.tools.local_cluster import LocalCluster, http_get, http_post_json, http_post_json_headers, long_text, wait_until

PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")
BOOTSTRAP_PORTS = {"prefill-0": 9101, "prefill-1": 9102}  # SGLang: per-worker bootstrap ports, as the router is told
DOC_WORDS = 300


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def fleet(request, module_local_fleet) -> tuple[LocalCluster, str, str]:
    protocol = request.param
    c = module_local_fleet(f"pd-{protocol}")
    c.start_control_plane()
    dialect = "sglang-0.5.22" if protocol == "sglang" else None
    for worker_id in PREFILL + DECODE:
        role = worker_id.split("-")[0]
        c.add_sim_engine(
            worker_id,
            "--role",
            role,
            "--pd-protocol",
            protocol,
            "--speedup",
            "20",
            "--num-blocks",
            "512",
            dialect=dialect,
            agent_args=("--role", role),
        )
    c.wait_engines_healthy()
    c.wait_workers_registered()
    ports = ",".join(f"{w}={p}" for w, p in BOOTSTRAP_PORTS.items())
    router = c.start_router(
        "pd",
        "kv_aware",
        "--pd",
        protocol,
        "--query-timeout-ms",
        "500",
        *(("--pd-bootstrap-port", ports) if protocol == "sglang" else ()),
    )
    wait_until(lambda: http_get(router + "/ready")[0] == 200, 30, "router ready", c.all_processes())
    return c, protocol, router


def engine(cluster: LocalCluster, worker_id: str):
    return next(e for e in cluster.engines if e.worker_id == worker_id)


def route(router: str, body: dict) -> dict:
    status, raw = http_post_json(router + "/v1/route", body)
    assert status == 200, raw
    return json.loads(raw)


def check_transfer(cluster: LocalCluster, protocol: str, headers: dict[str, str], prompt_tokens: int) -> None:
    """The decode leg received the prefill worker's KV: from it, all of the prompt's full blocks."""
    prefill = headers["x-kvroute-prefill-worker"]
    assert prefill in PREFILL and headers["x-kvroute-worker"] in DECODE, headers
    fields = dict(part.split("=", 1) for part in headers["x-sim-kv-transfer"].split(";"))
    assert int(fields["blocks"]) == prompt_tokens // cluster.block_size > 0, (fields, prompt_tokens)
    if protocol == "vllm":  # the kv_transfer_params the prefill leg returned: its engine id names its port
        assert fields["from"] == "sim-" + engine(cluster, prefill).url.removeprefix("http://"), fields
    else:  # the bootstrap host and port of the prefill worker the router chose, and a room
        assert fields["from"] == f"127.0.0.1:{BOOTSTRAP_PORTS[prefill]}", fields
        assert 0 <= int(fields["room"]) < 2**63, fields


def test_requests_succeed_streamed_and_not(fleet) -> None:
    cluster, protocol, router = fleet
    body = cluster.chat_request(long_text(1, DOC_WORDS), "summarise", max_tokens=5)
    status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 5, answer  # the decode worker's whole answer, not the prefill's
    check_transfer(cluster, protocol, headers, answer["usage"]["prompt_tokens"])

    status, headers, raw = http_post_json_headers(
        router + "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200, raw
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-200:]
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 5
    check_transfer(cluster, protocol, headers, usage["prompt_tokens"])

    legs = {w: json.loads(http_get(engine(cluster, w).url + "/kvroute/pd")[1]) for w in PREFILL + DECODE}
    assert sum(legs[w]["prefill_legs"] for w in PREFILL) == 2 and sum(legs[w]["decode_legs"] for w in DECODE) == 2
    assert all(legs[w]["decode_legs"] == 0 for w in PREFILL) and all(legs[w]["prefill_legs"] == 0 for w in DECODE)


def test_a_repeated_prefix_lands_on_the_prefill_worker_holding_it(fleet) -> None:
    cluster, _, router = fleet
    chosen = {}
    for doc in range(10, 14):
        body = cluster.chat_request(long_text(doc, DOC_WORDS), "first question")
        status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
        assert status == 200, raw
        chosen[doc] = headers["x-kvroute-prefill-worker"]
        # The prefill worker's KV events reach the index: the router now expects the prefix there.
        follow_up = cluster.chat_request(long_text(doc, DOC_WORDS), "another question")
        wait_until(
            lambda body=follow_up: route(router, body)["cached_tokens"] >= DOC_WORDS // 2,
            20,
            f"doc {doc} indexed on {chosen[doc]}",
            cluster.all_processes(),
        )
        decision = route(router, follow_up)
        assert decision["pd"]["prefill_worker_id"] == chosen[doc], decision
        assert {w["worker_id"] for w in decision["workers"]} == set(PREFILL), decision  # prefill workers only
        for question in ("another question", "a third question"):
            status, headers, raw = http_post_json_headers(
                router + "/v1/chat/completions", cluster.chat_request(long_text(doc, DOC_WORDS), question)
            )
            assert status == 200, raw
            assert headers["x-kvroute-prefill-worker"] == chosen[doc], (doc, chosen, headers)


def nothing_in_flight(router: str, body: dict) -> bool:
    decision = route(router, body)
    workers = decision["workers"] + decision["pd"]["decode_workers"]
    return all(w["inflight_requests"] == 0 for w in workers)


def test_a_killed_leg_is_retried_and_all_dead_is_one_clear_error(fleet) -> None:
    cluster, _, router = fleet
    body = cluster.chat_request(long_text(20, DOC_WORDS), "question")
    status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
    assert status == 200, raw
    preferred = headers["x-kvroute-prefill-worker"]
    wait_until(
        lambda: route(router, body)["pd"]["prefill_worker_id"] == preferred and route(router, body)["cached_tokens"] > 0,
        20,
        "prefix indexed",
        cluster.all_processes(),
    )

    engine(cluster, preferred).engine.kill()  # its agent still registers it: the router finds out by trying
    engine(cluster, "decode-0").engine.kill()
    for question in ("q1", "q2", "q3", "q4"):
        status, headers, raw = http_post_json_headers(
            router + "/v1/chat/completions", cluster.chat_request(long_text(20, DOC_WORDS), question)
        )
        assert status == 200, raw
        assert headers["x-kvroute-prefill-worker"] != preferred and headers["x-kvroute-worker"] == "decode-1", headers
    wait_until(lambda: nothing_in_flight(router, body), 10, "no request in flight", cluster.all_processes())

    for worker_id in PREFILL:
        if worker_id != preferred:
            engine(cluster, worker_id).engine.kill()
    status, headers, raw = http_post_json_headers(router + "/v1/chat/completions", body)
    assert status == 502, raw
    error = json.loads(raw)["error"]
    assert error["code"] == "backend_unavailable" and "no prefill worker could serve the request" in error["message"]
    wait_until(lambda: nothing_in_flight(router, body), 10, "no request in flight", cluster.all_processes())
