"""The sim engine's own prompt rendering and tokenization, as an engine does it: the model directory's
`tokenizer.json` (HF tokenizers) and its Jinja chat template, rendered the way HF's
`apply_chat_template` renders it (sandboxed, `trim_blocks` + `lstrip_blocks`, the `loopcontrols`
extension, a plain-JSON `tojson`, `raise_exception` / `strftime_now`, the special-token strings as
variables, `{% generation %}` blocks rendered as their body), then encoded without special tokens;
a completion prompt is encoded with them. OpenAI content-part lists become their text parts joined
by newlines (vLLM's "string" content format).

Deliberately not the router's tokenizer (`kvroute.data_plane.prepare.tokenization`): the sim engine stands
in for vLLM, which renders and tokenizes on its own, so a router that renders differently from the
engine shows up as a routing miss in the tests instead of being hidden by shared code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class PromptError(ValueError):
    """The request's prompt or messages cannot be rendered or tokenized (a 400)."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:  # type: ignore[no-untyped-def]
        return caller()


def _fail(message: str) -> None:
    raise PromptError(message)


def _template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _fail
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m.get("role"):
        raise PromptError(f"messages[{i}] must be an object with a string 'role'")
    message = dict(m)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "\n".join(
            str(part.get("text", "")) for part in content if isinstance(part, Mapping) and part.get("type", "text") == "text"
        )
    return message


@dataclass
class EngineTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> their strings

    def __post_init__(self) -> None:
        self._template = _template_environment().from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        if self._template is None:
            raise PromptError("this model's tokenizer has no chat_template; use /v1/completions")
        try:
            text = self._template.render(
                messages=[_message(i, m) for i, m in enumerate(messages)],
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **{"bos_token": "", "eos_token": "", **self.special_tokens},
            )
        except PromptError:
            raise
        except Exception as exc:  # a template error is the request's fault
            raise PromptError(f"chat template failed: {exc}") from exc
        return self._encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate from JSON's "\ud800"
            raise PromptError(f"the prompt is not valid Unicode (character {exc.start})") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_string(value: object) -> str:
    return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")  # AddedToken or str


def load_engine_tokenizer(path: str | Path) -> EngineTokenizer:
    """A local HF-style model directory's tokenizer.json, chat template and special-token strings."""
    directory = Path(path)
    if not (directory / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {directory} (--tokenizer must be a local model directory)")
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if template is None and (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text()
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    named = {**_read_json(directory / "special_tokens_map.json"), **config}
    special = {name: _token_string(named[name]) for name in SPECIAL_TOKEN_NAMES if named.get(name)}
    return EngineTokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")), template, special)
