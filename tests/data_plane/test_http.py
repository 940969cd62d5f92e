"""The router in-process over real sockets: a fake control plane (a grpc.aio ControlPlane servicer
returning canned matches) and two fake backends (aiohttp servers that stream SSE and say who they
are). Covers: the choice follows the index, x-kvroute-worker, SSE streamed through unbuffered,
/v1/route shape, failing open (control plane stopped / slow / empty), backend failover, input
errors, the gRPC Route service, trace propagation and metrics."""

from __future__ import annotations

import asyncio
import gzip
import json
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.api.errors import engine_error_body
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.data_plane.grpc.api import RouterGrpcService, add_router_service
from kvroute.data_plane.grpc.app_reservations import AppReservations
from kvroute.data_plane.http.api import RouterHttpApi
from kvroute.data_plane.http.proxy import BackendProxy
from kvroute.data_plane.prepare.model_tokenizers import ModelTokenizers
from kvroute.data_plane.prepare.request_prep import RequestPreparer
from kvroute.data_plane.prepare.tokenization import PromptTokenizer, load_tokenizer
from kvroute.data_plane.service.routing import Router
from kvroute.prom_text import sample_value
from kvroute.telemetry import install_tracer_provider
from kvroute.tools.local_cluster import free_port
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from tests.helpers import eventually

MODEL = "tiny"
PROMPT = " ".join(["the cache router sends each prompt to the worker that holds its prefix"] * 8)

# ---------------------------------------------------------------- tracing (in-memory, once per session)

_EXPORTER = InMemorySpanExporter()


_EXPORTING_PROVIDERS: list[TracerProvider] = []  # providers _EXPORTER already listens to


def _install_tracing() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        install_tracer_provider(provider)
    if provider not in _EXPORTING_PROVIDERS:
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        _EXPORTING_PROVIDERS.append(provider)
    return _EXPORTER


# ---------------------------------------------------------------- fakes


class FakeControlPlane(pb_grpc.ControlPlaneServicer):
    """Canned fleet and matches; records every Query."""

    def __init__(self) -> None:
        self.workers: list[pb.WorkerInfo] = []
        self.matched_blocks: dict[str, int] = {}
        self.loads: dict[str, pb.WorkerLoad] = {}
        self.queries: list[pb.QueryRequest] = []
        self.query_delay_s = 0.0
        self.empty_query = False

    def add_worker(self, worker_id: str, endpoint: str, block_size: int = 16) -> None:
        self.workers.append(
            pb.WorkerInfo(worker_id=worker_id, model=MODEL, engine="sim", block_size=block_size, endpoint=endpoint)
        )

    async def Query(self, request: pb.QueryRequest, context) -> pb.QueryResponse:
        self.queries.append(request)
        if self.query_delay_s:
            await asyncio.sleep(self.query_delay_s)
        if self.empty_query:
            return pb.QueryResponse()
        assert request.columnar, "the router asks for the columnar answer"
        served = [w for w in self.workers if w.model == request.model]
        loads = [self.loads.get(w.worker_id, pb.WorkerLoad()) for w in served]
        n = len(served)
        return pb.QueryResponse(
            query_id=request.query_id,
            columns=pb.WorkerColumns(
                worker_id=[w.worker_id for w in served],
                matched_blocks=[self.matched_blocks.get(w.worker_id, 0) for w in served],
                cpu_blocks=[0] * n,
                disk_blocks=[0] * n,
                speculative_blocks=[0] * n,
                reserved_requests=[0] * n,
                reserved_prefill_tokens=[0] * n,
                running_requests=[x.running_requests for x in loads],
                waiting_requests=[x.waiting_requests for x in loads],
                kv_usage=[x.kv_usage for x in loads],
            ),
        )

    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=[w for w in self.workers if not request.model or w.model == request.model])


@dataclass
class FakeBackend:
    """An OpenAI-ish engine: SSE when stream is true (first event, then waits for `gate`), else JSON."""

    name: str
    mode: str = "ok"  # ok | http500 | drop (close before answering) | die (close after the first event) | error
    error: tuple[int, dict[str, str], bytes] = (400, {}, b"")  # mode "error": status, headers, body (0 = chunked)
    received: list[tuple[str, dict, bytes]] = field(default_factory=list)
    requests: list[web.Request] = field(default_factory=list)
    gate: asyncio.Event | None = None
    runner: web.AppRunner | None = None
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append((request.path, dict(request.headers), raw))
        self.requests.append(request)
        if self.mode == "http500":
            return web.json_response({"error": {"message": f"{self.name} is broken"}}, status=500)
        if self.mode == "error":
            status, headers, body = self.error
            if headers.get("Transfer-Encoding") == "chunked":  # no Content-Length: a streamed error
                resp = web.StreamResponse(status=status, headers={"Content-Type": headers["Content-Type"]})
                await resp.prepare(request)
                await resp.write(body)
                return resp
            return web.Response(status=status, headers=headers, body=body)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        body = json.loads(raw)
        if not body.get("stream"):
            return web.json_response(
                {
                    "backend": self.name,
                    "path": request.path,
                    "raw": raw.decode(),
                    "usage": {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Backend": self.name})
        await resp.prepare(request)
        await resp.write(f'data: {{"backend": "{self.name}", "n": 0}}\n\n'.encode())
        if self.mode == "die":
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), 10)
        try:
            await resp.write(f'data: {{"backend": "{self.name}", "n": 1}}\n\n'.encode())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the router went away (client disconnect test)
            pass
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
            self.runner = None


@dataclass
class Stack:
    cp: FakeControlPlane
    cp_server: grpc.aio.Server | None
    a: FakeBackend
    b: FakeBackend
    client: ControlPlaneClient
    router: Router
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    url: str
    grpc_target: str
    session: aiohttp.ClientSession
    tokenizer: PromptTokenizer

    async def post(self, path: str, body: dict | bytes, **kw) -> tuple[int, dict, dict]:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with self.session.post(self.url + path, **kwargs, **kw) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)

    async def stop_control_plane(self) -> None:
        if self.cp_server is not None:
            await self.cp_server.stop(0)
            self.cp_server = None


async def start_control_plane(cp: FakeControlPlane, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(cp, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def make_stack(
    tiny_model_dir,
    *,
    policy: str = "kv_aware",
    with_cp: bool = True,
    static_a: bool = False,
    query_timeout_s: float = 0.5,
    max_prompt_tokens: int = 4096,
    block_sizes=(16, 16),
    listed: bool = True,
) -> Stack:
    """`listed`: the control plane lists A and B (else no worker at all)."""
    cp = FakeControlPlane()
    a, b = FakeBackend("A"), FakeBackend("B")
    await a.start()
    await b.start()
    if listed:
        cp.add_worker("A", a.url, block_sizes[0])
        cp.add_worker("B", b.url, block_sizes[1])
    if with_cp:
        cp_server, cp_port = await start_control_plane(cp)
    else:  # an address where nothing listens
        cp_server, cp_port = None, free_port()
    client = ControlPlaneClient(
        f"127.0.0.1:{cp_port}",
        query_timeout_s=query_timeout_s,
        refresh_interval_s=0.1,
        static_workers={"A": a.url} if static_a else None,
    )
    if with_cp:
        await client.refresh()
    client.start()
    tokenizer = load_tokenizer(tiny_model_dir)
    inflight, health = RouterInflight(client.session), BackendHealth()
    router = Router(client, make_policy(policy, seed=0), inflight, health)
    preparer = RequestPreparer(ModelTokenizers.preloaded({MODEL: tokenizer}, MODEL), client, max_prompt_tokens)
    http = RouterHttpApi(router, BackendProxy(inflight, health, router.metrics), preparer)
    runner = web.AppRunner(http.app(), handler_cancellation=True)  # as kvroute.data_plane.cli runs it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    grpc_server = grpc.aio.server()
    add_router_service(RouterGrpcService(router, preparer, AppReservations(inflight, router.metrics)), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    return Stack(
        cp,
        cp_server,
        a,
        b,
        client,
        router,
        runner,
        grpc_server,
        f"http://127.0.0.1:{runner.addresses[0][1]}",
        f"127.0.0.1:{grpc_port}",
        aiohttp.ClientSession(),
        tokenizer,
    )


async def close_stack(s: Stack) -> None:
    await s.session.close()
    await s.grpc_server.stop(0)
    await s.http_runner.cleanup()
    await s.client.close()
    await s.stop_control_plane()
    await s.a.stop()
    await s.b.stop()


@pytest.fixture
async def stack(tiny_model_dir):
    s = await make_stack(tiny_model_dir)
    try:
        yield s
    finally:
        await close_stack(s)


def completion(stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream, **extra}


# ---------------------------------------------------------------- routing follows the index


async def test_choice_follows_the_index_and_response_names_the_worker(stack: Stack) -> None:
    for cached, expected in (("B", "B"), ("A", "A"), ("B", "B")):
        stack.cp.matched_blocks = {cached: 5}
        status, headers, body = await stack.post("/v1/completions", completion())
        assert status == 200, body
        assert headers["x-kvroute-worker"] == expected and body["backend"] == expected
    # The original body bytes reach the backend untouched.
    raw = json.dumps(completion(), indent=3).encode()
    status, headers, body = await stack.post("/v1/completions", raw, headers={"Content-Type": "application/json"})
    assert status == 200 and body["raw"] == raw.decode()
    # The query carried the prompt's own block keys.
    tokens = stack.tokenizer.encode_prompt(PROMPT)
    chain = stack.cp.queries[-1].chains
    assert [c.block_size for c in chain] == [16]
    assert list(chain[0].block_keys) == prompt_block_keys(tokens, 16, MODEL)
    assert stack.router.inflight.snapshot() == {}  # every in-flight entry released


async def test_route_endpoint_shape_and_cached_tokens(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 3, "B": 10_000}  # more than the prompt: capped at its length
    stack.cp.loads = {"A": pb.WorkerLoad(running_requests=2, waiting_requests=1)}
    status, _, d = await stack.post("/v1/route", completion())
    assert status == 200
    assert set(d) == {"worker_id", "endpoint", "prompt_tokens", "cached_tokens", "fail_open", "policy", "workers"}
    assert d["worker_id"] == "B" and d["endpoint"] == stack.b.url and d["policy"] == "kv_aware"
    assert d["fail_open"] is False and d["cached_tokens"] == d["prompt_tokens"] > 48
    workers = {w["worker_id"]: w for w in d["workers"]}
    assert set(workers) == {"A", "B"}
    assert set(workers["A"]) == {
        "worker_id",
        "endpoint",
        "cached_tokens",
        "score",
        "inflight_requests",
        "running_requests",
        "waiting_requests",
    }
    assert workers["A"]["cached_tokens"] == 48 and workers["A"]["running_requests"] == 2
    assert workers["A"]["waiting_requests"] == 1 and workers["A"]["score"] > workers["B"]["score"]
    assert not stack.a.received and not stack.b.received  # /v1/route forwards nothing
    # Chat bodies work too.
    status, _, d = await stack.post("/v1/route", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and d["prompt_tokens"] > 0


async def test_one_chain_per_distinct_block_size(tiny_model_dir) -> None:
    s = await make_stack(tiny_model_dir, block_sizes=(16, 32))
    try:
        s.cp.matched_blocks = {"B": 2}
        status, _, d = await s.post("/v1/route", completion())
        assert status == 200 and d["worker_id"] == "B" and d["cached_tokens"] == 64
        tokens = s.tokenizer.encode_prompt(PROMPT)
        chains = {c.block_size: list(c.block_keys) for c in s.cp.queries[-1].chains}
        assert chains == {16: prompt_block_keys(tokens, 16, MODEL), 32: prompt_block_keys(tokens, 32, MODEL)}
        # lora_name / cache_salt change the namespace, hence the keys.
        await s.post("/v1/route", completion(cache_salt="tenant-1"))
        salted = {c.block_size: list(c.block_keys) for c in s.cp.queries[-1].chains}
        assert salted[16] == prompt_block_keys(tokens, 16, MODEL, cache_salt="tenant-1") != chains[16]
    finally:
        await close_stack(s)


# ---------------------------------------------------------------- streaming


async def test_sse_is_streamed_through_unbuffered(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    stack.a.gate = asyncio.Event()
    async with stack.session.post(
        stack.url + "/v1/chat/completions",
        json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": PROMPT}]},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-kvroute-worker"] == "A" and resp.headers["Content-Type"] == "text/event-stream"
        # The first event arrives while the backend is still holding the rest back: nothing is buffered.
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert json.loads(first[len(b"data: ") :]) == {"backend": "A", "n": 0}
        assert stack.router.inflight.inflight("A") == (1, 0)  # in flight; prefill done at the first byte
        stack.a.gate.set()
        rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest.endswith(b"data: [DONE]\n\n") and b'"n": 1' in rest
    assert stack.a.received[-1][0] == "/v1/chat/completions"
    assert stack.router.inflight.snapshot() == {}


async def test_backend_dying_mid_stream_truncates_the_client_stream(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    stack.a.mode = "die"
    async with stack.session.post(stack.url + "/v1/completions", json=completion(stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "A"
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert b'"n": 0' in first
        with pytest.raises(aiohttp.ClientPayloadError):  # not a clean end: the truncation is visible
            await asyncio.wait_for(resp.content.read(), 5)
    assert len(stack.b.received) == 0  # bytes were already sent: no retry
    assert stack.router.inflight.snapshot() == {}


async def test_client_going_away_releases_the_backend(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    stack.a.gate = asyncio.Event()  # the backend holds its stream open
    resp = await stack.session.post(stack.url + "/v1/completions", json=completion(stream=True))
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert stack.router.inflight.inflight("A") == (1, 0)
    resp.close()  # the client disconnects mid-stream
    backend_request = stack.a.requests[-1]
    await eventually(
        lambda: (
            stack.router.inflight.snapshot() == {}
            and (backend_request.transport is None or backend_request.transport.is_closing())
        ),
        2,
        what="the backend request released and closed",
    )
    stack.a.gate.set()


# ---------------------------------------------------------------- failing open


async def test_control_plane_stopped_requests_still_succeed(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    assert (await stack.post("/v1/route", completion()))[2]["fail_open"] is False
    await stack.stop_control_plane()
    served = set()
    for i in range(12):  # prompts that differ from the first block: equal loads tie, ties spread by prefix
        status, headers, body = await stack.post("/v1/completions", completion(prompt=f"request {i}: {PROMPT}"))
        assert status == 200, body
        served.add(headers["x-kvroute-worker"])
    status, _, d = await stack.post("/v1/route", completion())
    assert status == 200 and d["fail_open"] is True and d["cached_tokens"] == 0
    assert {w["worker_id"] for w in d["workers"]} == {"A", "B"}
    assert served == {"A", "B"}  # load alone: both workers get traffic

    async def health_says_unreachable() -> bool:  # once a refresh or two failed
        async with stack.session.get(stack.url + "/health") as resp:
            return (await resp.json())["control_plane"] == "unreachable"

    await eventually(health_says_unreachable, 5, what="/health saying the control plane is unreachable")
    async with stack.session.get(stack.url + "/metrics") as resp:
        metrics = await resp.text()
    assert (sample_value(metrics, "kvroute_router_fail_open_total") or 0) >= 13


async def test_slow_or_empty_index_fails_open_within_the_deadline(tiny_model_dir) -> None:
    s = await make_stack(tiny_model_dir, query_timeout_s=0.05)
    try:
        s.cp.query_delay_s = 1.0
        started = asyncio.get_running_loop().time()
        status, _, d = await s.post("/v1/route", completion())
        assert status == 200 and d["fail_open"] is True
        assert asyncio.get_running_loop().time() - started < 0.8
        s.cp.query_delay_s, s.cp.empty_query = 0.0, True  # a restarted control plane, agents not back yet
        status, _, d = await s.post("/v1/route", completion())
        assert status == 200 and d["fail_open"] is True and len(d["workers"]) == 2
        s.cp.workers = []  # ListWorkers empty too: the last known fleet still serves
        await s.client.refresh()
        assert s.client.fleet == {}
        status, headers, _ = await s.post("/v1/completions", completion())
        assert status == 200 and headers["x-kvroute-worker"] in {"A", "B"}
    finally:
        await close_stack(s)


async def test_static_workers_when_control_plane_never_reached(tiny_model_dir) -> None:
    s = await make_stack(tiny_model_dir, with_cp=False)
    try:
        status, _, body = await s.post("/v1/completions", completion())
        assert status == 503 and "no workers known" in body["error"]["message"]
        assert "not reached yet" in body["error"]["message"] and "no --static-workers were given" in body["error"]["message"]
    finally:
        await close_stack(s)
    s = await make_stack(tiny_model_dir, with_cp=False, static_a=True)
    try:
        status, headers, body = await s.post("/v1/completions", completion())
        assert status == 200 and headers["x-kvroute-worker"] == "A"
        status, _, d = await s.post("/v1/route", completion())
        assert d["fail_open"] is True and [w["worker_id"] for w in d["workers"]] == ["A"]
        async with s.session.get(s.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    finally:
        await close_stack(s)


async def test_the_no_workers_503_says_what_is_true_with_static_workers_given(tiny_model_dir) -> None:
    """A reachable control plane that lists no worker of the model, with --static-workers given: they
    are not used (only until the control plane is first reached), and the 503 and /ready say so
    instead of "no --static-workers fallback"."""
    s = await make_stack(tiny_model_dir, static_a=True, listed=False)
    try:
        status, _, body = await s.post("/v1/completions", completion())
        message = body["error"]["message"]
        assert status == 503 and body["error"]["code"] == "no_workers", body
        assert f"control plane {s.client.address} is reachable but lists none" in message, message
        assert "the 1 --static-workers are used only until the control plane is first reached" in message, message
        assert "no --static-workers" not in message and s.a.url not in message
        async with s.session.get(s.url + "/ready") as resp:
            ready = await resp.json()
        assert resp.status == 503 and ready["problems"] == [message], ready
    finally:
        await close_stack(s)


# ---------------------------------------------------------------- backend failover


async def test_refused_backend_is_retried_on_the_next_best(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    await stack.a.stop()  # connection refused
    status, headers, _ = await stack.post("/v1/completions", completion())
    assert status == 200 and headers["x-kvroute-worker"] == "B"
    # A streamed request too, and A is avoided while it cools down (no connect attempt per request).
    async with stack.session.post(stack.url + "/v1/completions", json=completion(stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "B"
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    async with stack.session.get(stack.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'kvroute_router_backend_errors_total{worker="A"} 1.0' in metrics
    assert 'kvroute_router_proxied_requests_total{policy="kv_aware",worker="B"} 2.0' in metrics
    # One retry, one sit-out begun; A is visibly out (circuit open) while B serves.
    assert sample_value(metrics, "kvroute_router_retries_total") == 1
    assert sample_value(metrics, "kvroute_router_worker_sit_outs_total", {"worker": "A"}) == 1
    assert sample_value(metrics, "kvroute_router_worker_sitting_out", {"worker": "A"}) == 1
    assert sample_value(metrics, "kvroute_router_worker_sitting_out", {"worker": "B"}) == 0
    assert sample_value(metrics, "kvroute_router_worker_healthy", {"worker": "A"}) == 0
    assert sample_value(metrics, "kvroute_router_worker_healthy", {"worker": "B"}) == 1
    assert sample_value(metrics, "kvroute_router_http_requests_total", {"route": "/v1/completions", "code": "200"}) == 2
    assert sample_value(metrics, "kvroute_router_time_to_first_token_seconds_count") == 1  # the streamed one
    assert stack.router.inflight.snapshot() == {}


@pytest.mark.parametrize("mode", ["http500", "drop"])
async def test_backend_failing_before_first_byte_is_retried(stack: Stack, mode: str) -> None:
    stack.cp.matched_blocks = {"A": 5}
    stack.a.mode = mode
    status, headers, body = await stack.post("/v1/completions", completion())
    assert status == 200 and headers["x-kvroute-worker"] == "B" and body["backend"] == "B"
    assert len(stack.a.received) == 1


@pytest.mark.parametrize("endpoint", ["::not a url", "http://[::1", "ftp://x", "", "http://127.0.0.1:99999"])
async def test_regression_a_worker_endpoint_that_is_no_url_fails_over(stack: Stack, endpoint: str) -> None:
    """Found with the control-plane fuzz: a worker registered with an endpoint that is no http(s) URL
    made every request sent there a 500 (the URL's ValueError was not a backend failure), not a failover."""
    stack.cp.add_worker("C", endpoint)
    await stack.client.refresh()
    stack.cp.matched_blocks = {"C": 50}
    status, headers, body = await stack.post("/v1/completions", completion())
    assert status == 200 and headers["x-kvroute-worker"] in "AB", body
    stack.a.mode = stack.b.mode = "drop"
    status, _, body = await stack.post("/v1/completions", completion())
    assert status == 502 and body["error"]["code"] == "backend_unavailable", body


async def test_regression_client_headers_beyond_latin1_reach_the_engine_as_sent(stack: Stack) -> None:
    """Found by `kvroute bench fuzz --target router-http`: headers went to the engine encoded as Latin-1,
    so a client header with any other character (or a byte that is not UTF-8) was a 500."""
    stack.cp.matched_blocks = {"A": 5}
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps(completion()).encode()
    for value in ("日本語のメモ".encode(), "café".encode(), b"caf\xe9"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nX-Note: "
            + value
            + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        response = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert response.startswith(b"HTTP/1.1 200"), response
        request = stack.a.requests[-1]
        assert dict(request.raw_headers)[b"X-Note"] == value  # the bytes the client sent


async def test_every_backend_failing_surfaces_the_last_error(stack: Stack) -> None:
    stack.a.mode = stack.b.mode = "http500"
    status, headers, body = await stack.post("/v1/completions", completion())
    assert status == 500 and "is broken" in body["error"]["message"] and headers["x-kvroute-worker"] in "AB"
    await stack.a.stop()
    await stack.b.stop()
    status, _, body = await stack.post("/v1/completions", completion())
    assert status == 502 and "no backend could serve the request" in body["error"]["message"]
    assert stack.router.inflight.snapshot() == {}


# ---------------------------------------------------------------- errors relayed from an engine

_VLLM_400 = {
    "error": {"message": "max_tokens must be at least 1, got -1.", "type": "BadRequestError", "param": "max_tokens", "code": 400}
}
_SGLANG_400 = {"object": "error", "message": "max_tokens must be positive", "type": "BadRequestError", "param": None, "code": 400}


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, _json(_VLLM_400), ("max_tokens must be at least 1, got -1.", "max_tokens", None)),
        (400, _json(_SGLANG_400), ("max_tokens must be positive", None, None)),
        (
            404,
            _json(
                {
                    "object": "error",
                    "message": "The model `x` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            ),
            ("The model `x` does not exist.", "model", None),
        ),
        (
            400,
            _json(
                {
                    "error": {
                        "message": "too long",
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "context_length_exceeded",
                    }
                }
            ),
            ("too long", "messages", "context_length_exceeded"),
        ),
        (
            422,
            _json({"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int_parsing"}]}),
            ("body.max_tokens: Input should be a valid integer", None, None),
        ),
        (404, b'{"detail": "Not Found"}', ("Not Found", None, None)),
        (429, b'{"error": "rate limited"}', ("rate limited", None, None)),
        (503, b"Service Unavailable: engine is draining\n", ("Service Unavailable: engine is draining", None, None)),
        (502, b"<html><body>bad gateway</body></html>", ("<html><body>bad gateway</body></html>", None, None)),
        (500, b"", ("the engine answered HTTP 500 with no message", None, None)),
        (400, b"\xff\xfe not utf-8", ("\ufffd\ufffd not utf-8", None, None)),
        (400, b'["a", 1]', ('["a", 1]', None, None)),
        (400, b'{"message": {"nested": true}, "param": 3, "code": 400}', ('{"nested": true}', None, None)),
    ],
)
def test_engine_errors_take_openais_error_object(status: int, body: bytes, expected: tuple) -> None:
    error = json.loads(engine_error_body(status, body, [("Content-Type", "application/json")]))["error"]
    assert (error["message"], error["param"], error["code"]) == expected
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert set(error) == {"message", "type", "param", "code"}


def test_a_compressed_engine_error_is_relayed_as_it_is() -> None:
    assert engine_error_body(400, b"\x1f\x8b...", [("Content-Encoding", "gzip")]) is None
    assert engine_error_body(400, b"{}", [("content-encoding", "identity")]) is not None


async def test_engine_errors_reach_the_client_as_openai_errors_with_their_status(stack: Stack) -> None:
    stack.cp.matched_blocks = {"A": 5}
    stack.a.mode = "error"
    for status, engine_body, message in (
        (400, _VLLM_400, "max_tokens must be at least 1, got -1."),
        (400, _SGLANG_400, "max_tokens must be positive"),
    ):
        stack.a.error = (status, {"Content-Type": "application/json"}, json.dumps(engine_body).encode())
        for stream in (False, True):  # a streamed request refused before streaming: a plain JSON answer
            got, headers, body = await stack.post("/v1/completions", completion(stream=stream))
            assert got == status and headers["x-kvroute-worker"] == "A", body
            assert headers["Content-Type"].startswith("application/json")
            assert body == {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": engine_body.get("param", engine_body.get("error", {}).get("param")),
                    "code": None,
                }
            }
    # The last engine's 5xx (every worker failed), as text: its words, OpenAI's shape, its status.
    stack.b.mode = "error"
    stack.a.error = stack.b.error = (503, {"Content-Type": "text/plain"}, b"engine overloaded, retry later")
    got, _, body = await stack.post("/v1/completions", completion())
    assert got == 503 and body == {
        "error": {"message": "engine overloaded, retry later", "type": "server_error", "param": None, "code": None}
    }
    # Streamed (no Content-Length) or compressed error bodies go through untouched.
    stack.a.error = stack.b.error = (400, {"Content-Type": "text/plain", "Transfer-Encoding": "chunked"}, b"raw words")
    async with stack.session.post(stack.url + "/v1/completions", json=completion()) as resp:
        assert resp.status == 400 and await resp.read() == b"raw words"
    stack.a.error = stack.b.error = (
        400,
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        gzip.compress(b'{"error": {"message": "zipped"}}'),
    )
    async with stack.session.post(stack.url + "/v1/completions", json=completion()) as resp:
        assert resp.status == 400 and json.loads(await resp.read()) == {"error": {"message": "zipped"}}
    assert stack.router.inflight.snapshot() == {}


# ---------------------------------------------------------------- bad input


async def test_bad_input_is_a_clear_openai_style_error(stack: Stack) -> None:
    cases = [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"prompt": "x"}, 400, "'model' is required"),
        ("/v1/completions", {"model": MODEL}, 400, "'prompt' is required"),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "'prompt' must be"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "'prompt' must be"),
        ("/v1/chat/completions", {"model": MODEL, "prompt": "x"}, 400, "'messages' is required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "role"),
        ("/v1/route", {"model": MODEL}, 400, "either 'prompt' or 'messages'"),
        ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "The model `gpt-5` does not exist or you"),
        ("/v1/completions", {"model": MODEL, "prompt": "cache " * 5000}, 400, "more than this router accepts (4096"),
        ("/v1/completions", {"model": MODEL, "prompt": list(range(4097))}, 400, "prompt has 4097 tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": ["x", "cache " * 5000]}, 400, "--max-prompt-tokens"),
    ]
    for path, body, status, message in cases:
        got, _, answer = await stack.post(path, body)
        assert got == status, (path, body, answer)
        assert message in answer["error"]["message"], answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] is None or isinstance(answer["error"]["code"], str), answer
    assert not stack.a.received and not stack.b.received
    # Token-id prompts and a batch route fine.
    assert (await stack.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]}))[0] == 200
    assert (await stack.post("/v1/completions", {"model": MODEL, "prompt": ["a b", "c"]}))[0] == 200


async def test_models_health_metrics(stack: Stack) -> None:
    async with stack.session.get(stack.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    async with stack.session.get(stack.url + "/health") as resp:
        health = await resp.json()
    assert resp.status == 200 and health["workers"] == 2 and health["control_plane"] == "reachable"
    await stack.post("/v1/completions", completion())
    async with stack.session.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        "kvroute_router_proxied_requests_total",
        "kvroute_router_decision_seconds_bucket",
        "kvroute_router_fail_open_total",
        "kvroute_router_backend_errors_total",
        "kvroute_router_predicted_cached_tokens_total",
        "kvroute_router_prompt_tokens_total",
    ):
        assert name in text, name
    # What the engine reported it reused (usage.prompt_tokens_details), beside what the router expected.
    assert sample_value(text, "kvroute_router_engine_prompt_tokens_total") == 40
    assert sample_value(text, "kvroute_router_engine_cached_tokens_total") == 32
    assert sample_value(text, "kvroute_build_info", {"component": "router"}) == 1
    assert sample_value(text, "kvroute_router_http_requests_total", {"route": "/v1/models", "code": "200"}) == 1
    assert sample_value(text, "kvroute_router_http_request_duration_seconds_count", {"route": "/v1/completions"}) == 1
    assert sample_value(text, "kvroute_router_http_requests_in_flight") == 1  # this scrape itself
    async with stack.session.get(stack.url + "/nowhere") as resp:
        assert resp.status == 404
    async with stack.session.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    assert sample_value(text, "kvroute_router_http_requests_total", {"route": "other", "code": "404"}) == 1


# ---------------------------------------------------------------- tracing


async def test_spans_and_traceparent_reach_the_backend(stack: Stack) -> None:
    exporter = _install_tracing()
    exporter.clear()
    stack.cp.matched_blocks = {"B": 2}
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    status, _, _ = await stack.post("/v1/completions", completion(), headers={"traceparent": incoming})
    assert status == 200
    sent = stack.b.received[-1][1]["traceparent"]
    assert sent.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"  # the caller's trace continues
    spans = {s.name: s for s in exporter.get_finished_spans()}
    route, proxy = spans["kvroute.route"], spans["kvroute.proxy"]
    assert route.attributes["kvroute.policy"] == "kv_aware" and route.attributes["kvroute.worker_id"] == "B"
    assert route.attributes["kvroute.cached_tokens"] == 32 and route.attributes["kvroute.fail_open"] is False
    assert route.attributes["kvroute.prompt_tokens"] > 0
    assert proxy.kind == trace.SpanKind.CLIENT and sent.split("-")[2] == format(proxy.context.span_id, "016x")


# ---------------------------------------------------------------- gRPC Route


async def test_grpc_route(stack: Stack) -> None:
    stack.cp.matched_blocks = {"B": 3}
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        for request in (
            pb.RouteRequest(model=MODEL, prompt=PROMPT),
            pb.RouteRequest(model=MODEL, token_ids=pb.TokenIds(ids=list(range(100)))),
            pb.RouteRequest(model=MODEL, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)])),
        ):
            answer = await stub.Route(request, timeout=5)
            assert answer.worker_id == "B" and answer.endpoint == stack.b.url and answer.cached_tokens == 48
            assert answer.policy == "kv_aware" and not answer.fail_open and answer.prompt_tokens >= 48
            assert {w.worker_id for w in answer.workers} == {"A", "B"}
        http = (await stack.post("/v1/route", completion()))[2]
        grpc_answer = await stub.Route(pb.RouteRequest(model=MODEL, prompt=PROMPT), timeout=5)
        assert grpc_answer.prompt_tokens == http["prompt_tokens"]
        for bad, code, message in (
            (pb.RouteRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "one of 'prompt'"),
            (pb.RouteRequest(prompt="x"), grpc.StatusCode.INVALID_ARGUMENT, "'model' is required"),
            (pb.RouteRequest(model="other", prompt="x"), grpc.StatusCode.NOT_FOUND, "does not exist"),
            (
                pb.RouteRequest(model=MODEL, token_ids=pb.TokenIds(ids=[1] * 5000)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "more than this router accepts",
            ),
            (
                pb.RouteRequest(model=MODEL, messages=pb.ChatMessages(messages=[pb.ChatMessage(content="x")])),
                grpc.StatusCode.INVALID_ARGUMENT,
                "role",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Route(bad, timeout=5)
            assert err.value.code() == code and message in err.value.details(), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Release(pb.ReleaseRequest(reservation_id=12345), timeout=5)
        async with stack.session.get(stack.url + "/metrics") as resp:
            text = await resp.text()
        assert sample_value(text, "kvroute_router_grpc_requests_total", {"method": "Route", "code": "OK"}) == 4
        assert sample_value(text, "kvroute_router_grpc_requests_total", {"method": "Route", "code": "INVALID_ARGUMENT"}) == 4
        assert sample_value(text, "kvroute_router_grpc_requests_total", {"method": "Route", "code": "NOT_FOUND"}) == 1
        assert sample_value(text, "kvroute_router_grpc_requests_total", {"method": "Release", "code": "NOT_FOUND"}) == 1
        assert sample_value(text, "kvroute_router_grpc_request_duration_seconds_count", {"method": "Route"}) == 9
        await stack.stop_control_plane()
        answer = await stub.Route(pb.RouteRequest(model=MODEL, prompt=PROMPT), timeout=5)
        assert answer.fail_open and answer.worker_id in {"A", "B"}


# ---------------------------------------------------------------- error bodies (issue 13, items 4 and 6)


def assert_openai_error(status: int, headers: dict, body: dict, expected_status: int) -> dict:
    """OpenAI's error object exactly: message, type, param, code; code a string or null."""
    assert status == expected_status, body
    assert headers["Content-Type"].startswith("application/json"), headers
    error = body["error"]
    assert set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body
    return error


async def test_every_error_the_router_answers_is_openai_json(stack: Stack) -> None:
    async def call(method: str, path: str, **kw) -> tuple[int, dict, dict]:
        async with stack.session.request(method, stack.url + path, **kw) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)

    error = assert_openai_error(*await call("GET", "/v1/nope"), 404)
    assert "/v1/nope" in error["message"]
    error = assert_openai_error(*await call("GET", "/v1/chat/completions"), 405)
    assert "GET" in error["message"]
    assert_openai_error(*await call("POST", "/v1/completions", data=b"{not json"), 400)
    error = assert_openai_error(*await call("POST", "/v1/completions", json={"model": "gpt-5", "prompt": "x"}), 404)
    assert error == {
        "message": "The model `gpt-5` does not exist or you do not have access to it.",  # OpenAI's
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    error = assert_openai_error(*await call("POST", "/v1/completions", json={"model": MODEL, "prompt": list(range(4097))}), 400)
    assert error["code"] == "context_length_exceeded"
    # Every engine down: the 502 says so without naming the engines' addresses.
    await stack.a.stop()
    await stack.b.stop()
    error = assert_openai_error(*await call("POST", "/v1/completions", json=completion()), 502)
    assert "127.0.0.1" not in error["message"] and "Cannot connect" not in error["message"], error
    # No worker serves the adapter asked for: 404, as when it is named as the model (not a 503: the client's error).
    error = assert_openai_error(*await call("POST", "/v1/completions", json=completion(lora_name="nobody")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "lora_name"
    # An adapter, salt or user that is not a string: 400 (they were hashed as their str()).
    for name, value in (("lora_name", [None]), ("cache_salt", 5), ("user", {"id": 1})):
        error = assert_openai_error(*await call("POST", "/v1/route", json=completion(**{name: value})), 400)
        assert error["param"] == name, error


SURROGATE_BODIES = [  # raw JSON: Python's json module cannot write a lone surrogate escape by accident
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (
        "/v1/chat/completions",
        (
            '{"model": "tiny", "messages": [{"role": "user", "content": '
            '[{"type": "text", "text": "ok"}, {"type": "text", "text": "\\udfff"}]}]}'
        ),
        "messages[0].content[1].text",
    ),
    (
        "/v1/chat/completions",
        (
            '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
            '"tools": [{"type": "function", "function": {"name": "f\\ud83d"}}]}'
        ),
        "tools[0].function.name",
    ),
    (
        "/v1/chat/completions",
        ('{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"extra": "\\udc00"}}'),
        "chat_template_kwargs.extra",
    ),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["fine", "\\ud800 not fine"]}', "prompt[1]"),
    ("/v1/route", '{"model": "tiny", "prompt": "x", "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/route", '{"model": "tiny", "prompt": "x", "user": "\\ud800"}', "user"),
]


@pytest.mark.parametrize(("path", "raw", "where"), SURROGATE_BODIES)
async def test_lone_surrogates_are_a_400(stack: Stack, path: str, raw: str, where: str) -> None:
    status, headers, body = await stack.post(path, raw.encode(), headers={"Content-Type": "application/json"})
    error = assert_openai_error(status, headers, body, 400)
    assert "surrogate" in error["message"] and where in error["message"], error
    assert not stack.a.received and not stack.b.received
    # A valid surrogate *pair* is one character and routes fine.
    fine = raw.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    fine = fine.replace('\\ud83d"', '\\ud83d\\ude00"').replace("\\udc00", "\\ud83d\\ude00")
    assert (await stack.post("/v1/route", fine.encode(), headers={"Content-Type": "application/json"}))[0] == 200


async def test_an_unexpected_exception_is_a_logged_json_500(stack: Stack, caplog, monkeypatch) -> None:
    async def broken_decide(*args, **kwargs):
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(stack.router, "decide", broken_decide)
    with caplog.at_level("ERROR"):
        status, headers, body = await stack.post("/v1/completions", completion())
    error = assert_openai_error(status, headers, body, 500)
    assert error["type"] == "server_error" and "a bug in the router" not in error["message"]
    logged = [r for r in caplog.records if r.exc_info and "a bug in the router" in str(r.exc_info[1])]
    assert logged, caplog.text


async def test_grpc_route_rejects_lone_surrogates_and_reports_bugs(stack: Stack, monkeypatch) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        # protobuf cannot serialize a lone surrogate, so the bytes are written by hand: field 3 of
        # RouteRequest is `prompt`; ED A0 80 is U+D800 as (invalid) UTF-8.
        raw_route = channel.unary_unary(
            "/kvroute.v1.Router/Route", request_serializer=lambda b: b, response_deserializer=pb.RouteResponse.FromString
        )
        model = pb.RouteRequest(model=MODEL).SerializeToString()
        prompt_field = pb.RouteRequest.DESCRIPTOR.fields_by_name["prompt"].number
        bad = model + bytes([prompt_field << 3 | 2, 3]) + b"\xed\xa0\x80"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_route(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
        # Past the character bound (4096 tokens of at most 13 characters): refused before tokenizing.
        before = stack.tokenizer.tokenized_chars
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RouterStub(channel).Route(pb.RouteRequest(model=MODEL, prompt="x" * 53249), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in err.value.details()
        assert stack.tokenizer.tokenized_chars == before

        async def broken_decide(*args, **kwargs):
            raise RuntimeError("a bug in the router")

        monkeypatch.setattr(stack.router, "decide", broken_decide)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RouterStub(channel).Route(pb.RouteRequest(model=MODEL, prompt=PROMPT), timeout=5)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "a bug in the router" not in err.value.details()


async def test_an_undecodable_session_header_is_a_400(stack: Stack) -> None:
    """aiohttp keeps header bytes that are not UTF-8 as lone surrogates; the session key is hashed as UTF-8."""
    body = json.dumps(completion()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", int(stack.url.rsplit(":", 1)[1]))
    writer.write(
        b"POST /v1/route HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"x-session-id: caf\xe9\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    response = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), response
    error = json.loads(payload)["error"]
    assert "x-session-id" in error["message"] and error["code"] is None, error


async def test_expect_100_continue_under_the_cap_is_served(stack: Stack) -> None:
    """The router answers Expect itself (to refuse bodies over the cap unsent); under it, the client goes on."""
    async with stack.session.post(stack.url + "/v1/completions", json=completion(), expect100=True) as resp:
        assert resp.status == 200 and (await resp.json())["backend"] in "AB"
    async with stack.session.post(stack.url + "/v1/completions", data=b"{not json", expect100=True) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- only the work the policy needs


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "session"])
async def test_load_policies_neither_tokenize_nor_query_a_proxied_request(tiny_model_dir, policy: str) -> None:
    s = await make_stack(tiny_model_dir, policy=policy)
    try:
        chars, queries = s.tokenizer.tokenized_chars, len(s.cp.queries)
        for body in (completion(), {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}):
            status, headers, answer = await s.post("/v1/chat/completions" if "messages" in body else "/v1/completions", body)
            assert status == 200 and headers["x-kvroute-worker"] in ("A", "B"), answer
        assert (s.tokenizer.tokenized_chars, len(s.cp.queries)) == (chars, queries)
        # Bad input is still refused, a prompt too long by its characters alone too.
        status, _, answer = await s.post("/v1/chat/completions", {"model": MODEL, "messages": []})
        assert status == 400 and answer["error"]["param"] == "messages"
        status, _, answer = await s.post("/v1/completions", completion(prompt="x" * 10_000_000))
        assert status in (400, 413), answer
        status, _, answer = await s.post("/v1/completions", completion(prompt=list(range(200_000))))
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert s.router.inflight.snapshot() == {}
    finally:
        await close_stack(s)


async def test_kv_aware_tokenizes_and_queries_once_per_request(stack: Stack) -> None:
    chars, queries = stack.tokenizer.tokenized_chars, len(stack.cp.queries)
    status, _, _ = await stack.post("/v1/completions", completion())
    assert status == 200
    assert stack.tokenizer.tokenized_chars > chars and len(stack.cp.queries) == queries + 1


async def test_fail_open_is_counted_by_reason_and_named_in_the_log(tiny_model_dir, caplog) -> None:
    s = await make_stack(tiny_model_dir, query_timeout_s=0.05)
    try:
        s.cp.query_delay_s = 1.0
        for _ in range(3):
            assert (await s.post("/v1/route", completion()))[2]["fail_open"] is True
        s.cp.query_delay_s, s.cp.empty_query = 0.0, True
        assert (await s.post("/v1/route", completion()))[2]["fail_open"] is True
        async with s.session.get(s.url + "/metrics") as resp:
            metrics = await resp.text()
        assert 'kvroute_router_fail_open_total{reason="deadline_exceeded"} 3.0' in metrics
        assert 'kvroute_router_fail_open_total{reason="index_empty"} 1.0' in metrics
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvroute.router" and "load alone" in r.getMessage()]
        assert len(warnings) == 2, warnings  # one per cause: the repeats are held back
        assert "longer than its fixed deadline (50.0 ms" in warnings[0]
    finally:
        await close_stack(s)
