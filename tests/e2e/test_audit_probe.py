"""Probe audit (`kvroute audit --probe`): engines that do not publish their block set are audited by a
random prompt sent twice and the engine's own prefix-cache counters. Against real sim-engine
processes: a vLLM-dialect engine whose agent advertises it through an HTTP front that hides
`GET /kvroute/blocks` (as a real vLLM answers 404), and an SGLang-dialect engine; then lying fake
agents, an engine that drops its cache silently, and the control plane's own periodic probe."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import aiohttp
import grpc
import pytest
from aiohttp import web

from kvroute.control_plane import audit as audit_module
from kvroute.control_plane.audit import PROBE_BLOCKS, Prober, ProbeTarget, WorkerAudit, probe_target
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_post_json, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import FakeAgent, run_audit

BLOCK_SIZE = 16  # FakeAgent registers this block size
PROBE_HIT = PROBE_BLOCKS * BLOCK_SIZE


# ---------------------------------------------------------------- without processes


async def test_trtllm_is_not_probed_and_its_metrics_are_not_read() -> None:
    """Reading trtllm-serve's /metrics would drain the iteration stats its agent needs."""

    async def held(keys: list[int]) -> int:
        raise AssertionError("a TensorRT-LLM worker must not be probed")

    async with aiohttp.ClientSession() as http:
        # Nothing listens on the endpoint: any request there would make this an error, not not_auditable.
        target = ProbeTarget("trt-0", f"http://127.0.0.1:{free_port()}", BLOCK_SIZE, "tiny-llama", "trtllm", None, held)
        audit = await Prober(http, force=True).audit(target)
    assert audit.status == "not_auditable" and audit.kind == "probe" and "TensorRT-LLM" in audit.detail


# ---------------------------------------------------------------- against processes


class BlindFront:
    """An HTTP front for one engine, in a thread of this process: forwards every request, except that
    `GET /kvroute/blocks` answers 404 like a real vLLM. Its agent advertises the front as the endpoint."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="blind-front", daemon=True)
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.Response:
        if request.path == "/kvroute/blocks":
            return web.json_response({"detail": "Not Found"}, status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-data-parallel-rank")}
        async with self._http.request(
            request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers
        ) as response:
            body = await response.read()
            return web.Response(
                body=body, status=response.status, headers={"Content-Type": response.headers.get("Content-Type", "text/plain")}
            )

    async def _start(self) -> None:
        self._http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._http.close()

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@dataclasses.dataclass
class Fleet:
    cluster: LocalCluster
    front: BlindFront
    blind: str  # worker id of the vLLM-dialect engine behind the front
    sglang: str  # worker id of the SGLang-dialect engine (serves its block set)
    engine_url: str  # the blind engine's own address


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    c = LocalCluster(
        workdir=tmp_path_factory.mktemp("audit-probe"),
        tokenizer_dir=tiny_model_dir,
        heartbeat_timeout_s=30,
        block_size=BLOCK_SIZE,
    )
    front = None
    try:
        c.start_control_plane()
        blind = c.add_sim_engine("vllm-blind", "--speedup", "50", start_agent=False)
        c.add_sim_engine("sglang-0", "--speedup", "50", dialect="sglang-0.5.9")
        c.wait_engines_healthy()
        front = BlindFront(blind.url)
        front.start()
        blind.agent = c.start_agent(dataclasses.replace(blind, url=front.url))
        c.wait_workers_registered()
        for handle in c.engines:  # some traffic first, so the probe is not alone in the caches
            for i in range(3):
                prompt = [50 * (i + 1) + t for t in range(5 * BLOCK_SIZE + 7)]
                status, body = http_post_json(handle.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
                assert status == 200, body
        yield Fleet(c, front, "vllm-blind", "sglang-0", blind.url)
    finally:
        c.stop()
        if front is not None:
            front.stop()


def workers_by_id(result: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for w in result["workers"]}


def assert_clean_probe(worker: dict) -> None:
    assert worker["status"] == "ok" and worker["kind"] == "probe" and worker["divergence"] == 0, worker
    probe = worker["probe"]
    assert probe["events_arrived"] and probe["control_plane_blocks"] == probe["probe_blocks"] == PROBE_BLOCKS, probe
    assert probe["predicted_hit_tokens"] == probe["engine_hit_tokens"] == PROBE_HIT, probe
    assert probe["source"] == "metrics", probe  # the counters, not the response's cached_tokens


async def test_probe_audits_engines_without_a_block_set_and_finds_no_divergence(fleet: Fleet) -> None:
    code, result, output = await run_audit(fleet.cluster, "--probe")
    assert code == 0, output
    workers = workers_by_id(result)
    assert_clean_probe(workers[fleet.blind])
    # The SGLang-dialect engine serves its block set: compared by it, not probed.
    assert workers[fleet.sglang]["kind"] == "block_set" and workers[fleet.sglang]["status"] == "ok", output
    assert result["divergence"] == 0 and result["audited"] == 2 and result["probed"] == 1, result
    assert "probe: the control plane predicts a 128-token hit, the engine hit 128" in output
    # Without --probe the blind engine is not auditable, as before.
    code, result, output = await run_audit(fleet.cluster, "--json")
    assert code == 0 and workers_by_id(result)[fleet.blind]["status"] == "not_auditable", output


async def test_force_probe_reads_sglang_counters_too(fleet: Fleet) -> None:
    code, result, output = await run_audit(fleet.cluster, "--force-probe", "--json")
    assert code == 0, output
    workers = workers_by_id(result)
    assert_clean_probe(workers[fleet.blind])
    assert_clean_probe(workers[fleet.sglang])
    assert result["probed"] == 2


async def test_probe_finds_a_worker_whose_events_never_reach_the_control_plane(fleet: Fleet) -> None:
    """A fake agent registers "liar" at the blind engine's address and claims blocks it does not have;
    no events of that engine ever reach the control plane under its id."""
    liar = FakeAgent(fleet.cluster.control_plane_addr)
    try:
        await liar.claim("liar", fleet.front.url, {"gpu": [11, 12, 13]})
        code, result, output = await run_audit(
            fleet.cluster, "--probe", "--worker", "liar", "--worker", fleet.blind, "--probe-deadline-s", "1"
        )
        assert code == 1, output
        workers = workers_by_id(result)
        worker = workers["liar"]
        assert worker["kind"] == "probe" and worker["divergence"] == PROBE_BLOCKS == result["divergence"], worker
        assert worker["probe"]["missing"] == PROBE_BLOCKS and worker["probe"]["extra"] == 0, worker
        assert worker["probe"]["predicted_hit_tokens"] == 0 and worker["probe"]["engine_hit_tokens"] == PROBE_HIT
        assert worker["detail"].startswith(f"events did not arrive: 0 of {PROBE_BLOCKS} blocks after 1."), worker
        # The honest worker at the same endpoint, probed one after the other (one probe per endpoint at a
        # time, so neither counts the other's requests), is clean.
        assert_clean_probe(workers[fleet.blind])
    finally:
        await liar.close()


class DroppingProber(Prober):
    """Before the probe's second send, the engine loses its cache without any event (as a restarted
    engine's is lost): the control plane still holds the probe's blocks."""

    def __init__(self, http, engine_url: str, **kwargs) -> None:
        super().__init__(http, **kwargs)
        self.engine_url = engine_url
        self.sends = 0

    async def _send(self, target: ProbeTarget, prompt: list[int]) -> int | None:
        self.sends += 1
        if self.sends == 2:
            async with self.http.post(self.engine_url + "/kvroute/faults", json={"drop_cache": True}) as response:
                assert response.status == 200, await response.text()
        return await super()._send(target, prompt)


async def probe_in_process(fleet: Fleet, make_prober) -> WorkerAudit:
    """The blind worker's probe audit by `make_prober(http)`, in this process, against the live fleet."""
    async with grpc.aio.insecure_channel(fleet.cluster.control_plane_addr) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        info = next(w for w in (await stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)).workers if w.worker_id == fleet.blind)
        async with aiohttp.ClientSession() as http:
            return await make_prober(http).audit(probe_target(stub, info))


async def test_probe_finds_blocks_the_engine_lost_silently(fleet: Fleet) -> None:
    audit = await probe_in_process(fleet, lambda http: DroppingProber(http, fleet.engine_url, force=True))
    assert audit.status == "ok" and audit.kind == "probe", audit
    probe = audit.probe
    assert probe.events_arrived and probe.control_plane_blocks == PROBE_BLOCKS
    assert probe.predicted_hit_tokens == PROBE_HIT and probe.engine_hit_tokens == 0 and probe.source == "metrics"
    assert probe.extra == PROBE_BLOCKS == audit.divergence and probe.missing == 0


async def test_a_probe_of_whole_blocks_predicts_the_engine_s_cap(fleet: Fleet, monkeypatch) -> None:
    """A probe of exactly PROBE_BLOCKS blocks: the control plane holds all of them, but the engine computes
    the last prompt token, so its second send hits one block less, and so does the prediction."""
    monkeypatch.setattr(audit_module, "PROBE_EXTRA_TOKENS", 0)
    audit = await probe_in_process(fleet, lambda http: Prober(http, force=True))
    assert audit.status == "ok" and audit.divergence == 0, audit
    assert audit.probe.control_plane_blocks == PROBE_BLOCKS and audit.probe.prompt_tokens == PROBE_HIT
    assert audit.probe.engine_hit_tokens == audit.probe.predicted_hit_tokens == PROBE_HIT - BLOCK_SIZE


class NoisyProber(Prober):
    """Another request (a prompt the engine has cached: its hit would be counted as the probe's) reaches the
    engine with the sends numbered in `noisy` (1 = the first send); `usage` False hides the response's
    cached_tokens, as a vLLM without --enable-prompt-tokens-details does."""

    def __init__(self, http, engine_url: str, noisy: set[int], usage: bool, **kwargs) -> None:
        super().__init__(http, **kwargs)
        self.engine_url, self.noisy, self.usage = engine_url, noisy, usage
        self.sends = 0
        self.noise = [7 + t % 500 for t in range(6 * BLOCK_SIZE)]

    async def _send(self, target: ProbeTarget, prompt: list[int]) -> int | None:
        self.sends += 1
        if self.sends in self.noisy:
            async with self.http.post(
                self.engine_url + "/v1/completions", json={"prompt": self.noise, "max_tokens": 1}
            ) as response:
                assert response.status == 200, await response.text()
        cached = await super()._send(target, prompt)
        return cached if self.usage else None


async def test_other_requests_in_the_measurement_are_not_counted_as_the_probe_s(fleet: Fleet) -> None:
    status, body = http_post_json(
        fleet.engine_url + "/v1/completions", {"prompt": NoisyProber(None, "", set(), True).noise, "max_tokens": 1}
    )
    assert status == 200, body  # the noise prompt is cached now: each noisy send adds its hit to the counters
    # The window of the second send has other tokens in it: the response's cached_tokens is used instead.
    audit = await probe_in_process(fleet, lambda http: NoisyProber(http, fleet.engine_url, {2}, True, force=True))
    assert audit.status == "ok" and audit.divergence == 0 and audit.probe.source == "usage", audit
    assert audit.probe.engine_hit_tokens == PROBE_HIT
    # An engine that does not report cached_tokens: the probe is sent again until a window is its own.
    prober = None

    def make(http):
        nonlocal prober
        prober = NoisyProber(http, fleet.engine_url, {2, 3}, False, force=True)
        return prober

    audit = await probe_in_process(fleet, make)
    assert audit.status == "ok" and audit.divergence == 0 and audit.probe.source == "metrics", audit
    assert audit.probe.engine_hit_tokens == PROBE_HIT and prober.sends == 4
    # Never alone: an error, not a guess.
    audit = await probe_in_process(fleet, lambda http: NoisyProber(http, fleet.engine_url, {2, 3, 4}, False, force=True))
    assert audit.status == "error" and "busy" in audit.detail, audit


async def test_control_plane_probes_periodically_and_exports_the_divergence(fleet: Fleet, tmp_path) -> None:
    """A second control plane, auditing itself with --audit-probe, fed by a second agent of the blind engine
    (its ZMQ publisher serves both agents) and by the lying fake agent."""
    metrics_port = free_port()
    second = LocalCluster(
        workdir=tmp_path, tokenizer_dir=fleet.cluster.tokenizer_dir, heartbeat_timeout_s=3, block_size=BLOCK_SIZE
    )
    liar = None
    try:
        second.start_control_plane(
            extra_args=(
                "--metrics-port",
                str(metrics_port),
                "--audit-interval-s",
                "0.3",
                "--audit-probe",
                "--audit-probe-deadline-s",
                "1",
            )
        )
        blind = next(e for e in fleet.cluster.engines if e.worker_id == fleet.blind)
        second.engines.append(dataclasses.replace(blind, url=fleet.front.url, agent=None))
        second.start_agent(second.engines[0])
        second.wait_workers_registered()
        liar = FakeAgent(second.control_plane_addr)
        await liar.claim("liar", fleet.front.url, {"gpu": [11, 12, 13]})
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        liar_series = 'kvroute_cp_audit_divergent_blocks{kind="probe",medium="any",worker="liar"}'
        blind_series = f'kvroute_cp_audit_divergent_blocks{{kind="probe",medium="any",worker="{fleet.blind}"}}'

        def exported():
            text = http_get(metrics)[1].decode()
            return f"{liar_series} {float(PROBE_BLOCKS)}" in text and f"{blind_series} 0.0" in text and text

        text = await asyncio.to_thread(
            wait_until, exported, 30, "the periodic probe audit to export both workers", second.all_processes()
        )
        assert f'kvroute_cp_audit_last_success_timestamp_seconds{{worker="{fleet.blind}"}}' in text
        assert 'kvroute_cp_audit_runs_total{result="ok"}' in text
        # A worker that leaves (its agent stops heartbeating) loses its series.
        await liar.close()
        liar = None
        await asyncio.to_thread(
            wait_until,
            lambda: liar_series not in http_get(metrics)[1].decode(),
            30,
            "the liar's series to go",
            second.all_processes(),
        )
        assert blind_series in http_get(metrics)[1].decode()
    finally:
        if liar is not None:
            await liar.close()
        if second.control_plane is not None:
            second.control_plane.stop()
        for engine in second.engines:
            if engine.agent is not None:
                engine.agent.stop()
