"""Request preparation shared by HTTP and gRPC: one model/adapter check, one tokenizing step, one
length check, and typed errors that each transport maps to its own status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvroute.data_plane.grpc.api import route_input
from kvroute.data_plane.prepare.request_prep import PrepareError, RequestPreparer, RouteInput
from kvroute.data_plane.prepare.tokenization import load_tokenizer
from kvroute.v1 import kvroute_pb2 as pb


@pytest.fixture(scope="module")
def preparer(tiny_model_dir: Path) -> RequestPreparer:
    return RequestPreparer(load_tokenizer(tiny_model_dir), "tiny", lambda model: {"ad-1"}, max_prompt_tokens=64)


def _prepare(preparer: RequestPreparer, request: RouteInput):
    return asyncio.run(preparer.prepare(request))


def test_model_adapter_salt_and_session_key_come_through(preparer: RequestPreparer) -> None:
    out = _prepare(preparer, RouteInput("ad-1", "completions", prompt=[5, 6, 7], cache_salt="s", session_key="k"))
    assert (list(out.token_ids), out.lora_name, out.cache_salt, out.session_key) == ([5, 6, 7], "ad-1", "s", "k")
    assert _prepare(preparer, RouteInput("tiny", prompt=[1], lora_name="ad-1")).lora_name == "ad-1"
    batch = _prepare(preparer, RouteInput("tiny", "completions", prompt=[[9, 9], "hello"]))
    assert list(batch.token_ids) == [9, 9]  # a batch is routed on its first prompt


@pytest.mark.parametrize(("request_", "kind", "param"), [
    (RouteInput(None, prompt="x"), "invalid", "model"),
    (RouteInput("other", prompt="x"), "model_not_found", "model"),
    (RouteInput("tiny", prompt="x", lora_name="other"), "model_not_found", "lora_name"),
    (RouteInput("tiny", "completions"), "invalid", "prompt"),
    (RouteInput("tiny", "chat", prompt="x"), "invalid", "messages"),
    (RouteInput("tiny", "completions", prompt=[1] * 65), "too_long", "prompt"),
    (RouteInput("tiny", "completions", prompt=["ok", [1] * 65]), "too_long", "prompt"),
    (RouteInput("tiny", "completions", prompt="word " * 5000), "too_long", "prompt"),  # past the character bound
    (RouteInput("tiny", "chat", messages=[{"content": "no role"}]), "invalid", "messages"),
])
def test_errors_are_typed_for_the_transports(preparer: RequestPreparer, request_: RouteInput, kind: str,
                                             param: str) -> None:
    with pytest.raises(PrepareError) as err:
        _prepare(preparer, request_)
    assert (err.value.kind, err.value.param) == (kind, param), str(err.value)


def test_grpc_and_http_inputs_prepare_to_the_same_tokens(preparer: RequestPreparer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    via_grpc = _prepare(preparer, route_input(pb.RouteRequest(
        model="tiny", messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))))
    via_http = _prepare(preparer, RouteInput("tiny", "chat", messages=messages))
    assert list(via_grpc.token_ids) == list(via_http.token_ids) and via_http.token_ids
    with pytest.raises(PrepareError, match="'token_ids' must not be empty"):
        _prepare(preparer, route_input(pb.RouteRequest(model="tiny", token_ids=pb.TokenIds())))
