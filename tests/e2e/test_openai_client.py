"""The official `openai` Python client, unchanged, against a live router in front of live sim
engines (issue 18): chat, streamed chat, completions, streamed completions, the model list, and an
error the client turns into its own exception type. Nothing here is special-cased for the client:
it sends what it sends to any OpenAI-compatible server.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvroute.tools.local_cluster import LocalCluster


@pytest.fixture(scope="module")
def fleet(module_local_fleet) -> Iterator[tuple[LocalCluster, str]]:
    cluster = module_local_fleet("openai-client")
    cluster.start_control_plane()
    cluster.start_sim_fleet(2)
    cluster.wait_engines_healthy()
    cluster.wait_workers_registered(2)
    url = cluster.start_router("r", "kv_aware")
    yield cluster, url


@pytest.fixture
def client(fleet) -> Iterator[openai.OpenAI]:
    _, url = fleet
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_chat_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    reply = client.chat.completions.create(model=cluster.model, max_tokens=4, messages=[
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour."}])
    assert reply.object == "chat.completion"
    assert reply.choices and reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens >= 1


def test_streamed_chat_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    chunks = list(client.chat.completions.create(model=cluster.model, max_tokens=5, stream=True, messages=[
        {"role": "user", "content": "Count to five."}]))
    assert len(chunks) >= 2, "a stream of more than one chunk"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), "the stream ends with a finish reason"


def test_completion_and_streamed_completion(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    reply = client.completions.create(model=cluster.model, prompt="The cache router", max_tokens=3)
    assert reply.object == "text_completion" and reply.choices[0].text
    streamed = list(client.completions.create(model=cluster.model, prompt="The cache router", max_tokens=3,
                                              stream=True))
    assert streamed and "".join(c.choices[0].text for c in streamed if c.choices)


def test_models(fleet, client: openai.OpenAI) -> None:
    cluster, _ = fleet
    models = client.models.list()
    assert cluster.model in [m.id for m in models.data]


def test_errors_are_the_clients_exception_types(fleet, client: openai.OpenAI) -> None:
    """The router's errors are OpenAI error objects, so the client raises its typed exceptions with
    the router's message (not a generic APIError with an unparsed body)."""
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in str(not_found.value.message)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=fleet[0].model, max_tokens=1, messages=[])
    assert bad.value.body and isinstance(bad.value.body, dict) and bad.value.body.get("message")
