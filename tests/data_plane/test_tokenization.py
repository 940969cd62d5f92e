"""The router tokenizes chat requests exactly like the model's chat template + tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from kvroute.data_plane.prepare.tokenization import TokenizationError, load_tokenizer


def test_chat_render_and_encode_match_manual(tiny_model_dir) -> None:
    tok = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache router"}]
    text = tok.render_chat(messages)
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nthe cache router<|end|>\n<|assistant|>\n"
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert list(tok.encode_chat(messages)) == raw.encode(text, add_special_tokens=False).ids
    # A longer conversation's tokens extend the shorter one's: prefix caching depends on it.
    longer = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert tok.encode_chat(longer)[: len(tok.encode_chat(messages, add_generation_prompt=False))] == tok.encode_chat(
        messages, add_generation_prompt=False
    )


def test_bad_messages_are_clear_errors(tiny_model_dir) -> None:
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(TokenizationError, match="role"):
        tok.encode_chat([{"content": "no role"}])


def test_missing_tokenizer_is_clear(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_encode_prompt_is_hf_encode_and_chat_adds_no_special_tokens(tiny_model_dir) -> None:
    from tokenizers.processors import TemplateProcessing

    from kvroute.data_plane.prepare.tokenization import PromptTokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    bos = raw.token_to_id("<s>")
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])  # Llama-3 style
    tok = PromptTokenizer(raw, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "<s>", "</s>")
    ids = tok.encode_prompt("the cache router")
    assert ids[0] == bos and list(ids) == raw.encode("the cache router").ids
    chat = tok.encode_chat([{"role": "user", "content": "the cache router"}])
    assert chat.count(bos) == 1 and list(chat) == raw.encode("<s>the cache router", add_special_tokens=False).ids
    assert tok.decode(ids) == "the cache router"


def test_template_environment_matches_hf(tiny_model_dir) -> None:
    from kvroute.data_plane.prepare.tokenization import PromptTokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    template = (
        "{% for m in messages %}\n"  # trim_blocks eats this newline
        "  {% if m['role'] == 'stop' %}{% break %}{% endif %}\n"  # lstrip_blocks, loopcontrols
        "{{ m['role'] }}: {% generation %}{{ m['content'] }}{% endgeneration %};\n"
        "{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"  # HF tojson: no HTML escaping
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    tok = PromptTokenizer(raw, template, "<s>", "</s>")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b<c>"}]},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never"},
    ]
    text = tok.render_chat(messages, tools=[{"name": "f<g>"}])
    assert text == 'user: a\nb<c>;\n[{"name": "f<g>"}]</s>'
    assert tok.render_chat(messages[:1], add_generation_prompt=False) == "user: a\nb<c>;\n"

    failing = PromptTokenizer(raw, "{{ raise_exception('only user and assistant roles') }}", "", "")
    with pytest.raises(TokenizationError, match="only user and assistant roles"):
        failing.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizationError, match="chat template failed"):
        PromptTokenizer(raw, "{{ messages[0].nope.deeper }}", "", "").encode_chat([{"role": "user"}])
    with pytest.raises(TokenizationError, match="no chat_template"):
        PromptTokenizer(raw, None, "", "").encode_chat([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_and_special_tokens(tmp_path, tiny_model_dir) -> None:
    import json
    import shutil

    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "unk_token": "<unk>"})
    )
    (d / "chat_template.jinja").write_text("{{ bos_token }}{{ unk_token }}{{ messages[0]['content'] }}")
    tok = load_tokenizer(d)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<s><unk>hi"
