"""The sim engine renders and tokenizes on its own, as vLLM does; what it computes must be what the
router computes for the same request, or prefix routing against sim engines would test nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.data_plane.prepare.tokenization import load_tokenizer
from kvroute.tools.sim_engine.tokenizer import PromptError, load_engine_tokenizer
from kvroute.tools.tiny_model import CHAT_TEMPLATE

CHATS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are terse. <s> is not special here </s>"},
        {"role": "user", "content": "the cache router"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and again, ünïcödé 🙂"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "part two"},
            ],
        }
    ],
    [{"role": "user", "content": ""}, {"role": "tool", "content": '{"a": 1}', "name": "lookup"}],
]


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_the_engine_tokenizes_a_chat_exactly_as_the_router_does(tiny_model_dir: Path, messages: list) -> None:
    engine, router = load_engine_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir, cache_tokens=0)
    assert engine.encode_chat(messages) == list(router.encode_chat(messages))


# Whitespace control, loop controls, HF's tojson and generation tag, the special-token variables.
RICH_TEMPLATE = """{% for m in messages %}
  {% if m.role == 'tool' %}{% continue %}{% endif %}
    <|{{ m.role }}|>
    {% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
  {{ m | tojson }}
{% endfor %}
{% if add_generation_prompt %}{{ bos_token }}<|assistant|>{{ strftime_now('%Y') | length }}{% endif %}"""


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_every_template_feature_renders_as_the_router_renders_it(tiny_model_dir: Path, tmp_path: Path, messages: list) -> None:
    model = tmp_path / "rich"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": RICH_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    engine, router = load_engine_tokenizer(model), load_tokenizer(model, cache_tokens=0)
    assert engine.encode_chat(messages) == list(router.encode_chat(messages))


@pytest.mark.parametrize("text", ["hello world", "", "<s>the cache</s> router\n\n  spaces", "ünïcödé 🙂" * 20])
def test_the_engine_tokenizes_a_prompt_exactly_as_the_router_does(tiny_model_dir: Path, text: str) -> None:
    engine, router = load_engine_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir, cache_tokens=0)
    assert engine.encode_prompt(text) == list(router.encode_prompt(text))
    assert engine.vocab_size == router.vocab_size
    assert engine.decode(engine.encode_prompt("the cache router")) == "the cache router"


def test_bad_chats_are_prompt_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = load_engine_tokenizer(tiny_model_dir)
    with pytest.raises(PromptError, match="role"):
        engine.encode_chat([{"content": "no role"}])
    with pytest.raises(PromptError, match="role"):
        engine.encode_chat(["not an object"])
    with pytest.raises(PromptError, match="Unicode"):
        engine.encode_prompt("half a pair \ud800")
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (failing / "tokenizer_config.json").write_text('{"chat_template": "{{ raise_exception(\'no chats here\') }}"}')
    with pytest.raises(PromptError, match="no chats here"):
        load_engine_tokenizer(failing).encode_chat(CHATS[0])
    (failing / "tokenizer_config.json").write_text("{}")
    with pytest.raises(PromptError, match="no chat_template"):
        load_engine_tokenizer(failing).encode_chat(CHATS[0])


def test_a_template_in_its_own_file_is_used(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Newer model directories keep the template in chat_template.jinja."""
    model = tmp_path / "jinja-file"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (model / "special_tokens_map.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    assert load_engine_tokenizer(model).encode_chat(CHATS[1]) == load_engine_tokenizer(tiny_model_dir).encode_chat(CHATS[1])
