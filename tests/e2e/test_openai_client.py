"""The official `openai` Python client, unchanged, against a live router in front of live sim
engines (issue 18): chat, streamed chat, completions, streamed completions, the model list, the
router's errors and an engine's errors, which the client turns into its own exception types. Nothing here is special-cased for the client:
it sends what it sends to any OpenAI-compatible server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from kvroute.tools.local_cluster import LocalCluster, http_post_json_headers


@pytest.fixture(scope="module")
def fleet(module_local_fleet) -> Iterator[tuple[LocalCluster, str]]:
    cluster = module_local_fleet("openai-client")
    cluster.start_control_plane()
    cluster.start_sim_fleet(2)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(2)
    url = cluster.start_router("r", "kv_aware", ready=True)
    yield cluster, url


@pytest.fixture
def client(fleet) -> Iterator[openai.OpenAI]:
    _, url = fleet
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_chat_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    reply = client.chat.completions.create(
        model=cluster.model,
        max_tokens=4,
        messages=[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a colour."}],
    )
    assert reply.object == "chat.completion"
    assert reply.choices and reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens >= 1


def test_streamed_chat_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    chunks = list(
        client.chat.completions.create(
            model=cluster.model, max_tokens=5, stream=True, messages=[{"role": "user", "content": "Count to five."}]
        )
    )
    assert len(chunks) >= 2, "a stream of more than one chunk"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), "the stream ends with a finish reason"


def test_completion_and_streamed_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    reply = client.completions.create(model=cluster.model, prompt="The cache router", max_tokens=3)
    assert reply.object == "text_completion" and reply.choices[0].text
    streamed = list(client.completions.create(model=cluster.model, prompt="The cache router", max_tokens=3, stream=True))
    assert streamed and "".join(c.choices[0].text for c in streamed if c.choices)


def test_models(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    models = client.models.list()
    assert cluster.model in [m.id for m in models.data]


def test_errors_are_the_clients_exception_types(fleet, client: openai.OpenAI) -> None:
    """The router's errors are OpenAI error objects, so the client raises its typed exceptions with
    the router's message (not a generic APIError with an unparsed body)."""
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in str(not_found.value.message)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=fleet[0].model, max_tokens=1, messages=[])
    assert bad.value.body and isinstance(bad.value.body, dict) and bad.value.body.get("message")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1"), ({"n": 2}, "n", "only supports n=1")],
)
def test_an_engines_error_comes_back_as_openais_error_object(
    fleet, client: openai.OpenAI, extra: dict, param: str, words: str
) -> None:
    """The engine refuses the request (vLLM's error shape: type "BadRequestError", code 400): the
    client gets its status and message in OpenAI's error object, raw and through the client."""
    cluster, url = fleet
    body = {"model": cluster.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    for stream in (False, True):
        status, headers, raw = http_post_json_headers(url + "/v1/chat/completions", {**body, "stream": stream})
        error = json.loads(raw)
        assert status == 400 and headers["x-kvroute-worker"], raw
        assert set(error) == {"error"} and error["error"]["type"] == "invalid_request_error", error
        assert words in error["error"]["message"] and error["error"]["param"] == param
        assert error["error"]["code"] is None, error
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body)
    assert refused.value.status_code == 400 and words in refused.value.message
    assert refused.value.type == "invalid_request_error" and refused.value.param == param
    assert refused.value.code is None
