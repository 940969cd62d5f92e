"""The router tokenizes chat requests exactly like the model's chat template + tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from data_plane.tokenization import TokenizationError, load_tokenizer
from sim_engine.tiny_model import build_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tok") / "tiny")


def test_chat_render_and_encode_match_manual(model_dir) -> None:
    tok = load_tokenizer(model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache router"}]
    text = tok.render_chat(messages)
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nthe cache router<|end|>\n<|assistant|>\n"
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.encode_chat(messages) == raw.encode(text, add_special_tokens=False).ids
    # A longer conversation's tokens extend the shorter one's: prefix caching depends on it.
    longer = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert tok.encode_chat(longer)[: len(tok.encode_chat(messages, add_generation_prompt=False))] == \
        tok.encode_chat(messages, add_generation_prompt=False)


def test_bad_messages_are_clear_errors(model_dir) -> None:
    tok = load_tokenizer(model_dir)
    with pytest.raises(TokenizationError, match="role"):
        tok.encode_chat([{"content": "no role"}])


def test_missing_tokenizer_is_clear(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
