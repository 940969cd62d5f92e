"""Property-based tests (hypothesis) of the router's HTTP request parsing, its gRPC `Router` handlers and
the control plane's gRPC handlers, against live processes over real sockets: a control plane, a sim
engine with its agent, and a router (HTTP and gRPC), shared by the module.

HTTP: whatever the body (random JSON with the routing fields' names, wrong types, lone UTF-16
surrogates, numbers past any integer or float, nesting past Python's recursion limit, bytes that are
not JSON, mutated and truncated valid bodies), the answer is never a 5xx, and every 4xx is OpenAI's
error JSON `{"error": {"message", "type", "param", "code"}}`; input that is bad by construction is a 4xx.
gRPC: bytes that are not the method's message are INVALID_ARGUMENT with a message (grpc's own
deserializer answered UNKNOWN); any other request is answered with a status a client can act on, never
UNKNOWN or INTERNAL; and nothing a refused agent stream sent is in the control plane's index.
"""

from __future__ import annotations

import http.client
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given
from hypothesis import strategies as st

from kvroute.tools.bench.fuzz_router import MAX_BODY_BYTES, MAX_PROMPT_TOKENS, is_openai_error
from kvroute.tools.local_cluster import LocalCluster, free_port, http_ok, http_post_json, wait_until
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

ACTIONABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
}
ROUTING_FIELDS = (
    "model",
    "prompt",
    "messages",
    "lora_name",
    "cache_salt",
    "user",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "max_tokens",
)
PATHS = st.sampled_from(("/v1/route", "/v1/completions", "/v1/chat/completions"))
WORKER_NUMBERS = itertools.count()  # hostile worker ids, one per example


@dataclass
class Fleet:
    cluster: LocalCluster
    url: str
    channel: grpc.Channel  # the router's gRPC port
    cp_channel: grpc.Channel  # the control plane's

    @property
    def model(self) -> str:
        return self.cluster.model

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def engine_keys(self) -> dict[str, list[int]]:
        reply = pb_grpc.ControlPlaneStub(self.cp_channel).GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id="engine-0"), timeout=5)
        return {pb.Tier.Name(tier.tier): sorted(tier.block_keys) for tier in reply.tiers}


@pytest.fixture(scope="module")
def fleet(module_local_fleet) -> Iterator[Fleet]:
    cluster = module_local_fleet("hostile-properties")
    cluster.start_sim_fleet(1)
    grpc_port = free_port()
    url = cluster.start_router(
        "hostile",
        "kv_aware",
        "--grpc-port",
        str(grpc_port),
        "--max-prompt-tokens",
        str(MAX_PROMPT_TOKENS),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
    )
    wait_until(lambda: http_ok(url + "/ready"), 30, "the router ready", cluster.all_processes())
    # Some blocks in the index, so that "nothing changed" means something.
    status, _ = http_post_json(url + "/v1/completions", {"model": cluster.model, "prompt": "hello " * 80, "max_tokens": 1})
    assert status == 200
    cluster.wait_audit_clean(timeout=10)
    with (
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        grpc.insecure_channel(cluster.control_plane_addr) as cp_channel,
    ):
        f = Fleet(cluster, url, channel, cp_channel)
        assert sum(map(len, f.engine_keys().values())) > 0
        yield f


# ---------------------------------------------------------------- HTTP

_LONE = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = st.text(max_size=12) | st.lists(st.text(max_size=4) | _LONE, min_size=1, max_size=4).map("".join)
NUMBERS = st.integers(-(2**80), 2**80) | st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 2**32 + 5)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(ROUTING_FIELDS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)


def assert_answer(status: int, body: bytes, what: object, must_fail: bool = False) -> None:
    assert status < 500, (what, status, body[:500])
    if status >= 400 or must_fail:
        assert 400 <= status < 500 and is_openai_error(status, body), (what, status, body[:500])


@given(PATHS, st.dictionaries(st.sampled_from(ROUTING_FIELDS), JSON, max_size=6), st.booleans())
def test_any_json_body_is_answered_never_with_a_5xx(fleet: Fleet, path: str, fields: dict, with_model: bool) -> None:
    body = {"model": fleet.model, **fields} if with_model and "model" not in fields else fields
    if path != "/v1/route" and "stream" not in body:
        body["max_tokens"] = 1
    status, answer = fleet.post(path, json.dumps(body).encode())
    assert_answer(status, answer, body)


_NOT_A_MODEL = st.none() | st.booleans() | NUMBERS | st.lists(JSON, max_size=3) | st.dictionaries(TEXT, JSON, max_size=3)
_NOT_A_PROMPT = (
    st.booleans()
    | NUMBERS
    | st.dictionaries(TEXT, JSON, max_size=3)
    | st.just([])
    | st.lists(
        st.none()
        | st.booleans()
        | st.floats(allow_nan=False)
        | st.integers(max_value=-1)
        | st.integers(min_value=2**32)
        | st.dictionaries(TEXT, JSON, max_size=2),
        min_size=1,
        max_size=4,
    )
)
_NOT_MESSAGES = (
    st.none()
    | st.booleans()
    | NUMBERS
    | TEXT
    | st.dictionaries(TEXT, JSON, max_size=3)
    | st.just([])
    | st.lists(st.none() | NUMBERS | TEXT | st.lists(JSON, max_size=2), min_size=1, max_size=3)
)


@given(PATHS, st.sampled_from(("model", "prompt", "messages")), st.data())
def test_a_routing_field_of_the_wrong_type_is_a_4xx_error(fleet: Fleet, path: str, name: str, data) -> None:
    chat = name == "messages" or (name == "model" and path == "/v1/chat/completions")
    if path == "/v1/completions" and name == "messages":
        path = "/v1/chat/completions"
    if path == "/v1/chat/completions" and name == "prompt":
        path = "/v1/completions"
    body: dict = {"model": fleet.model, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    body[name] = data.draw({"model": _NOT_A_MODEL, "prompt": _NOT_A_PROMPT, "messages": _NOT_MESSAGES}[name])
    status, answer = fleet.post(path, json.dumps(body).encode())
    assert_answer(status, answer, body, must_fail=True)


@given(
    PATHS,
    st.sampled_from(("model", "prompt", "user", "cache_salt", "lora_name", "content")),
    st.text(max_size=8),
    _LONE,
    st.text(max_size=8),
)
def test_a_lone_surrogate_in_any_routing_string_is_a_400(
    fleet: Fleet, path: str, where: str, before: str, lone: str, after: str
) -> None:
    if where == "prompt" and path == "/v1/chat/completions":
        path = "/v1/completions"  # a chat request's `prompt` is not read: the engine's business
    chat = path == "/v1/chat/completions" or (path == "/v1/route" and where == "content")
    body: dict = {"model": fleet.model, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    value = before + lone + after
    if where == "content":
        body["messages" if chat else "prompt"] = [{"role": "user", "content": value}] if chat else value
    else:
        body[where] = value
    status, answer = fleet.post(path, json.dumps(body).encode())  # ensure_ascii: written as \udXXX escapes
    assert_answer(status, answer, body, must_fail=True)
    assert json.loads(answer)["error"]["message"], answer


@given(PATHS, st.sampled_from(("body", "model", "prompt", "messages", "content")), st.integers(1, 60_000))
@example("/v1/route", "prompt", 100_000 // 2)  # msgspec raised RecursionError: a 500 before the fix
@example("/v1/completions", "body", 20_000)
@example("/v1/chat/completions", "content", 976)  # within msgspec's limit, past json's: the sim engine's 500
def test_nesting_past_the_recursion_limit_is_a_4xx(fleet: Fleet, path: str, where: str, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    if where == "body":
        raw = nested
    elif where == "content":
        raw = json.dumps({"model": fleet.model, "messages": [{"role": "user", "content": "N"}]}).replace('"N"', nested)
    else:
        raw = json.dumps({"model": fleet.model, where: "N"}).replace('"N"', nested)
    status, answer = fleet.post(path, raw.encode())
    assert_answer(status, answer, (where, depth), must_fail=where != "content" or depth > 5000)


@given(
    PATHS,
    st.sampled_from(("model", "prompt", "token", "max_tokens")),
    st.sampled_from(("1e400", "-1e400", "NaN", "Infinity", "-0.0", "1" + "0" * 4400, "-" + "9" * 40, "1E+999")),
    st.booleans(),
)
@example("/v1/route", "max_tokens", "1" + "0" * 4400, True)  # json's int limit raised ValueError: a 500 before the fix
def test_numbers_past_any_integer_or_float_are_answered(
    fleet: Fleet, path: str, where: str, number: str, with_surrogate: bool
) -> None:
    """`with_surrogate`: the body also holds a lone surrogate, which msgspec refuses, so that Python's json
    parses it again (for the surrogate's error) and meets the number too."""
    if path == "/v1/chat/completions":
        path = "/v1/completions"
    # The surrogate first: msgspec stops at the first error, and it must be the one that sends the body to json.
    raw = json.dumps({"user": "\ud800" if with_surrogate else "u", "model": fleet.model, "prompt": "hi", "max_tokens": 1})
    if where == "model":
        raw = raw.replace(json.dumps(fleet.model), number)
    elif where == "prompt":
        raw = raw.replace('"hi"', number)
    elif where == "token":
        raw = raw.replace('"hi"', f"[1, {number}]")
    else:
        raw = raw.replace('"max_tokens": 1', f'"max_tokens": {number}')
    status, answer = fleet.post(path, raw.encode())
    assert_answer(status, answer, raw[:200], must_fail=where != "max_tokens" or with_surrogate)


@given(PATHS, st.binary(max_size=200), st.data())
def test_bytes_that_are_not_json_and_mutated_bodies_are_answered(fleet: Fleet, path: str, noise: bytes, data) -> None:
    valid = json.dumps({"model": fleet.model, "prompt": "the cache router", "max_tokens": 1}).encode()
    how = data.draw(st.sampled_from(("noise", "truncate", "flip", "splice")))
    if how == "noise":
        raw = noise
    elif how == "truncate":
        raw = valid[: data.draw(st.integers(0, len(valid) - 1))]
    elif how == "flip":
        at = data.draw(st.integers(0, len(valid) - 1))
        raw = valid[:at] + bytes([valid[at] ^ data.draw(st.integers(1, 255))]) + valid[at + 1 :]
    else:
        at = data.draw(st.integers(0, len(valid)))
        raw = valid[:at] + noise + valid[at:]
    try:
        json.loads(raw)
        must_fail = False
    except ValueError:
        must_fail = True
    status, answer = fleet.post(path, raw)
    assert_answer(status, answer, raw, must_fail=must_fail)


def test_regression_a_body_that_is_not_utf8_is_refused_by_the_router(fleet: Fleet) -> None:
    """Found by `kvroute bench fuzz --target router-http`: msgspec does not check the text of fields the
    router does not read, so a body with bytes that are not UTF-8 there went on to the engine."""
    before = fleet.engine_keys()
    for raw in (
        b'{"model": "tiny-llama", "max_to\xc4ens": 1, "prompt": "hi"}',
        b'{"model": "tiny-llama", "prompt": "hi", "temperature": "\xff\xfe"}',
    ):
        status, answer = fleet.post("/v1/completions", raw)
        assert status == 400 and is_openai_error(status, answer), answer
        error = json.loads(answer)["error"]
        assert error["type"] == "invalid_request_error" and "UTF-8" in error["message"], error
    assert fleet.engine_keys() == before  # the engine never saw them


# ---------------------------------------------------------------- gRPC: what a method's bytes must give


def expect_answer(channel: grpc.Channel, path: str, request_type, payload: bytes) -> grpc.StatusCode:
    """Call `path` with raw bytes; the status must be one a client can act on, with a message when it is
    not OK, and INVALID_ARGUMENT when the bytes are not `request_type`."""
    try:
        channel.unary_unary(path)(payload, timeout=10)
        code, detail = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, detail = exc.code(), exc.details()
    assert code in ACTIONABLE, (path, payload, code, detail)
    assert code == grpc.StatusCode.OK or detail, (path, payload, code)
    if not parses(request_type, payload):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and request_type.DESCRIPTOR.full_name in detail, (code, detail)
    return code


def parses(request_type, payload: bytes) -> bool:
    try:
        request_type.FromString(payload)
    except DecodeError:
        return False
    return True


def with_bad_string(message, field: str, text: bytes = b"\xed\xa0\x80") -> bytes:
    """`message` with `field` (a string) set to bytes that are not UTF-8 (protobuf cannot write them itself)."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    return message.SerializeToString() + bytes([number << 3 | 2, len(text)]) + text


ROUTER_METHODS = {
    "/kvroute.v1.Router/Route": pb.RouteRequest,
    "/kvroute.v1.Router/PrefillDone": pb.ReservationRef,
    "/kvroute.v1.Router/Release": pb.ReleaseRequest,
}
CP_UNARY = {
    "/kvroute.v1.ControlPlane/Query": pb.QueryRequest,
    "/kvroute.v1.ControlPlane/ListWorkers": pb.ListWorkersRequest,
    "/kvroute.v1.ControlPlane/GetWorkerKeys": pb.GetWorkerKeysRequest,
}


@given(st.sampled_from(sorted(ROUTER_METHODS)), st.binary(max_size=80))
@example("/kvroute.v1.Router/Route", b"\xff\xff\xff")
@example("/kvroute.v1.Router/Release", b"\x0a\x05ab")
def test_router_grpc_bytes_are_invalid_argument_when_they_do_not_parse(fleet: Fleet, method: str, payload: bytes) -> None:
    expect_answer(fleet.channel, method, ROUTER_METHODS[method], payload)


@st.composite
def route_requests(draw, model: str) -> pb.RouteRequest:
    request = pb.RouteRequest(
        model=draw(st.sampled_from((model, "", "other-model")) | st.text(max_size=8)),
        lora_name=draw(st.text(max_size=4)),
        cache_salt=draw(st.text(max_size=4)),
        session_id=draw(st.text(max_size=4)),
        explain=draw(st.booleans()),
        reserve=draw(st.booleans()),
        reservation_ttl_ms=draw(st.integers(0, 2**32 - 1)),
    )
    kind = draw(st.sampled_from(("prompt", "token_ids", "messages", "none")))
    if kind == "prompt":
        request.prompt = draw(st.text(max_size=300))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=MAX_PROMPT_TOKENS + 2)))
    elif kind == "messages":
        for _ in range(draw(st.integers(0, 3))):
            m = request.messages.messages.add(
                role=draw(st.sampled_from(("user", "system", "assistant", "", "tool")) | st.text(max_size=5)),
                content=draw(st.text(max_size=40)),
            )
            for _ in range(draw(st.integers(0, 2))):
                m.parts.add(type=draw(st.sampled_from(("text", "", "image_url"))), text=draw(st.text(max_size=20)))
    for _ in range(draw(st.integers(0, 2))):
        request.tools.add(
            name=draw(st.text(max_size=6)),
            parameters_json=draw(st.sampled_from(("", "{}", "{", "[" * 5000, '{"type": "object"}', "nan", '"\\ud800"'))),
        )
    return request


@given(st.data())
def test_any_route_request_is_answered_with_a_status_a_client_can_act_on(fleet: Fleet, data) -> None:
    request = data.draw(route_requests(fleet.model))
    code = expect_answer(fleet.channel, "/kvroute.v1.Router/Route", pb.RouteRequest, request.SerializeToString())
    if code == grpc.StatusCode.OK and request.reserve:
        pass  # its reservation expires with its TTL; releasing is the application's business


@given(
    st.sampled_from(("model", "prompt", "lora_name", "cache_salt", "session_id")),
    st.sampled_from((b"\xed\xa0\x80", b"\xff", b"a\xc3", b"\xf8\x88\x80\x80\x80")),
)
def test_a_route_string_that_is_not_utf8_is_invalid_argument(fleet: Fleet, field: str, text: bytes) -> None:
    payload = with_bad_string(pb.RouteRequest(model=fleet.model, token_ids=pb.TokenIds(ids=[1, 2, 3])), field, text)
    assert expect_answer(fleet.channel, "/kvroute.v1.Router/Route", pb.RouteRequest, payload) == grpc.StatusCode.INVALID_ARGUMENT


def test_regression_a_tool_schema_nested_past_the_recursion_limit_is_invalid_argument(fleet: Fleet) -> None:
    """Found by `kvroute bench fuzz --target router-grpc`: json.loads raised RecursionError (not a
    ValueError) on parameters_json, and Route answered INTERNAL."""
    request = pb.RouteRequest(model=fleet.model, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]))
    request.tools.add(name="f", parameters_json="[" * 100_000)
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.RouterStub(fleet.channel).Route(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parameters_json" in err.value.details()


# ---------------------------------------------------------------- gRPC: the control plane


@given(st.sampled_from(sorted(CP_UNARY)), st.binary(max_size=80))
@example("/kvroute.v1.ControlPlane/Query", b"\xff\xff\xff")  # grpc's deserializer: UNKNOWN before the fix
@example("/kvroute.v1.ControlPlane/GetWorkerKeys", b"\x0a\x03\xed\xa0\x80")  # a worker id that is not UTF-8
def test_control_plane_bytes_are_invalid_argument_when_they_do_not_parse(fleet: Fleet, method: str, payload: bytes) -> None:
    expect_answer(fleet.cp_channel, method, CP_UNARY[method], payload)


def stream(channel: grpc.Channel, method: str, messages: list[bytes]) -> tuple[grpc.StatusCode, str]:
    call = channel.stream_stream(f"/kvroute.v1.ControlPlane/{method}")(iter(messages), timeout=10)
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass
    return call.code(), call.details() or ""


def unparseable(message_type) -> st.SearchStrategy[bytes]:
    """Bytes that are not `message_type` (random bytes often are; those that parse get a field of wire type 7)."""
    return st.binary(max_size=40).map(lambda b: b if not parses(message_type, b) else b + b"\x0f")


AGENT_MESSAGE_BYTES = unparseable(pb.AgentMessage) | st.builds(
    lambda seq, keys, tier, usage: (
        pb.AgentMessage(
            batch=pb.EventBatch(seq=seq, events=[pb.BlockEvent(stored=pb.BlocksStored(block_keys=keys, tier=tier))])
        ).SerializeToString()
        if usage is None
        else pb.AgentMessage(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(kv_usage=usage))).SerializeToString()
    ),
    st.integers(0, 2**64 - 1).filter(lambda s: s != 1),
    st.lists(st.integers(0, 2**64 - 1), max_size=4),
    st.integers(-(2**31), 2**31 - 1),  # any tier value, known or not (proto3 enums are open)
    st.none() | st.floats(width=32).filter(lambda u: not 0 <= u <= 1),
)


@given(st.lists(AGENT_MESSAGE_BYTES, min_size=1, max_size=4), st.integers(0, 3), st.booleans())
@example([b"\xff"], 0, True)
def test_a_refused_agent_stream_applies_nothing(fleet: Fleet, messages: list[bytes], bad_register: int, instance: bool) -> None:
    """A registration without worker id, model or block size, then anything: refused, nothing registered.
    A good registration, then batches out of sequence, heartbeats with a kv_usage outside 0..1, or bytes that
    are not an AgentMessage: refused, and not one block of it in the index."""
    before = fleet.engine_keys()
    worker_id = f"hostile-{next(WORKER_NUMBERS)}"
    register = pb.RegisterWorker(
        worker_id=worker_id,
        model=fleet.model,
        engine="sim",
        block_size=16,
        endpoint="http://127.0.0.1:9",
        agent_instance="x" if instance else "",
    )
    if bad_register == 1:
        register.worker_id = ""
    elif bad_register == 2:
        register.model = ""
    elif bad_register == 3:
        register.block_size = 0
    code, detail = stream(fleet.cp_channel, "Connect", [pb.AgentMessage(register=register).SerializeToString(), *messages])
    assert code in ACTIONABLE - {grpc.StatusCode.OK} and detail, (code, detail)
    if bad_register:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    first = messages[0]
    if not parses(pb.AgentMessage, first):
        assert code == grpc.StatusCode.INVALID_ARGUMENT or bad_register, (code, detail)
    keys = pb_grpc.ControlPlaneStub(fleet.cp_channel).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert all(w.cached_blocks == 0 for w in keys.workers if w.worker_id == worker_id)
    try:
        held = pb_grpc.ControlPlaneStub(fleet.cp_channel).GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id=worker_id), timeout=5)
        assert all(not tier.block_keys for tier in held.tiers), held
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
    assert fleet.engine_keys() == before


@pytest.mark.parametrize("kv_usage", [float("nan"), float("inf"), -0.5, 1.5])
def test_regression_a_heartbeat_kv_usage_outside_0_1_is_invalid_argument(fleet: Fleet, kv_usage: float) -> None:
    """Found by `kvroute bench fuzz --target control-plane`: the load was stored as sent, and policies
    compare and add kv_usage (a NaN makes every comparison false)."""
    worker_id = f"hostile-usage-{next(WORKER_NUMBERS)}"
    register = pb.RegisterWorker(
        worker_id=worker_id, model=fleet.model, engine="sim", block_size=16, endpoint="http://127.0.0.1:9"
    )
    code, detail = stream(
        fleet.cp_channel,
        "Connect",
        [
            pb.AgentMessage(register=register).SerializeToString(),
            pb.AgentMessage(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(kv_usage=kv_usage))).SerializeToString(),
        ],
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "kv_usage" in detail, (code, detail)


@pytest.mark.parametrize("endpoint", ["", "10.0.0.7:8000", "ftp://x", "http://[::1", "http://h:99999", "http://a b"])
def test_regression_a_registration_whose_endpoint_is_no_url_is_invalid_argument(fleet: Fleet, endpoint: str) -> None:
    """A worker registered with an endpoint routers cannot send to: every request routed there failed (a 500,
    before the router's own fix). Refused at registration, and the worker is not listed."""
    worker_id = f"hostile-endpoint-{next(WORKER_NUMBERS)}"
    register = pb.RegisterWorker(worker_id=worker_id, model=fleet.model, engine="sim", block_size=16, endpoint=endpoint)
    code, detail = stream(fleet.cp_channel, "Connect", [pb.AgentMessage(register=register).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "endpoint" in detail, (code, detail)
    workers = pb_grpc.ControlPlaneStub(fleet.cp_channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
    assert worker_id not in {w.worker_id for w in workers}


ROUTER_MESSAGE_BYTES = st.binary(max_size=40) | st.builds(
    lambda block_size, twice, worker: (
        pb.RouterMessage(
            query=pb.QueryRequest(model="m", chains=[pb.KeyChain(block_size=block_size, block_keys=[1])] * (2 if twice else 1))
        )
        if worker is None
        else pb.RouterMessage(reserve=pb.Reservation(reservation_id=1, worker_id=worker))
    ).SerializeToString(),
    st.integers(0, 64),
    st.booleans(),
    st.none() | st.just("") | st.text(max_size=4),
)


@given(st.booleans(), st.lists(ROUTER_MESSAGE_BYTES, max_size=4))
def test_any_router_session_is_answered_with_a_status_a_client_can_act_on(
    fleet: Fleet, hello: bool, messages: list[bytes]
) -> None:
    before = fleet.engine_keys()
    first = [pb.RouterMessage(hello=pb.RouterHello(router_id="hostile")).SerializeToString()] if hello else []
    code, detail = stream(fleet.cp_channel, "RouterSession", [*first, *messages])
    assert code in ACTIONABLE and (code == grpc.StatusCode.OK or detail), (code, detail)
    if any(not parses(pb.RouterMessage, m) for m in messages[:1]):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, detail)
    assert fleet.engine_keys() == before
