"""Request preparation shared by HTTP and gRPC: one model/adapter check, one tokenizing step, one
length check, and typed errors that each transport maps to its own status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvroute.data_plane.grpc.api import route_input
from kvroute.data_plane.prepare.model_tokenizers import ModelTokenizers
from kvroute.data_plane.prepare.request_prep import PrepareError, RequestPreparer, RouteInput
from kvroute.data_plane.prepare.tokenization import load_tokenizer
from kvroute.v1 import kvroute_pb2 as pb


class Fleet:
    """Served models -> their adapters, as the router's control-plane client knows them."""

    def __init__(self, adapters: dict[str, set[str]]) -> None:
        self.adapters = adapters

    def models(self) -> frozenset[str]:
        return frozenset(self.adapters)

    def adapters_of(self, model: str) -> set[str]:
        return self.adapters.get(model, set())


@pytest.fixture(scope="module")
def preparer(tiny_model_dir: Path) -> RequestPreparer:
    return RequestPreparer(
        ModelTokenizers.preloaded({"tiny": load_tokenizer(tiny_model_dir)}, "tiny"),
        Fleet({"tiny": {"ad-1"}}),
        max_prompt_tokens=64,
    )


def _prepare(preparer: RequestPreparer, request: RouteInput):
    return asyncio.run(preparer.prepare(request))


def test_model_adapter_salt_and_session_key_come_through(preparer: RequestPreparer) -> None:
    out = _prepare(preparer, RouteInput("ad-1", "completions", prompt=[5, 6, 7], cache_salt="s", session_key="k"))
    assert (list(out.token_ids), out.lora_name, out.cache_salt, out.session_key) == ([5, 6, 7], "ad-1", "s", "k")
    assert _prepare(preparer, RouteInput("tiny", prompt=[1], lora_name="ad-1")).lora_name == "ad-1"
    batch = _prepare(preparer, RouteInput("tiny", "completions", prompt=[[9, 9], "hello"]))
    assert list(batch.token_ids) == [9, 9]  # a batch is routed on its first prompt


@pytest.mark.parametrize(
    ("request_", "kind", "param"),
    [
        (RouteInput(None, prompt="x"), "invalid", "model"),
        (RouteInput("other", prompt="x"), "model_not_found", None),  # OpenAI's param: null
        (RouteInput("tiny", prompt="x", lora_name="other"), "model_not_found", "lora_name"),
        (RouteInput("tiny", "completions"), "invalid", "prompt"),
        (RouteInput("tiny", "chat", prompt="x"), "invalid", "messages"),
        (RouteInput("tiny", "completions", prompt=[1] * 65), "too_long", "prompt"),
        (RouteInput("tiny", "completions", prompt=["ok", [1] * 65]), "too_long", "prompt"),
        (RouteInput("tiny", "completions", prompt="word " * 5000), "too_long", "prompt"),  # past the character bound
        (RouteInput("tiny", "chat", messages=[{"content": "no role"}]), "invalid", "messages"),
    ],
)
def test_errors_are_typed_for_the_transports(preparer: RequestPreparer, request_: RouteInput, kind: str, param: str) -> None:
    with pytest.raises(PrepareError) as err:
        _prepare(preparer, request_)
    assert (err.value.kind, err.value.param) == (kind, param), str(err.value)


def test_grpc_and_http_inputs_prepare_to_the_same_tokens(preparer: RequestPreparer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    via_grpc = _prepare(
        preparer,
        route_input(pb.RouteRequest(model="tiny", messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))),
    )
    via_http = _prepare(preparer, RouteInput("tiny", "chat", messages=messages))
    assert list(via_grpc.token_ids) == list(via_http.token_ids) and via_http.token_ids
    with pytest.raises(PrepareError, match="'token_ids' must not be empty"):
        _prepare(preparer, route_input(pb.RouteRequest(model="tiny", token_ids=pb.TokenIds())))


def test_each_model_is_prepared_with_its_own_tokenizer_and_named_as_routed(tiny_model_dir: Path) -> None:
    """Two models behind one router: a request names its model or an adapter of it, is tokenized with
    that model's tokenizer and says which model's workers it goes to; any other name is a 404."""
    tiny, other = load_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir)
    preparer = RequestPreparer(
        ModelTokenizers.preloaded({"tiny": tiny, "other": other}, "tiny"),
        Fleet({"tiny": {"ad-1"}, "other": {"ad-2"}}),
        max_prompt_tokens=64,
    )
    for model, tokenizer in (("tiny", tiny), ("other", other)):
        before = tokenizer.tokenized_chars
        assert _prepare(preparer, RouteInput(model, "completions", prompt="hello")).model == model
        assert tokenizer.tokenized_chars == before + len("hello")
    out = _prepare(preparer, RouteInput("ad-2", "completions", prompt=[1, 2]))
    assert (out.model, out.lora_name) == ("other", "ad-2")
    with pytest.raises(PrepareError) as err:
        _prepare(preparer, RouteInput("tiny", prompt=[1], lora_name="ad-2"))  # the other model's adapter
    assert (err.value.kind, err.value.param) == ("model_not_found", "lora_name")
    with pytest.raises(PrepareError) as err:
        _prepare(preparer, RouteInput("third", prompt="x"))
    assert (err.value.kind, str(err.value)) == (
        "model_not_found",
        "The model `third` does not exist or you do not have access to it.",
    )


def test_a_served_model_without_a_tokenizer_is_routed_untokenized(tiny_model_dir: Path) -> None:
    preparer = RequestPreparer(
        ModelTokenizers.preloaded({"tiny": load_tokenizer(tiny_model_dir)}, "tiny"),
        Fleet({"tiny": set(), "bare": set()}),
        max_prompt_tokens=64,
    )
    out = _prepare(preparer, RouteInput("bare", "chat", messages=[{"role": "user", "content": "hi"}]))
    assert (out.model, out.token_ids) == ("bare", None)
    with pytest.raises(PrepareError, match="string 'role'"):  # its shape is still checked
        _prepare(preparer, RouteInput("bare", "chat", messages=[{"content": "no role"}]))
