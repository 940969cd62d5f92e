"""The gRPC application path (issue 18, item 6), over live processes: two application clients call
`Router/Route` with `reserve` on two routers and send nothing through them. Reserved decisions
count as load in the other router's next decisions (through the control plane), a released or
expired reservation stops counting; chat content parts and tools render as the HTTP path renders
them; reflection lists the services."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvroute.prom_text import sample_sums, sample_value
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_ok, http_post_json, long_text, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def fleet(module_local_fleet) -> Iterator[tuple[LocalCluster, dict[str, pb_grpc.RouterStub], dict[str, str], dict[str, int]]]:
    cluster: LocalCluster = module_local_fleet("grpc-app")
    cluster.start_control_plane()
    cluster.start_sim_fleet(3)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(3)
    stubs, urls, channels, ports = {}, {}, [], {}
    for name in ("a", "b"):
        port = free_port()
        ports[name] = port
        urls[name] = cluster.start_router(name, "kv_aware", "--grpc-port", str(port), "--reservation-ttl-ms", "30000")
        wait_until(lambda u=urls[name]: http_ok(u + "/ready"), 10, f"router {name} ready")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        stubs[name] = pb_grpc.RouterStub(channel)
    yield cluster, stubs, urls, ports
    for channel in channels:
        channel.close()


def others_on(stub: pb_grpc.RouterStub, worker_id: str) -> int:
    """Other routers' reservations on `worker_id`, as this router's next decision sees them."""
    answer = stub.Route(pb.RouteRequest(model="tiny-llama", prompt=long_text(999, 40), explain=True), timeout=5)
    for w in answer.explanation.workers:
        if w.worker_id == worker_id:
            return w.index.other_routers_requests
    raise AssertionError(f"{worker_id} not among the candidates")


def test_reservations_count_on_the_other_router_until_released(fleet) -> None:
    _, stubs, _, _ = fleet
    held = [
        stubs["a"].Route(pb.RouteRequest(model="tiny-llama", prompt=long_text(1, 300), reserve=True), timeout=5) for _ in range(3)
    ]
    assert all(r.reservation_id for r in held) and len({r.reservation_id for r in held}) == 3
    assert held[0].reservation_ttl_ms == 30000
    worker = held[0].worker_id
    expected = sum(1 for r in held if r.worker_id == worker)
    wait_until(lambda: others_on(stubs["b"], worker) == expected, 5, "router b counting router a's reservations")
    # The second application client, on router b: router a sees its reservation too.
    theirs = stubs["b"].Route(pb.RouteRequest(model="tiny-llama", prompt=long_text(2, 300), reserve=True), timeout=5)
    wait_until(lambda: others_on(stubs["a"], theirs.worker_id) >= 1, 5, "router a counting router b's reservation")

    first = stubs["a"].PrefillDone(pb.ReservationRef(reservation_id=held[0].reservation_id), timeout=5)
    assert first.was_held
    for r in held:
        state = stubs["a"].Release(
            pb.ReleaseRequest(reservation_id=r.reservation_id, outcome=pb.REQUEST_OUTCOME_COMPLETED), timeout=5
        )
        assert state.was_held
    wait_until(lambda: others_on(stubs["b"], worker) == 0, 5, "router a's released reservations gone from router b's view")
    again = stubs["a"].Release(pb.ReleaseRequest(reservation_id=held[0].reservation_id), timeout=5)
    assert not again.was_held  # releasing twice is harmless
    stubs["b"].Release(pb.ReleaseRequest(reservation_id=theirs.reservation_id), timeout=5)
    with pytest.raises(grpc.RpcError) as never:
        stubs["a"].Release(pb.ReleaseRequest(reservation_id=theirs.reservation_id + 10**6), timeout=5)
    assert never.value.code() == grpc.StatusCode.NOT_FOUND and "not issued by this router" in never.value.details()


def test_an_unreleased_reservation_expires(fleet) -> None:
    _, stubs, urls, _ = fleet
    r = stubs["a"].Route(
        pb.RouteRequest(model="tiny-llama", prompt=long_text(3, 300), reserve=True, reservation_ttl_ms=700), timeout=5
    )
    assert r.reservation_ttl_ms == 700
    wait_until(lambda: others_on(stubs["b"], r.worker_id) >= 1, 5, "router b counting the reservation")
    wait_until(lambda: others_on(stubs["b"], r.worker_id) == 0, 5, "the reservation gone after its TTL")
    status, body = http_get(urls["a"] + "/metrics")
    assert status == 200
    sums = sample_sums(body.decode(), {"kvroute_router_reservations_total", "kvroute_router_reservations_held"})
    assert sums["kvroute_router_reservations_held"] == 0
    assert (sample_value(body.decode(), "kvroute_router_reservations_total", {"event": "expired"}) or 0) > 0
    assert not stubs["a"].Release(pb.ReleaseRequest(reservation_id=r.reservation_id), timeout=5).was_held


def test_content_parts_and_tools_render_as_the_http_path_renders_them(fleet) -> None:
    _, stubs, urls, _ = fleet
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    body = {
        "model": "tiny-llama",
        "tools": [tool],
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Briefly."}]},
        ],
    }
    status, raw = http_post_json(urls["a"] + "/v1/route", body)
    assert status == 200, raw
    http_tokens = json.loads(raw)["prompt_tokens"]
    request = pb.RouteRequest(
        model="tiny-llama",
        messages=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="system", content="You are terse."),
                pb.ChatMessage(
                    role="user",
                    parts=[pb.ContentPart(type="text", text="Weather in Paris?"), pb.ContentPart(type="text", text="Briefly.")],
                ),
            ]
        ),
        tools=[
            pb.ToolDefinition(
                name="get_weather", description="Weather in a city", parameters_json=json.dumps(tool["function"]["parameters"])
            )
        ],
    )
    assert stubs["a"].Route(request, timeout=5).prompt_tokens == http_tokens
    without_tools = pb.RouteRequest(model="tiny-llama", messages=request.messages)
    assert stubs["a"].Route(without_tools, timeout=5).prompt_tokens < http_tokens  # the tools were rendered
    bad = pb.RouteRequest(
        model="tiny-llama", messages=request.messages, tools=[pb.ToolDefinition(name="t", parameters_json="{not json")]
    )
    with pytest.raises(grpc.RpcError) as invalid:
        stubs["a"].Route(bad, timeout=5)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parameters_json" in invalid.value.details()


def test_reflection_lists_the_router_service(fleet) -> None:
    _, _, _, ports = fleet
    with grpc.insecure_channel(f"127.0.0.1:{ports['a']}") as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "kvroute.v1.Router" in services and "grpc.health.v1.Health" in services
