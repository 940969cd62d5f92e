"""The router's input limits against a live router process over real sockets (issue 13, item 3):
a body over --max-body-bytes is a 413 before it is read (Content-Length, Expect: 100-continue,
chunked), a prompt past the tokenizer's character bound is a 400 without being tokenized (the
router's own tokenized-characters counter does not move), and a large prompt that is tokenized
does not leave its memory resident in the router afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.prom_text import sample_sums
from kvroute.tools.local_cluster import ManagedProcess, free_port, http_get, http_ok, http_post_json, kvroute_argv, wait_until

MODEL = "tiny"
MAX_BODY = 1024 * 1024
MAX_TOKENS = 1000
TOKENIZED = "kvroute_router_tokenized_chars_total"


def start_router(workdir: Path, model_dir: Path, name: str, *extra: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    router = ManagedProcess(
        f"router-{name}",
        kvroute_argv(
            "router",
            "--control-plane",
            f"127.0.0.1:{free_port()}",  # nothing there: the router fails open
            "--tokenizer",
            str(model_dir),
            "--model",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            "off",
            *extra,
        ),
        workdir / f"{name}.log",
    )
    router.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(url + "/health"), 30, f"router {name}", [router])
    return router, url


@pytest.fixture(scope="module")
def router(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[ManagedProcess, str]]:
    proc, url = start_router(
        tmp_path_factory.mktemp("limits"),
        tiny_model_dir,
        "limits",
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-prompt-tokens",
        str(MAX_TOKENS),
    )
    try:
        yield proc, url
    finally:
        proc.stop()


def raw_exchange(url: str, head: bytes, body_chunks: Iterator[bytes] | None = None, timeout: float = 5.0) -> bytes:
    """Send a hand-written request (head, then chunks until the server answers or they run out);
    return the first response the server sent (status line, headers and body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        for chunk in body_chunks or ():
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # answered before the body was done
            except BlockingIOError:
                pass
            sock.setblocking(True)
            sock.sendall(chunk)
        sock.settimeout(timeout)
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < _content_length(received):
            data = sock.recv(65536)
            if not data:
                break
            received += data
        return received


def _content_length(response: bytes) -> int:
    for line in response.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def split_response(response: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_too_large(response: bytes) -> None:
    status, headers, body = split_response(response)
    assert status == 413 and headers["content-type"].startswith("application/json"), response[:300]
    assert body["error"]["code"] == "request_too_large" and "--max-body-bytes" in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None


def tokenized_chars(url: str) -> float:
    status, text = http_get(url + "/metrics")
    assert status == 200
    return sample_sums(text.decode(), {TOKENIZED})[TOKENIZED]


def head(path: str, *headers: str) -> bytes:
    return (
        "\r\n".join([f"POST {path} HTTP/1.1", "Host: router", "Content-Type: application/json", *headers]) + "\r\n\r\n"
    ).encode()


def test_a_body_over_the_cap_is_a_413_before_it_is_read(router) -> None:
    proc, url = router
    # Announced as 64 MiB and never sent: only a router that does not wait for the body can answer.
    started = time.monotonic()
    assert_too_large(raw_exchange(url, head("/v1/chat/completions", f"Content-Length: {64 << 20}")))
    # curl's Expect: 100-continue: refused instead of "100 Continue", so the client sends nothing.
    response = raw_exchange(url, head("/v1/completions", f"Content-Length: {MAX_BODY + 1}", "Expect: 100-continue"))
    assert not response.startswith(b"HTTP/1.1 100")
    assert_too_large(response)
    assert time.monotonic() - started < 2.0
    # Chunked (no Content-Length): the router stops reading once the cap is passed and answers while the
    # client is still sending; 4 MiB would follow.
    chunk = b"x" * 65536
    chunks = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(64))
    started = time.monotonic()
    assert_too_large(raw_exchange(url, head("/v1/route", "Transfer-Encoding: chunked"), chunks))
    assert time.monotonic() - started < 5.0
    # A real client with a real 2 MiB body gets the same answer, and the router is still fine.
    status, raw = http_post_json(url + "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)})
    assert status == 413, raw
    assert http_ok(url + "/health") and proc.alive()


def test_a_prompt_past_the_character_bound_is_rejected_without_tokenizing(router) -> None:
    _, url = router
    before = tokenized_chars(url)
    # The tiny tokenizer's longest token is 13 characters, so 1000 tokens are at most 13000 characters.
    long_text = "the cache router " * 12000  # 204000 characters: under the body cap, far over the bound
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long_text}]}),
        ("/v1/completions", {"model": MODEL, "prompt": long_text}),
        ("/v1/route", {"model": MODEL, "prompt": ["the cache router", long_text]}),
    ):
        status, raw = http_post_json(url + path, body)
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded", raw
        assert "characters" in error["message"] and "--max-prompt-tokens" in error["message"], error
    short = "the cache router"
    assert tokenized_chars(url) == before + len(short)  # only the batch's short prompt met the tokenizer
    # The counter is live: a prompt under the bound is tokenized (and, with no worker, answered 503).
    status, raw = http_post_json(url + "/v1/route", {"model": MODEL, "prompt": "cache " * 500})
    assert status == 503, raw
    assert tokenized_chars(url) == before + len(short) + 3000


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_large_tokenized_prompt_does_not_stay_resident(tmp_path, tiny_model_dir) -> None:
    """2M characters are tokenized (under both limits here); the tokenizer's ~200 MB of scratch
    memory is freed, and the router gives it back to the OS (malloc_trim) instead of keeping it."""
    proc, url = start_router(
        tmp_path,
        tiny_model_dir,
        "memory",
        "--max-body-bytes",
        str(8 << 20),
        "--max-prompt-tokens",
        "1000000",
        "--tokenizer-cache-tokens",
        "0",
    )
    try:
        http_post_json(url + "/v1/route", {"model": MODEL, "prompt": "warm up the tokenizer"})
        assert proc.popen is not None
        idle = rss_mb(proc.popen.pid)
        text = "the cache router sends each prompt to the worker that holds its prefix " * 28_000  # ~2M characters
        status, raw = http_post_json(url + "/v1/route", {"model": MODEL, "prompt": text}, timeout=60)
        assert status == 503, raw  # tokenized, then nowhere to route
        after = rss_mb(proc.popen.pid)
        assert after - idle < 60, f"router RSS {idle:.0f} MB idle, {after:.0f} MB after a 2M-character prompt"
    finally:
        proc.stop()
