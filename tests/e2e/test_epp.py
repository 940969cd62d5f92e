"""`kvroute epp` end to end (issue 18, item 2): an ext_proc client built from Envoy's published
protos (xds-protos) replays what Envoy sends, in buffered and streamed (FULL_DUPLEX_STREAMED) body
modes, against live pickers, a control plane, agents and sim engines. The picker's choice equals
`POST /v1/route`'s for the same request; the subset hint is honoured; no eligible endpoint is a
503; a sheddable request on a saturated fleet is a 429; the served endpoint is read back (the
in-flight entry moves there); gRPC health follows GAIE's services."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.tools.ext_proc_client import EnvoyExtProcStream, Picked
from kvroute.tools.local_cluster import (
    LocalCluster,
    free_port,
    grpc_health_serving,
    http_get,
    http_post_json,
    long_text,
    wait_until,
)

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def fleet(module_local_fleet) -> Iterator[tuple[LocalCluster, str, dict[str, str]]]:
    """Three engines whose caches hold different prefixes (warmed through a router), the router, and
    pickers: `main` (no router session, so nothing it holds changes the router's view), `session`
    (announces its in-flight requests like a router), `nothing` (its model has no worker, and it knows no
    other: its control plane is a port where nothing listens) and
    `shedding` (sheddable objective "batch" at load 1)."""
    cluster: LocalCluster = module_local_fleet("epp")
    cluster.start_sim_fleet(3)
    patient = ("--query-timeout-ms", "500")  # on a busy test host a 5 ms query deadline fails open now and then
    url = cluster.start_router("r", "kv_aware", *patient)
    main_metrics, nothing_metrics = free_port(), free_port()
    epps = {
        "main": cluster.start_epp("main", "kv_aware", "--no-router-session", "--metrics-port", str(main_metrics), *patient),
        "main-metrics": f"http://127.0.0.1:{main_metrics}",
        "session": cluster.start_epp("session", "kv_aware", *patient),
        "nothing": cluster.start_epp(
            "nothing",
            "kv_aware",
            "--model",
            "nothing-served",
            "--metrics-port",
            str(nothing_metrics),
            "--control-plane",
            f"127.0.0.1:{free_port()}",
        ),
        "nothing-metrics": f"http://127.0.0.1:{nothing_metrics}",
        "shedding": cluster.start_epp(
            "shedding", "kv_aware", "--no-router-session", "--sheddable-objectives", "batch", "--saturation-load", "1"
        ),
    }
    for seed in range(6):  # different system prompts end up cached on different engines
        status, raw = http_post_json(url + "/v1/completions", {"model": MODEL, "prompt": long_text(seed, 200), "max_tokens": 2})
        assert status == 200, raw
    wait_until(lambda: quiet(url), 15, "the engines idle and the index holding the warm-up prompts")
    # Every process refreshes its fleet view (cached blocks per worker: the kv_aware spread rule reads
    # them) each 0.5 s: let the router and the pickers see the same one.
    time.sleep(1.5)
    for name in ("main", "session", "shedding"):
        wait_until(lambda name=name: grpc_health_serving(epps[name], "readiness"), 15, f"epp {name} ready")
    yield cluster, url, epps


def quiet(url: str) -> bool:
    """Every warm-up prompt is in the index and no engine has a request."""
    for seed in range(6):
        status, raw = http_post_json(url + "/v1/route", {"model": MODEL, "prompt": long_text(seed, 200)})
        answer = json.loads(raw)
        if (
            status != 200
            or answer["fail_open"]
            or not max(w["cached_tokens"] for w in answer["workers"])
            or any(w["running_requests"] or w["waiting_requests"] or w["inflight_requests"] for w in answer["workers"])
        ):
            return False
    return True


def route(url: str, path: str, body: dict) -> dict:
    status, raw = http_post_json(url + "/v1/route", body)
    assert status == 200, raw
    return json.loads(raw)


def host_port(endpoint: str) -> str:
    return endpoint.split("//", 1)[-1]


async def pick(
    address: str,
    path: str,
    body: bytes,
    mode: str,
    chunks: int = 1,
    subset: list[str] | None = None,
    headers: dict[str, str] | None = None,
    protocol_config: bool = False,
) -> Picked:
    """One request through the picker as Envoy sends it; the stream is closed after (the request is over).
    Buffered mode needs `protocol_config` (the pickers here default to streamed), as recent Envoy sends it."""
    async with grpc.aio.insecure_channel(address) as channel:
        stream = EnvoyExtProcStream(ext_grpc.ExternalProcessorStub(channel), mode, protocol_config or mode == "buffered")
        picked = await asyncio.wait_for(stream.request(path, body, headers=headers, chunks=chunks, subset=subset), 10)
        if not picked.status:
            await asyncio.wait_for(stream.close(), 10)
        return picked


def requests() -> list[tuple[str, dict]]:
    """Completions sharing the warm prefixes (so the index decides), new prompts, and chats."""
    out: list[tuple[str, dict]] = []
    for seed in range(6):
        out.append(("/v1/completions", {"model": MODEL, "prompt": long_text(seed, 200) + " and then some more", "max_tokens": 3}))
    for seed in (40, 41):
        out.append(("/v1/completions", {"model": MODEL, "prompt": long_text(seed, 150), "max_tokens": 3}))
    for seed in (1, 50):
        out.append(
            (
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "system", "content": long_text(seed, 120)}, {"role": "user", "content": "hi"}],
                },
            )
        )
    return out


@pytest.mark.parametrize(
    ("mode", "chunks", "protocol_config"), [("buffered", 1, True), ("streamed", 1, False), ("streamed", 4, True)]
)
def test_the_picker_chooses_what_v1_route_answers(fleet, mode: str, chunks: int, protocol_config: bool) -> None:
    _, url, epps = fleet
    chosen = set()
    for path, body in requests():
        raw = json.dumps(body).encode()
        answer = route(url, path, body)
        assert not answer["fail_open"]
        expected = host_port(answer["endpoint"])
        picked = asyncio.run(pick(epps["main"], path, raw, mode, chunks, protocol_config=protocol_config))
        assert picked.status == 0, picked.error_body
        assert picked.endpoint == picked.metadata_endpoint == expected, (path, body)
        chosen.add(expected)
        if mode == "streamed":  # Envoy forwards only the body the processor sends back in that mode
            assert picked.body == raw
            assert picked.headers["content-length"] == str(len(raw))
    assert len(chosen) > 1  # the warm-up spread prefixes: the index, not a single default, decided


def test_the_subset_hint_is_honoured_and_no_endpoint_is_a_503(fleet) -> None:
    cluster, url, epps = fleet
    body = {"model": MODEL, "prompt": long_text(2, 200), "max_tokens": 3}
    raw = json.dumps(body).encode()
    best = host_port(route(url, "/v1/completions", body)["endpoint"])
    others = [host_port(e.url) for e in cluster.engines if host_port(e.url) != best]
    for mode in ("buffered", "streamed"):
        only = asyncio.run(pick(epps["main"], "/v1/completions", raw, mode, 2, subset=[others[0]]))
        assert only.endpoint == only.metadata_endpoint == others[0]
        two = asyncio.run(pick(epps["main"], "/v1/completions", raw, mode, subset=others))
        assert two.endpoint in others
        anywhere = asyncio.run(pick(epps["main"], "/v1/completions", raw, mode, subset=[*others, best]))
        assert anywhere.endpoint == best
        for subset in ([], ["10.255.255.1:8000"]):
            refused = asyncio.run(pick(epps["main"], "/v1/completions", raw, mode, subset=subset))
            assert refused.status == 503 and json.loads(refused.error_body)["error"]["code"] == "no_workers"
    nothing = asyncio.run(
        pick(epps["nothing"], "/v1/completions", json.dumps({**body, "model": "nothing-served"}).encode(), "streamed")
    )
    assert nothing.status == 503 and "no workers known" in json.loads(nothing.error_body)["error"]["message"]


def test_a_request_without_a_body_goes_to_a_known_worker(fleet) -> None:
    """e.g. GET /v1/models: decided from the request headers alone, on load."""
    cluster, _, epps = fleet

    async def models() -> Picked:
        async with grpc.aio.insecure_channel(epps["main"]) as channel:
            stream = EnvoyExtProcStream(ext_grpc.ExternalProcessorStub(channel), "streamed")
            picked = await asyncio.wait_for(stream.request("/v1/models", None), 10)
            await asyncio.wait_for(stream.close(), 10)
            return picked

    picked = asyncio.run(models())
    assert picked.status == 0 and picked.endpoint == picked.metadata_endpoint
    assert picked.endpoint in {host_port(e.url) for e in cluster.engines}


def test_bad_requests_are_answered_in_place(fleet) -> None:
    _, _, epps = fleet
    unknown = asyncio.run(pick(epps["main"], "/v1/completions", b'{"model": "other", "prompt": "x"}', "buffered"))
    assert unknown.status == 404 and json.loads(unknown.error_body)["error"]["code"] == "model_not_found"
    broken = asyncio.run(pick(epps["main"], "/v1/chat/completions", b'{"model": ', "streamed", 2))
    assert broken.status == 400 and json.loads(broken.error_body)["error"]["type"] == "invalid_request_error"


def test_a_sheddable_request_on_a_saturated_fleet_is_a_429(fleet) -> None:
    """At --saturation-load 1 a worker with one request in flight is saturated: hold one stream per
    engine open (the requests are in flight until Envoy ends their streams), then a request with
    the sheddable objective is shed and one without is not."""
    cluster, _, epps = fleet
    address = epps["shedding"]

    async def scenario() -> tuple[Picked, Picked, Picked]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = ext_grpc.ExternalProcessorStub(channel)
            held, seen = [], set()
            for seed in range(100, 130):  # until every engine has one
                stream = EnvoyExtProcStream(stub, "streamed")
                picked = await stream.request(
                    "/v1/completions", json.dumps({"model": MODEL, "prompt": long_text(seed, 60)}).encode()
                )
                if picked.endpoint in seen:
                    await stream.close()
                    continue
                held.append(stream)
                seen.add(picked.endpoint)
                if len(seen) == len(cluster.engines):
                    break
            body = json.dumps({"model": MODEL, "prompt": long_text(200, 60)}).encode()
            shed = await EnvoyExtProcStream(stub, "streamed").request(
                "/v1/completions", body, headers={"x-gateway-inference-objective": "batch"}
            )
            critical = await pick(address, "/v1/completions", body, "streamed", headers={"x-gateway-inference-objective": "chat"})
            for stream in held:
                await stream.close()
            after = await pick(address, "/v1/completions", body, "streamed", headers={"x-gateway-inference-objective": "batch"})
            return shed, critical, after

    shed, critical, after = asyncio.run(scenario())
    assert shed.status == 429 and json.loads(shed.error_body)["error"]["code"] == "overloaded"
    assert critical.status == 0 and critical.endpoint
    assert after.status == 0 and after.endpoint  # the held requests ended with their streams


def others_on(url: str, endpoint: str, what: str = "requests") -> int:
    """Other routers' (here: the session picker's) requests in flight on `endpoint` (or their pending
    prefill tokens: `what="prefill_tokens"`), as the router sees them."""
    status, raw = http_post_json(url + "/v1/route?explain=1", {"model": MODEL, "prompt": long_text(999, 40)})
    assert status == 200, raw
    answer = json.loads(raw)
    worker = {w["worker_id"]: host_port(w["endpoint"]) for w in answer["workers"]}
    return sum(
        w["index"][f"other_routers_{what}"]
        for w in answer["explain"]["workers"]
        if w["index"] and worker[w["worker_id"]] == endpoint
    )


def test_the_prefill_counts_until_the_response_starts(fleet) -> None:
    """With Envoy sending no response body (protocol_config response_body_mode NONE), the response
    headers end the request's pending prefill; the request stays in flight until the stream ends."""
    _, url, epps = fleet

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(epps["session"]) as channel:
            stream = EnvoyExtProcStream(ext_grpc.ExternalProcessorStub(channel), "streamed", send_protocol_config=True)
            picked = await stream.request(
                "/v1/completions", json.dumps({"model": MODEL, "prompt": long_text(77, 200), "max_tokens": 3}).encode()
            )
            chosen = picked.endpoint
            await asyncio.to_thread(
                wait_until, lambda: others_on(url, chosen, "prefill_tokens") > 100, 5, "the new prompt's prefill counted"
            )
            await stream.response(served=chosen)
            await asyncio.to_thread(
                wait_until,
                lambda: others_on(url, chosen, "prefill_tokens") == 0 and others_on(url, chosen) == 1,
                5,
                "the prefill done, the request still running",
            )
            await stream.close()
            await asyncio.to_thread(wait_until, lambda: others_on(url, chosen) == 0, 5, "the request over")

    asyncio.run(scenario())


def test_the_served_endpoint_is_read_back(fleet) -> None:
    """A picked request counts in flight where it was picked, moves where Envoy says it was served,
    and stops counting when Envoy ends the stream; other routers see all of it."""
    cluster, url, epps = fleet

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(epps["session"]) as channel:
            stream = EnvoyExtProcStream(ext_grpc.ExternalProcessorStub(channel), "streamed")
            picked = await stream.request(
                "/v1/completions", json.dumps({"model": MODEL, "prompt": long_text(3, 200), "max_tokens": 3}).encode()
            )
            chosen = picked.endpoint
            fallback = next(host_port(e.url) for e in cluster.engines if host_port(e.url) != chosen)
            await asyncio.to_thread(wait_until, lambda: others_on(url, chosen) == 1, 5, "the pick counted")
            await stream.response(served=fallback)  # Envoy retried on another endpoint
            await asyncio.to_thread(
                wait_until,
                lambda: others_on(url, fallback) == 1 and others_on(url, chosen) == 0,
                5,
                "the request counted where it was served",
            )
            await stream.close()
            await asyncio.to_thread(wait_until, lambda: others_on(url, fallback) == 0, 5, "the request over")

    asyncio.run(scenario())


def test_health_follows_gaie_services(fleet) -> None:
    _, _, epps = fleet
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert grpc_health_serving(epps["main"], service), service
    # A picker that knows no worker of any model is alive but not ready.
    assert grpc_health_serving(epps["nothing"], "liveness")
    assert not grpc_health_serving(epps["nothing"], "readiness")
    assert not grpc_health_serving(epps["nothing"], "envoy.service.ext_proc.v3.ExternalProcessor")
    # --metrics-port: the router's /metrics, /health and /ready
    asyncio.run(pick(epps["main"], "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode(), "streamed"))
    assert http_get(epps["main-metrics"] + "/ready")[0] == 200
    status, body = http_get(epps["nothing-metrics"] + "/ready")
    assert status == 503 and "nothing-served" in body.decode()
    status, body = http_get(epps["main-metrics"] + "/metrics")
    decisions = [line for line in body.decode().splitlines() if line.startswith("kvroute_router_decision_seconds_count")]
    assert status == 200 and decisions and float(decisions[0].split()[-1]) > 0
