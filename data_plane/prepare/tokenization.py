"""The model's own tokenizer from a local HF-style directory, with its chat template.

Block keys only match what an engine cached if the router sees the *same token ids* the engine
will, so this mirrors what vLLM does with a Hugging Face tokenizer:

- completions: `encode_prompt(text)` is HF's `tokenizer.encode(text)`: the tokenizer.json
  post-processor adds whatever special tokens it defines (e.g. Llama-3's BOS), nothing else.
- chat: `encode_chat(messages)` renders the Jinja chat template the way HF's
  `apply_chat_template` does (sandboxed environment, `trim_blocks` + `lstrip_blocks`, the
  `loopcontrols` extension, HF's `tojson` filter, `raise_exception` / `strftime_now` globals,
  the special-token strings as variables), then encodes the text *without* special tokens.

Before any of that, every string of the input (messages, content parts, tools, template kwargs,
the prompt) is checked for lone UTF-16 surrogates (JSON can carry `"\\ud800"`; the tokenizer cannot
take it), and the text is checked against the tokenizer's character bound (`char_bound.py`): a
prompt longer than `max_tokens` tokens can possibly be is rejected without being tokenized.

OpenAI content-part lists (`[{"type": "text", "text": ...}, ...]`) are flattened to their text
parts joined by newlines (vLLM's "string" content format); non-text parts are ignored. That is
an approximation for routing only: the original body still goes to the engine untouched.
"""

from __future__ import annotations

import ctypes
import json
import threading
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvroute.data_plane.prepare.char_bound import CharBound, char_bound
from kvroute.data_plane.prepare.token_cache import SegmentTokenCache

# Tokenizing peaks at ~150-170 bytes per character (the encoding's ids, offsets and token strings).
# glibc keeps what it freed: the heap is fragmented, so free() cannot shrink it, and a router that
# once tokenized a 10 MB prompt stayed at ~1 GB RSS. After an input this long the freed pages are
# handed back with malloc_trim (measured: about 2 ms per 256k characters' worth, in the worker thread).
TRIM_AFTER_CHARS = 262_144
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only; elsewhere nothing to do
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizationError(ValueError):
    """The request cannot be tokenized (bad messages, no or failing chat template, invalid text)."""


class PromptTooLong(TokenizationError):
    """The prompt is longer than the caller's token limit (known from its characters alone)."""


def lone_surrogate(value: Any, where: str) -> str | None:
    """Where the first lone UTF-16 surrogate in `value` (strings, object keys, lists, nested) is, as
    "where[i].key (character n)", or None. Text with one cannot be UTF-8 encoded (tokenizer, hashes,
    the engine): JSON's `\\ud800` escape without its pair produces it. ASCII strings cost nothing."""
    pending: list[tuple[Any, str]] = [(value, where)]  # iterative: a deeply nested body cannot overflow the stack
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return f"{path} (character {exc.start})"
        elif isinstance(item, Mapping):
            for key in reversed(list(item)):
                if isinstance(key, str) and not key.isascii():
                    pending.append((key, f"{path} (a key)"))
                pending.append((item[key], f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            pending.extend(
                (v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))) if isinstance(v, (str, Mapping, list, tuple))
            )
    return None


def _check_text(value: Any, where: str) -> None:
    found = lone_surrogate(value, where)
    if found is not None:
        raise TokenizationError(
            f"{found} contains a lone UTF-16 surrogate: text must be valid Unicode "
            "(a pair such as \\ud83d\\ude00 is fine, half of one is not)"
        )


def _raise_exception(message: str) -> None:  # templates call raise_exception(...) on bad input
    raise TokenizationError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # HF overrides Jinja's HTML-escaping tojson with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (assistant-mask marker): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:  # type: ignore[no-untyped-def]
        return caller()


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten_content(content: Any) -> Any:
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", "")) for part in content if isinstance(part, Mapping) and part.get("type", "text") == "text"
        )
    return content


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizationError("'messages' must be a list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizationError(f"messages[{i}] must be an object with a 'role'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizationError(f"messages[{i}] must have a string 'role'")
        message = dict(m)
        if "content" in message:
            message["content"] = _flatten_content(message["content"])
        out.append(message)
    return out


@dataclass
class PromptTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""
    special_tokens: dict[str, str] = field(default_factory=dict)  # all *_token strings, passed to the template
    cache_tokens: int = 4_000_000  # SegmentTokenCache budget (token ids kept); 0 = tokenize every prompt whole

    def __post_init__(self) -> None:
        self.special_tokens = {**self.special_tokens, "bos_token": self.bos_token, "eos_token": self.eos_token}
        self._template = _chat_environment().from_string(self.chat_template) if self.chat_template else None
        self.segment_cache = SegmentTokenCache(self.tokenizer, self.cache_tokens) if self.cache_tokens > 0 else None
        self.char_bound: CharBound = char_bound(self.tokenizer)
        self.tokenized_chars = 0  # characters handed to tokenization (segment-cache hits included)
        self._count_lock = threading.Lock()

    def _check_chars(self, chars: int, max_tokens: int | None) -> None:
        limit = None if max_tokens is None else self.char_bound.max_chars(max_tokens)
        if limit is not None and chars > limit:
            raise PromptTooLong(
                f"prompt has {chars} characters; with this model's tokenizer (at most "
                f"{self.char_bound.chars_per_token} characters per token) that is more than "
                f"{max_tokens} tokens, the most this router accepts (see --max-prompt-tokens)"
            )

    def _encode(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> array:
        """Token ids packed as array('I'): block-key hashing takes the packed bytes as they are."""
        with self._count_lock:
            self.tokenized_chars += len(text)
        try:
            if self.segment_cache is not None:  # same ids, but a known system prompt / history is not re-tokenized
                return self.segment_cache.encode(text, add_special_tokens, max_tokens)
            # encode_batch releases the GIL (encode does not) at the same cost, so a long prompt
            # tokenized in a worker thread really leaves the event loop free meanwhile.
            return array("I", self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        finally:
            if len(text) >= TRIM_AFTER_CHARS and _malloc_trim is not None:
                _malloc_trim(0)

    # ------------------------------------------------------------ completions

    def encode_prompt(self, text: str, max_tokens: int | None = None, where: str = "prompt") -> array:
        """HF `tokenizer.encode(text)`: only the post-processor's special tokens are added. With
        `max_tokens`, text too long to fit raises PromptTooLong before any tokenizing."""
        _check_text(text, where)
        self._check_chars(len(text), max_tokens)
        return self._encode(text, True, max_tokens)

    # ------------------------------------------------------------ chat

    def render_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise TokenizationError("this model's tokenizer has no chat_template; use /v1/completions")
        _check_text(messages, "messages")
        _check_text(tools, "tools")
        _check_text(template_kwargs, "chat_template_kwargs")
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._template.render(
                messages=_normalize_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TokenizationError:
            raise
        except Exception as exc:  # a template error is the request's fault: it becomes a clear 400
            raise TokenizationError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> array:
        """Render the chat template, then encode without special tokens (the template has them). The
        character bound is checked on the rendered text: what a template leaves out cannot count."""
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        self._check_chars(len(text), max_tokens)
        return self._encode(text, False, max_tokens)

    # ------------------------------------------------------------ misc

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # AddedToken serialisation
        return str(value.get("content", ""))
    return str(value or "")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _chat_template(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if template is None and (directory / "chat_template.jinja").exists():  # newer HF layout
        template = (directory / "chat_template.jinja").read_text()
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: HF uses the one called "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def load_tokenizer(path: str | Path, cache_tokens: int = 4_000_000) -> PromptTokenizer:
    """Tokenizer + chat template + special-token strings of a local HF-style model directory."""
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise FileNotFoundError(f"no tokenizer.json in {directory} (--tokenizer must be a local model directory)")
    config = _read_json(directory / "tokenizer_config.json")
    special = {**_read_json(directory / "special_tokens_map.json"), **config}
    tokens = {name: _token_text(special.get(name)) for name in _SPECIAL_TOKEN_NAMES if special.get(name)}
    return PromptTokenizer(
        Tokenizer.from_file(str(tokenizer_file)),
        _chat_template(directory, config),
        tokens.get("bos_token", ""),
        tokens.get("eos_token", ""),
        tokens,
        cache_tokens,
    )
