"""The router targets of `kvroute bench fuzz`: a control plane, a sim engine with its agent and a router,
each its own process, and this process as a hostile client of the router's HTTP API (`router-http`) or
its gRPC `Router` API (`router-grpc`), with valid requests in between.

router-http sends, in a seeded random order:
- bad requests that must be a 4xx with OpenAI's error JSON (`{"error": {"message", "type", "param",
  "code"}}`): bodies that are not JSON or not an object, truncated bodies, every routing field with a
  wrong type, lone UTF-16 surrogates, numbers past any integer or float, arrays nested 100,000 deep,
  an unknown model, prompts over --max-prompt-tokens, bodies over --max-body-bytes, unknown paths,
  wrong methods, a session header that is not UTF-8;
- HTTP framing aiohttp refuses before any handler runs (no request line, a bad version, duplicate or
  non-numeric Content-Length, a header over 8 KiB, bad chunking, a TLS handshake): a 4xx, which is
  aiohttp's own plain-text 400, not the error JSON (no kvroute code sees those bytes);
- random requests (byte-mutated valid bodies, random JSON with the routing fields' names): any
  answer but a 5xx, and a 4xx must be the error JSON;
- valid requests (about one per four bad ones): POST /v1/route and, one in five, /v1/completions
  through the router to the engine, some with client headers beyond Latin-1: each must be a 200.
router-grpc does the same with bytes that are not the method's message (INVALID_ARGUMENT), strings
that are not UTF-8 (INVALID_ARGUMENT), semantically bad requests (INVALID_ARGUMENT or NOT_FOUND),
random and mutated messages (any status but UNKNOWN and INTERNAL), and valid Route calls, some
reserving and then releasing.

Then: every process alive, every port's health check (router HTTP and gRPC, control plane, engine,
agent) answers within 1 s, and `kvroute audit`
finds the control plane's index equal to the engine's cache (the engine's events for the proxied
valid requests all applied); for router-grpc, the router holds no reservation once every one that was
granted has been released (no refused call made one).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.tools.bench.fuzz import FuzzReport, Outcomes, unparseable_bytes
from kvroute.tools.local_cluster import LocalCluster, free_port, http_get, http_ok, wait_until
from kvroute.tools.tiny_model import build_model_dir
from kvroute.v1 import kvroute_pb2 as pb

MAX_PROMPT_TOKENS = 512  # the router's --max-prompt-tokens here: small, so a prompt over it is cheap to send
MAX_BODY_BYTES = 64 << 10  # its --max-body-bytes
BAD_PER_VALID = 4
PROXIED_EVERY = 5  # one valid request in this many goes through to the engine (the rest: /v1/route)
TIMEOUT_S = 10.0  # an answer slower than this is a hang
WORDS = ["the", "cache", "router", "sends", "each", "prompt", "to", "the", "worker", "that", "holds", "its", "longest", "prefix"]


@dataclass
class RouterFleet:
    cluster: LocalCluster
    url: str
    grpc_target: str

    @property
    def model(self) -> str:
        return self.cluster.model

    def processes(self):
        return self.cluster.all_processes()


def start_fleet(workdir: Path) -> RouterFleet:
    model_dir = build_model_dir(workdir / "model" / "tiny-llama")
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=model_dir)
    try:
        cluster.start_sim_fleet(1)
        grpc_port = free_port()
        url = cluster.start_router(
            "fuzz",
            "kv_aware",
            "--grpc-port",
            str(grpc_port),
            "--max-prompt-tokens",
            str(MAX_PROMPT_TOKENS),
            "--max-body-bytes",
            str(MAX_BODY_BYTES),
        )
        fleet = RouterFleet(cluster, url, f"127.0.0.1:{grpc_port}")
        # Ready: it has the fleet from the control plane (before that, a request is a 503 no_workers), and its
        # gRPC health, which follows readiness every 0.5 s, says so too.
        wait_until(lambda: http_ok(url + "/ready") and health_ms(fleet) < 1000, 30, "the router ready", cluster.all_processes())
    except BaseException:
        cluster.stop()
        raise
    return fleet


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def health_ms(fleet: RouterFleet) -> float:
    """The slowest health answer of every port: the router's HTTP /health and gRPC health, the control
    plane's gRPC health, the engine's and its agent's /health; inf when one fails or takes over 1 s."""
    engine = fleet.cluster.engines[0]
    slowest = 0.0
    for url in (fleet.url, engine.url, engine.agent_metrics_url):
        started = time.monotonic()
        try:
            status, _ = http_get(url + "/health", 1.0)
        except OSError:
            return float("inf")
        slowest = max(slowest, time.monotonic() - started)
        if status != 200:
            return float("inf")
    for target in (fleet.grpc_target, fleet.cluster.control_plane_addr):
        started = time.monotonic()
        try:
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return float("inf")
        slowest = max(slowest, time.monotonic() - started)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return float("inf")
    return slowest * 1000 if slowest < 1.0 else float("inf")


def reservations_held(fleet: RouterFleet) -> float | None:
    """The router's kvroute_router_reservations_held gauge (Route reservations not yet released)."""
    try:
        status, body = http_get(fleet.url + "/metrics", 2.0)
    except OSError:
        return None
    for line in body.decode().splitlines() if status == 200 else ():
        if line.startswith("kvroute_router_reservations_held "):
            return float(line.split()[1])
    return None


def audit_clean(fleet: RouterFleet) -> tuple[bool, dict]:
    try:
        audit = fleet.cluster.wait_audit_clean(timeout=30)
    except TimeoutError as exc:
        return False, {"audit": str(exc)[-500:]}
    return True, {"audit": [a.to_json() for a in audit.audits]}


# ---------------------------------------------------------------- HTTP


@dataclass
class HttpRequest:
    kind: str
    # "4xx": a 4xx error JSON; "any": anything but a 5xx (a 4xx the error JSON); "200"; "4xx text": a 4xx,
    # whatever its body (HTTP framing aiohttp refuses before any handler: its own plain-text 400)
    expect: str
    path: str = "/v1/route"
    body: bytes = b""
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""  # sent as it is on a new connection, instead of method/path/headers/body


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


class HttpTraffic:
    def __init__(self, rng: random.Random, model: str) -> None:
        self.rng, self.model = rng, model

    def valid_body(self, chat: bool | None = None) -> dict:
        rng = self.rng
        chat = rng.random() < 0.5 if chat is None else chat
        body: dict = {"model": self.model, "max_tokens": rng.randint(1, 4)}
        if chat:
            body["messages"] = [
                {"role": "system", "content": text(rng, 12)},
                {"role": "user", "content": text(rng, rng.randint(1, 40))},
            ]
        else:
            body["prompt"] = text(rng, rng.randint(1, 60))
        if rng.random() < 0.2:
            body["user"] = f"user-{rng.randrange(100)}"
        return body

    def valid(self, proxied: bool) -> HttpRequest:
        body = self.valid_body()
        path = ("/v1/chat/completions" if "messages" in body else "/v1/completions") if proxied else "/v1/route"
        # Headers the router passes on to the engine as they came: any text, also beyond Latin-1.
        headers = (
            {"X-Client-Note": self.rng.choice(("plain", "café", "日本語のメモ", "emoji 🙂", "caf\udce9"))}
            if self.rng.random() < 0.3
            else {}
        )
        return HttpRequest("valid", "200", path, _json(body), headers=headers)

    def bad(self) -> HttpRequest:
        rng = self.rng
        kind = rng.choice(
            (
                "not_json",
                "truncated",
                "not_object",
                "wrong_type",
                "wrong_type",
                "surrogate",
                "huge_number",
                "deep_nesting",
                "unknown_model",
                "too_long",
                "too_large",
                "bad_path",
                "bad_header",
                "framing",
                "mutated",
                "mutated",
                "random_json",
            )
        )
        path = rng.choice(("/v1/route", "/v1/route", "/v1/completions", "/v1/chat/completions"))
        body = self.valid_body(chat=path.endswith("chat/completions") or (path == "/v1/route" and rng.random() < 0.5))
        if kind == "not_json":
            raw = rng.randbytes(rng.randrange(0, 64))
            while _is_json(raw):
                raw = b"\x00" + raw
            return HttpRequest(kind, "4xx", path, raw)
        if kind == "truncated":
            raw = _json(body)
            return HttpRequest(kind, "4xx", path, raw[: rng.randrange(len(raw))])
        if kind == "not_object":
            return HttpRequest(kind, "4xx", path, _json(rng.choice(([], [body], "text", 12, 1.5, None, True))))
        if kind == "wrong_type":
            prompt_field = "messages" if "messages" in body else "prompt"
            name = rng.choice(("model", prompt_field))
            body[name] = rng.choice(_WRONG[name])
            return HttpRequest(f"{kind}:{name}", "4xx", path, _json(body))
        if kind == "surrogate":
            name = rng.choice(("model", "user", "cache_salt", "lora_name", "messages" if "messages" in body else "prompt"))
            lone = rng.choice(("\ud800", "\udfff", "a\udc00b", "\ud83d"))
            if name == "messages":
                body["messages"][-1]["content"] += lone
            elif name == "prompt":
                body["prompt"] += lone
            else:
                body[name] = lone
            return HttpRequest(f"{kind}:{name}", "4xx", path, json.dumps(body).encode())  # ensure_ascii: \udXXX escapes
        if kind == "huge_number":
            huge = rng.choice(("1e400", "-1e400", "1" + "0" * rng.randrange(20, 5000), "-" + "9" * 30))
            where = rng.choice(("model", "prompt", "token"))
            body.pop("messages", None)
            body["prompt"] = "x"
            raw = _json(body).decode()
            if where == "model":
                raw = raw.replace(json.dumps(self.model), huge, 1)
            elif where == "prompt":
                raw = raw.replace('"x"', huge, 1)
            else:
                raw = raw.replace('"x"', f"[1, {huge}, 2]", 1)
            return HttpRequest(f"{kind}:{where}", "4xx", path if path != "/v1/chat/completions" else "/v1/route", raw.encode())
        if kind == "deep_nesting":
            depth = rng.choice((1_000, 10_000, 100_000))
            where = rng.choice(("prompt", "messages", "model", "body"))
            nested = "[" * depth + "]" * depth
            if where == "body":
                raw = nested
            else:
                raw = json.dumps({"model": self.model, where: "NESTED"}).replace('"NESTED"', nested)
            return HttpRequest(f"{kind}:{where}", "4xx", path, raw.encode())
        if kind == "unknown_model":
            body["model"] = rng.choice(("", "gpt-4", "tiny-llama ", "x" * 300))
            return HttpRequest(kind, "4xx", path, _json(body))
        if kind == "too_long":
            body.pop("messages", None)
            body["prompt"] = rng.choice((" ".join(["word"] * (MAX_PROMPT_TOKENS + 50)), [7] * (MAX_PROMPT_TOKENS + 1)))
            return HttpRequest(kind, "4xx", "/v1/route" if path == "/v1/chat/completions" else path, _json(body))
        if kind == "too_large":
            body.pop("messages", None)
            body["prompt"] = "y" * (MAX_BODY_BYTES + rng.randrange(1, 4096))
            return HttpRequest(kind, "4xx", "/v1/route" if path == "/v1/chat/completions" else path, _json(body))
        if kind == "bad_path":
            method, bad_path = rng.choice(
                (
                    ("POST", "/v1/nothing"),
                    ("GET", "/v1/completions"),
                    ("PUT", "/v1/route"),
                    ("POST", "/v1/models"),
                    ("DELETE", "/health"),
                    ("POST", "/%ff%fe"),
                )
            )
            return HttpRequest(kind, "4xx", bad_path, _json(body), method)
        if kind == "bad_header":
            return HttpRequest(kind, "4xx", path, _json(body), headers={"x-session-id": "caf\udce9 \udcff"})
        if kind == "framing":
            raw = _json(body)
            head = rng.choice(
                (
                    b"GARBAGE / HTTP/1.1",
                    b"POST /v1/route HTTP/9.9",
                    b"POST /v1/rou\x00te HTTP/1.1",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello's start
                    b"POST " + path.encode() + b" HTTP/1.1",
                )
            )
            headers = rng.choice(
                (
                    b"Content-Length: abc",
                    b"Content-Length: 2\r\nContent-Length: 3",
                    b"Bad Header: 1",
                    b"X-Big: " + b"a" * 9000,
                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0",
                    b"Content-Length: -5",
                )
            )
            return HttpRequest(kind, "4xx text", path, raw=head + b"\r\nHost: r\r\n" + headers + b"\r\n\r\n" + raw)
        if kind == "mutated":
            raw = bytearray(_json(body))
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            return HttpRequest(kind, "any", path, bytes(raw))
        return HttpRequest(kind, "any", path, _json(random_json(rng, 4)))


_WRONG: dict[str, list] = {
    "model": [12, 1.5, True, None, [], ["tiny-llama"], {"name": "tiny-llama"}],
    "prompt": [None, 12, 1.5, True, {}, [], [[]], [-1], [2**32], [1.5], [True], ["a", 1], [[1, 2], "b", [-3]], {"text": "x"}],
    "messages": [
        None,
        "hello",
        12,
        {},
        [],
        [1],
        ["hi"],
        [{}],
        [{"role": 5, "content": "x"}],
        [{"role": None}],
        [{"role": "user", "content": "x"}, 7],
    ],
}
_FIELD_NAMES = (
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
    "stream",
)


def random_json(rng: random.Random, depth: int) -> object:
    roll = rng.random()
    if depth <= 0 or roll < 0.4:
        return rng.choice(
            (
                None,
                True,
                False,
                rng.randrange(-(2**70), 2**70),
                rng.random() * 10 ** rng.randrange(-5, 300),
                text(rng, rng.randrange(4)),
                "tiny-llama",
                "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(8))),
            )
        )
    if roll < 0.7:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(_FIELD_NAMES) if rng.random() < 0.7 else text(rng, 1): random_json(rng, depth - 1)
        for _ in range(rng.randrange(5))
    }


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def is_openai_error(status: int, body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    # The router's own errors say invalid_request_error or server_error; an engine's, passed through, its own
    # (vLLM: BadRequestError), in the same shape.
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and bool(error["message"])
        and isinstance(error["type"], str)
    )


class HttpClient:
    """One keep-alive connection, opened again when the router closes it (it does after a 413)."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.conn: http.client.HTTPConnection | None = None

    def send(self, req: HttpRequest) -> tuple[int, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
            try:
                self.conn.putrequest(req.method, req.path, skip_accept_encoding=True)
                headers = {"Content-Type": "application/json", "Content-Length": str(len(req.body)), **req.headers}
                for name, value in headers.items():  # UTF-8 (a surrogate escape: that byte as it is)
                    self.conn.putheader(name, value.encode("utf-8", "surrogateescape"))
                self.conn.endheaders(req.body)
                response = self.conn.getresponse()
                body = response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.close()
                return response.status, body
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine, BrokenPipeError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def send_raw(self, raw: bytes) -> tuple[int, bytes]:
        """`raw` on a connection of its own; (status, body) of what comes back before the router closes it."""
        with socket.create_connection((self.host, self.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(raw)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), body

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def http_outcome(req: HttpRequest, status: int, body: bytes) -> tuple[str, bool]:
    """(what came back, whether it is what `req.expect` allows)."""
    error_json = is_openai_error(status, body)
    got = f"{status}{'' if status < 400 or error_json else ' NOT error JSON'}"
    if req.expect == "200":
        return got, status == 200
    if req.expect == "4xx":
        return got, 400 <= status < 500 and error_json
    if req.expect == "4xx text":
        return f"{status}", 400 <= status < 500
    return got, status < 500 and (status < 400 or error_json)


def run_http(fleet: RouterFleet, messages: int, seed: int, outcomes: Outcomes) -> None:
    rng = random.Random(seed)
    traffic, client = HttpTraffic(rng, fleet.model), HttpClient(fleet.url)
    valid = 0
    try:
        for i in range(messages):
            if i % BAD_PER_VALID == 0:
                valid += 1
                send(client, traffic.valid(proxied=valid % PROXIED_EVERY == 0), outcomes)
            send(client, traffic.bad(), outcomes)
        send(client, traffic.valid(proxied=True), outcomes)
    finally:
        client.close()


def send(client: HttpClient, req: HttpRequest, outcomes: Outcomes) -> None:
    started = time.monotonic()
    try:
        status, body = client.send_raw(req.raw) if req.raw else client.send(req)
    except TimeoutError:
        outcomes.add(req.kind, req.expect, "timeout", False, hang=True)
        client.close()
        return
    except OSError as exc:
        outcomes.add(req.kind, req.expect, f"connection error: {type(exc).__name__}", False)
        return
    got, ok = http_outcome(req, status, body)
    outcomes.add(
        req.kind,
        req.expect,
        got,
        ok,
        seconds=time.monotonic() - started,
        example=None
        if ok
        else f"{req.method} {req.path} {req.headers} {(req.raw or req.body)[:300]!r} -> {status} {body[:300]!r}",
    )


# ---------------------------------------------------------------- gRPC

_ROUTE, _PREFILL_DONE, _RELEASE = "/kvroute.v1.Router/Route", "/kvroute.v1.Router/PrefillDone", "/kvroute.v1.Router/Release"
_REQUEST_TYPES = {_ROUTE: pb.RouteRequest, _PREFILL_DONE: pb.ReservationRef, _RELEASE: pb.ReleaseRequest}
_BAD_CODES = frozenset(
    {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
)
INVALID, NOT_FOUND, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK


def lone_surrogate_string(message: pb.RouteRequest, field_name: str) -> bytes:
    """`message` with a string field holding U+D800 as (invalid) UTF-8: protobuf cannot write that itself."""
    number = pb.RouteRequest.DESCRIPTOR.fields_by_name[field_name].number
    return message.SerializeToString() + bytes([number << 3 | 2, 4]) + b"a\xed\xa0\x80"


@dataclass
class GrpcCall:
    kind: str
    method: str
    payload: bytes
    expect: frozenset | None  # the statuses allowed; None: any but UNKNOWN, INTERNAL, DEADLINE_EXCEEDED, UNAVAILABLE


class GrpcTraffic:
    def __init__(self, rng: random.Random, model: str) -> None:
        self.rng, self.model = rng, model

    def valid_route(self, reserve: bool = False) -> pb.RouteRequest:
        rng = self.rng
        request = pb.RouteRequest(model=self.model, reserve=reserve, session_id=f"s{rng.randrange(50)}")
        roll = rng.random()
        if roll < 0.4:
            request.prompt = text(rng, rng.randint(1, 60))
        elif roll < 0.7:
            request.token_ids.ids.extend(rng.randrange(2000) for _ in range(rng.randint(1, 200)))
        else:
            request.messages.messages.add(role="user", content=text(rng, rng.randint(1, 40)))
        return request

    def bad(self) -> GrpcCall:
        rng = self.rng
        kind = rng.choice(
            (
                "unparseable",
                "unparseable",
                "surrogate",
                "semantic",
                "semantic",
                "semantic",
                "unknown_reservation",
                "mutated",
                "random",
            )
        )
        method = rng.choice((_ROUTE, _ROUTE, _PREFILL_DONE, _RELEASE))
        if kind == "unparseable":
            return GrpcCall(kind, method, unparseable_bytes(rng, _REQUEST_TYPES[method]), frozenset({INVALID}))
        if kind == "surrogate":
            where = rng.choice(("model", "prompt", "lora_name", "cache_salt", "session_id"))
            return GrpcCall(f"{kind}:{where}", _ROUTE, lone_surrogate_string(self.valid_route(), where), frozenset({INVALID}))
        if kind == "unknown_reservation":
            message = (pb.ReservationRef if method == _PREFILL_DONE else pb.ReleaseRequest)(reservation_id=rng.getrandbits(64))
            return GrpcCall(kind, _RELEASE if method == _ROUTE else method, message.SerializeToString(), frozenset({NOT_FOUND}))
        if kind == "semantic":
            name, request, codes = rng.choice(_SEMANTIC)(self)
            return GrpcCall(f"{kind}:{name}", _ROUTE, request.SerializeToString(), codes)
        if kind == "mutated":
            raw = bytearray(self.valid_route().SerializeToString())
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            return GrpcCall(kind, _ROUTE, bytes(raw), None)
        return GrpcCall(kind, method, rng.randbytes(rng.randrange(64)), None)


def _semantic_no_model(t: GrpcTraffic):
    r = t.valid_route()
    r.model = ""
    return "no_model", r, frozenset({INVALID})


def _semantic_unknown_model(t: GrpcTraffic):
    r = t.valid_route()
    r.model = t.rng.choice(("gpt-4", "tiny-llama ", "x" * 300))
    return "unknown_model", r, frozenset({NOT_FOUND})


def _semantic_no_input(t: GrpcTraffic):
    return "no_input", pb.RouteRequest(model=t.model), frozenset({INVALID})


def _semantic_empty_token_ids(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model)
    r.token_ids.SetInParent()
    return "empty_token_ids", r, frozenset({INVALID})


def _semantic_tools_without_messages(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model, prompt="x")
    r.tools.add(name="f")
    return "tools_without_messages", r, frozenset({INVALID})


def _semantic_parts_and_content(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model)
    m = r.messages.messages.add(role="user", content="x")
    m.parts.add(type="text", text="y")
    return "parts_and_content", r, frozenset({INVALID})


def _semantic_bad_tool_json(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model)
    r.messages.messages.add(role="user", content="x")
    r.tools.add(name="f", parameters_json=t.rng.choice(("{", "nan", "[" * 100_000, '"\\ud800"')))
    return "bad_tool_json", r, frozenset({INVALID})


def _semantic_too_long(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model)
    if t.rng.random() < 0.5:
        r.token_ids.ids.extend([5] * (MAX_PROMPT_TOKENS + 1))
    else:
        r.prompt = " ".join(["word"] * (MAX_PROMPT_TOKENS + 50))
    return "too_long", r, frozenset({INVALID})


def _semantic_empty_messages(t: GrpcTraffic):
    r = pb.RouteRequest(model=t.model)
    r.messages.SetInParent()
    return "empty_messages", r, frozenset({INVALID})


_SEMANTIC: list[Callable] = [
    _semantic_no_model,
    _semantic_unknown_model,
    _semantic_no_input,
    _semantic_empty_token_ids,
    _semantic_tools_without_messages,
    _semantic_parts_and_content,
    _semantic_bad_tool_json,
    _semantic_too_long,
    _semantic_empty_messages,
]


def call(channel: grpc.Channel, grpc_call: GrpcCall, outcomes: Outcomes) -> bytes | None:
    started = time.monotonic()
    try:
        reply = channel.unary_unary(grpc_call.method)(grpc_call.payload, timeout=TIMEOUT_S)
        code, detail = OK, ""
    except grpc.RpcError as exc:
        reply, code, detail = None, exc.code(), exc.details() or ""
    ok = code not in _BAD_CODES if grpc_call.expect is None else code in grpc_call.expect
    if code != OK and not detail:
        ok = False  # every refusal says why
    outcomes.add(
        grpc_call.kind,
        "any" if grpc_call.expect is None else "/".join(sorted(c.name for c in grpc_call.expect)),
        code.name,
        ok,
        hang=code == grpc.StatusCode.DEADLINE_EXCEEDED,
        seconds=time.monotonic() - started,
        example=None if ok else f"{grpc_call.method} {grpc_call.payload[:200]!r} -> {code.name} {detail[:300]}",
    )
    return reply


def run_grpc(fleet: RouterFleet, messages: int, seed: int, outcomes: Outcomes) -> None:
    rng = random.Random(seed)
    traffic = GrpcTraffic(rng, fleet.model)
    with grpc.insecure_channel(fleet.grpc_target) as channel:
        for i in range(messages + 1):
            if i % BAD_PER_VALID == 0:
                reserve = rng.random() < 0.3
                reply = call(
                    channel,
                    GrpcCall("valid", _ROUTE, traffic.valid_route(reserve).SerializeToString(), frozenset({OK})),
                    outcomes,
                )
                if reserve and reply is not None:
                    rid = pb.RouteResponse.FromString(reply).reservation_id
                    if rng.random() < 0.5:
                        call(
                            channel,
                            GrpcCall(
                                "valid", _PREFILL_DONE, pb.ReservationRef(reservation_id=rid).SerializeToString(), frozenset({OK})
                            ),
                            outcomes,
                        )
                    call(
                        channel,
                        GrpcCall("valid", _RELEASE, pb.ReleaseRequest(reservation_id=rid).SerializeToString(), frozenset({OK})),
                        outcomes,
                    )
            if i < messages:
                bad = traffic.bad()
                reply = call(channel, bad, outcomes)
                if reply is not None and bad.method == _ROUTE:  # a mutated request may still reserve: release it
                    rid = pb.RouteResponse.FromString(reply).reservation_id
                    if rid:
                        call(
                            channel,
                            GrpcCall(
                                "valid", _RELEASE, pb.ReleaseRequest(reservation_id=rid).SerializeToString(), frozenset({OK})
                            ),
                            outcomes,
                        )


# ---------------------------------------------------------------- both


def run(
    target: str, drive: Callable[[RouterFleet, int, int, Outcomes], None], messages: int, seed: int, workdir: Path
) -> FuzzReport:
    started = time.monotonic()
    fleet = start_fleet(workdir)
    try:
        outcomes = Outcomes()
        drive(fleet, messages, seed, outcomes)
        sent_s = time.monotonic() - started
        if target == "router-http":  # the proxied requests' KV events reached the index
            applied, audit = audit_clean(fleet)
        else:  # every reservation released: none was made by a refused call, none leaked
            held = reservations_held(fleet)
            applied, audit = held == 0, {"reservations_held_after": held}
        health = health_ms(fleet)
        crashes = sum(not p.alive() for p in fleet.processes())
        return outcomes.report(
            target,
            applied=applied,
            crashes=crashes,
            health_ms=round(health, 1),
            seconds=round(time.monotonic() - started, 1),
            details={"send_s": round(sent_s, 1), **audit},
        )
    finally:
        fleet.cluster.stop()


def run_fuzz_http(messages: int, seed: int, workdir: Path) -> FuzzReport:
    return run("router-http", run_http, messages, seed, workdir)


def run_fuzz_grpc(messages: int, seed: int, workdir: Path) -> FuzzReport:
    return run("router-grpc", run_grpc, messages, seed, workdir)
