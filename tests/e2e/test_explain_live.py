"""Explaining a decision on a live fleet (issue 18, item 5): POST /v1/route?explain=1 and the gRPC
`Route` with `explain` take the same decision apart the same way, and the index's view shows the
prefix that an earlier request left in the chosen engine's cache."""

from __future__ import annotations

import json

import grpc
from google.protobuf.json_format import MessageToDict

from kvroute.tools.local_cluster import LocalCluster, free_port, http_ok, http_post_json, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

SYSTEM = " ".join(["You answer questions about the block cache of the worker model."] * 30)


def test_explain_over_http_and_grpc(local_fleet) -> None:
    cluster: LocalCluster = local_fleet("explain")
    cluster.start_control_plane()
    cluster.start_sim_fleet(3)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(3)
    grpc_port = free_port()
    url = cluster.start_router("r", "kv_aware", "--grpc-port", str(grpc_port))
    wait_until(lambda: http_ok(url + "/ready"), 10, "the router ready (its fleet known)")

    body = cluster.chat_request(SYSTEM, "What is a block?")
    status, served = http_post_json(url + "/v1/chat/completions", body)
    assert status == 200, served

    def explained() -> dict | None:
        status, raw = http_post_json(url + "/v1/route?explain=1", body)
        assert status == 200, raw
        answer = json.loads(raw)
        return answer if answer["cached_tokens"] > 0 else None

    answer = wait_until(explained, 10, "the first request's prefix in the index")
    why = answer["explain"]
    assert why["policy"] == "kv_aware" and why["fail_open"] is False and answer["worker_id"] in why["reason"]
    assert len(why["workers"]) == 3
    by_id = {w["worker_id"]: w for w in why["workers"]}
    chosen = by_id[answer["worker_id"]]
    assert chosen["index"]["matched_tokens"] >= answer["cached_tokens"] > 0  # the index's match, before capping
    assert chosen["terms"]["uncached_prefill"] == answer["prompt_tokens"] - answer["cached_tokens"]
    for w in why["workers"]:
        assert abs(sum(w["terms"].values()) - w["cost"]) < 1e-6
        assert w["cost"] >= chosen["cost"] or w["within_load_bound"] is False
    assert why["params"]["load_bound"] == 1.25

    # Without ?explain the answer carries no explanation: the request path pays nothing for it.
    status, raw = http_post_json(url + "/v1/route", body)
    assert status == 200 and "explain" not in json.loads(raw)

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.RouterStub(channel)
        messages = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in body["messages"]])
        plain = stub.Route(pb.RouteRequest(model=cluster.model, messages=messages), timeout=5)
        assert not plain.HasField("explanation")
        routed = stub.Route(pb.RouteRequest(model=cluster.model, messages=messages, explain=True), timeout=5)
    assert routed.worker_id == answer["worker_id"] and routed.explanation.reason == why["reason"]
    grpc_workers = {w.worker_id: w for w in routed.explanation.workers}
    for wid, w in by_id.items():
        g = grpc_workers[wid]
        assert dict(g.terms) == w["terms"] and g.cost == w["cost"]
        assert MessageToDict(g.index, preserving_proto_field_name=True, always_print_fields_with_no_presence=True) == w["index"]
