"""The model's own tokenizer from a local HF-style directory, with its chat template.

Chat requests are rendered with the template from tokenizer_config.json exactly as HF's
`apply_chat_template` does (sandboxed Jinja, trim_blocks + lstrip_blocks) and encoded
without adding special tokens, which is how vLLM tokenizes chat prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizationError(ValueError):
    """The request cannot be tokenized (bad messages, template error)."""


def _raise_exception(message: str) -> None:  # templates call raise_exception(...) on bad input
    raise TokenizationError(message)


@dataclass
class PromptTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TokenizationError("this tokenizer has no chat_template; use /v1/completions")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizationError("each message must be an object with a 'role'")
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TokenizationError:
            raise
        except Exception as exc:  # template errors become a clear 400
            raise TokenizationError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # AddedToken serialisation
        return str(value.get("content", ""))
    return str(value or "")


def load_tokenizer(path: str | Path) -> PromptTokenizer:
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return PromptTokenizer(Tokenizer.from_file(str(tokenizer_file)), template,
                           _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
