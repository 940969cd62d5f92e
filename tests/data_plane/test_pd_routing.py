"""The P/D router mode in-process over real sockets: a fake control plane listing workers with roles
and fake engines that answer each leg as told. Covers what the end-to-end test cannot provoke with
sim engines: a prefill answer without transfer parameters, a prefill's own 4xx (vLLM and SGLang), the
SGLang decode answer held until its prefill leg answered, a missing pool, and the in-flight state
left empty on every path."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.http.api import RouterHttpApi
from kvroute.data_plane.http.pd import PdRouting
from kvroute.data_plane.http.proxy import BackendProxy
from kvroute.data_plane.prepare.model_tokenizers import ModelTokenizers
from kvroute.data_plane.prepare.request_prep import RequestPreparer
from kvroute.data_plane.prepare.tokenization import load_tokenizer
from kvroute.data_plane.service.routing import Router
from kvroute.v1 import kvroute_pb2 as pb
from tests.data_plane.test_http import MODEL, PROMPT, FakeControlPlane, start_control_plane
from tests.helpers import eventually


@dataclass
class LegEngine:
    """Answers every request with `answer` (status, JSON), after `release` is set when there is one."""

    name: str
    answer: tuple[int, dict] = (200, {})
    release: asyncio.Event | None = None
    bodies: list[dict] = field(default_factory=list)
    answered: int = 0  # answers whose headers went out
    runner: web.AppRunner | None = None
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.release is not None:
            await self.release.wait()
        status, body = self.answer
        return web.json_response(body, status=status)

    async def _prepared(self, _request: web.Request, _response: web.StreamResponse) -> None:
        self.answered += 1

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.on_response_prepare.append(self._prepared)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


def completion(name: str, **extra) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": name}], **extra}


PARAMS = {"do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_engine_id": "p", "remote_host": "h"}


@pytest.fixture
async def fleet(tiny_model_dir):
    """`start(protocol, prefill engines, decode engines)` -> (router URL, router); everything stopped after."""
    started: list = []

    async def start(protocol: str, prefills: list[LegEngine], decodes: list[LegEngine]):
        cp = FakeControlPlane()
        for role, engines in (("prefill", prefills), ("decode", decodes)):
            for engine in engines:
                await engine.start()
                started.append(engine.runner)
                cp.workers.append(
                    pb.WorkerInfo(worker_id=engine.name, model=MODEL, engine="sim", block_size=16, endpoint=engine.url, role=role)
                )
        server, port = await start_control_plane(cp)
        client = ControlPlaneClient(f"127.0.0.1:{port}", query_timeout_s=0.5, refresh_interval_s=0.1)
        await client.refresh()
        client.start()
        inflight, health = RouterInflight(client.session), BackendHealth()
        router = Router(client, make_policy("kv_aware", seed=0), inflight, health)
        proxy = BackendProxy(inflight, health, router.metrics)
        preparer = RequestPreparer(ModelTokenizers.preloaded({MODEL: load_tokenizer(tiny_model_dir)}, MODEL), client, 4096)
        http = RouterHttpApi(router, proxy, preparer, pd=PdRouting(protocol, router, proxy))
        runner = web.AppRunner(http.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        started[:0] = [runner]
        started.append((client, server))
        return f"http://127.0.0.1:{runner.addresses[0][1]}", router

    yield start
    for item in started:
        if isinstance(item, tuple):
            await item[0].close()
            await item[1].stop(0)
        else:
            await item.cleanup()


async def post(url: str, body: dict) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def nothing_in_flight(router: Router) -> bool:
    return all(requests == 0 for requests, _ in router.inflight.snapshot().values())


async def test_vllm_skips_a_prefill_without_transfer_params_and_hands_the_params_on(fleet) -> None:
    bare = LegEngine("p0", (200, completion("p0", kv_transfer_params=None)))  # started without a KV connector
    good = LegEngine("p1", (200, completion("p1", kv_transfer_params=PARAMS)))
    decode = LegEngine("d0", (200, completion("decoded")))
    url, router = await fleet("vllm", [bare, good], [decode])
    for _ in range(3):  # whichever prefill worker is tried first, the answer goes through p1
        status, headers, answer = await post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "stream": False})
        assert status == 200 and answer["choices"][0]["text"] == "decoded", answer
        assert headers["x-kvroute-prefill-worker"] == "p1" and headers["x-kvroute-worker"] == "d0"
    assert decode.bodies[-1]["kv_transfer_params"] == PARAMS and decode.bodies[-1]["max_tokens"] == 7
    assert all(b["max_tokens"] == 1 and b["kv_transfer_params"]["do_remote_decode"] for b in good.bodies)
    assert nothing_in_flight(router)
    async with aiohttp.ClientSession() as session, session.get(url + "/ready") as resp:
        assert resp.status == 200 and (await resp.json())["pd"] == {"prefill_workers": 2, "decode_workers": 1}


async def test_vllm_every_prefill_without_params_is_one_clear_502(fleet) -> None:
    url, router = await fleet("vllm", [LegEngine("p0", (200, completion("p0")))], [LegEngine("d0")])
    status, _, answer = await post(url, {"model": MODEL, "prompt": PROMPT})
    assert status == 502 and answer["error"]["code"] == "backend_unavailable"
    assert "no prefill worker could serve the request" in answer["error"]["message"]
    assert nothing_in_flight(router)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_a_prefills_own_4xx_goes_to_the_client(fleet, protocol) -> None:
    refusal = (400, {"error": {"message": "prompt too long for this engine", "type": "BadRequestError"}})
    decode = LegEngine("d0", (200, completion("decoded")))
    url, router = await fleet(protocol, [LegEngine("p0", refusal)], [decode])
    status, headers, answer = await post(url, {"model": MODEL, "prompt": PROMPT})
    assert status == 400 and answer["error"]["message"] == "prompt too long for this engine", answer
    assert headers["x-kvroute-worker"] == "p0"
    assert decode.bodies == [] if protocol == "vllm" else len(decode.bodies) == 1  # SGLang sent both legs at once
    assert nothing_in_flight(router)


async def test_sglang_holds_the_decode_answer_until_the_prefill_answered(fleet) -> None:
    release = asyncio.Event()
    prefill = LegEngine("p0", (200, completion("p0")), release=release)
    decode = LegEngine("d0", (200, completion("decoded")))
    url, router = await fleet("sglang", [prefill], [decode])
    client = asyncio.create_task(post(url, {"model": MODEL, "prompt": PROMPT}))
    await eventually(lambda: decode.answered and prefill.bodies, what="the decode leg answered, the prefill is held")
    with pytest.raises(TimeoutError):  # the client gets nothing while the prefill leg has not answered
        await asyncio.wait_for(asyncio.shield(client), 0.3)
    assert not nothing_in_flight(router)
    release.set()
    status, headers, answer = await client
    assert status == 200 and answer["choices"][0]["text"] == "decoded"
    assert headers["x-kvroute-prefill-worker"] == "p0" and headers["x-kvroute-worker"] == "d0"
    assert prefill.bodies[0]["bootstrap_room"] == decode.bodies[0]["bootstrap_room"]
    assert (decode.bodies[0]["bootstrap_host"], decode.bodies[0]["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert nothing_in_flight(router)


async def test_a_missing_pool_is_a_503_naming_the_role(fleet) -> None:
    url, _ = await fleet("vllm", [LegEngine("p0", (200, completion("p0", kv_transfer_params=PARAMS)))], [])
    status, _, answer = await post(url, {"model": MODEL, "prompt": PROMPT})
    assert status == 503 and answer["error"]["code"] == "no_workers"
    assert "no decode worker" in answer["error"]["message"] and "--role decode" in answer["error"]["message"]
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/route", json={"model": MODEL, "prompt": PROMPT}) as resp,
    ):
        status, raw = resp.status, await resp.read()
    assert status == 503, raw
    assert json.loads(raw)["error"]["code"] == "no_workers"
    async with aiohttp.ClientSession() as session, session.get(url + "/ready") as resp:  # not ready without a pool
        ready = await resp.json()
        assert resp.status == 503 and ready["pd"] == {"prefill_workers": 1, "decode_workers": 0}, ready
        assert any("no decode worker" in problem for problem in ready["problems"]), ready
