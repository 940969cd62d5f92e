"""One request-preparation step for every transport: what HTTP and gRPC parsed -> a prepared request.

    preparer = RequestPreparer(tokenizers, control_plane, max_prompt_tokens)   # tokenizers: ModelTokenizers
    prepared = await preparer.prepare(RouteInput(model=..., prompt=... | messages=..., ...))
    # -> PreparedRequest(model, token_ids, lora_name, cache_salt, session_key), or raises PrepareError

Each transport parses its own wire format into a `RouteInput` and maps a `PrepareError` to its own
status (HTTP: `status` and OpenAI's `code`/`param`; gRPC: INVALID_ARGUMENT / NOT_FOUND). What is
checked here, in this order:

1. the model: required; a model some worker serves or one given a tokenizer (with no worker yet:
   the router's 503), or a LoRA adapter of a served model (vLLM's way: the adapter is named as the
   request's `model`; a `lora_name` field also works for a served model), else 404;
   `PreparedRequest.model` is the base model, the one the request is routed among the workers of;
2. the prompt: chat `messages` (rendered with that model's chat template) or a completion `prompt`
   (text, token ids, or a batch of those: a batch goes to one worker, so it is routed on its first
   prompt, and every prompt must fit);
3. its length: over `max_prompt_tokens` is `context_length_exceeded`, known from the characters
   alone when the text is past the tokenizer's character bound (never tokenized, then).

A model without a tokenizer (`model_tokenizers.py`) is prepared as for a policy that reads no tokens:
its shape is checked, its length is the engine's to check, and it is routed on load.

Tokenizing runs on the event loop for short inputs and in a worker thread past
`THREAD_TOKENIZE_CHARS` characters (the encode releases the GIL), so the loop keeps streaming.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.data_plane.prepare.model_tokenizers import ModelTokenizers
from kvroute.data_plane.prepare.tokenization import PromptTokenizer, PromptTooLong, TokenizationError

# Tokenizing costs a few tenths of a millisecond per 1000 characters; longer inputs go to a worker
# thread (the encode releases the GIL) so the event loop keeps streaming meanwhile.
THREAD_TOKENIZE_CHARS = 4096
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


class PrepareError(Exception):
    """The request cannot be routed as it is. `kind`: "invalid" (bad input), "model_not_found",
    or "too_long" (more prompt tokens than the router accepts); `param`: the field at fault."""

    def __init__(self, message: str, kind: str = "invalid", param: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.param = kind, param


@dataclass(slots=True)
class RouteInput:
    """What a transport parsed. `kind`: "chat" (`messages` required), "completions" (`prompt`
    required: a string, a list of token ids, or a list of those) or "either" (whichever is set,
    `messages` first; `missing_prompt` is the error when neither is)."""

    model: object
    kind: str = "either"
    messages: object = None
    prompt: object = None
    missing_prompt: str = "either 'prompt' or 'messages' is required"
    lora_name: str = ""
    cache_salt: str = ""
    session_key: str = ""
    tools: object = None
    template_kwargs: object = None
    add_generation_prompt: bool = True


class ServedModels(Protocol):
    """What the router knows its fleet serves (ControlPlaneClient)."""

    def models(self) -> Collection[str]: ...
    def adapters_of(self, model: str) -> Collection[str]: ...


@dataclass(slots=True)
class PreparedRequest:
    model: str  # the base model: routed among its workers
    token_ids: Sequence[int] | None  # None: not tokenized (the policy reads no tokens, or the model has no tokenizer)
    lora_name: str = ""  # "" = the served model itself
    cache_salt: str = ""
    session_key: str = ""

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens; 0 when it was not tokenized."""
        return len(self.token_ids) if self.token_ids is not None else 0


def _text_chars(content: object) -> int:
    """Characters of a message's text (a string, or OpenAI content parts' text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)
        )
    return 0


def is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)
    )


class RequestPreparer:
    def __init__(self, tokenizers: ModelTokenizers, served: ServedModels, max_prompt_tokens: int = 131072) -> None:
        self.tokenizers, self.served, self.max_prompt_tokens = tokenizers, served, max_prompt_tokens

    def resolve_model(self, request: RouteInput) -> tuple[str, str]:
        """(base model, adapter "" = none) the request asks for; PrepareError if it names neither a
        served or configured model nor an adapter of a served one."""
        model = request.model
        if not isinstance(model, str) or not model:
            raise PrepareError("'model' is required (a string)", param="model")
        served = self.served.models()
        if model in served or model in self.tokenizers.configured:
            lora_name = str(request.lora_name or "")
            if lora_name and lora_name not in self.served.adapters_of(model):
                raise PrepareError(f"The model `{lora_name}` does not exist.", "model_not_found", "lora_name")
            return model, lora_name
        for base in sorted(served):  # an adapter is named as the model (rare: the loop is off the common path)
            if model in self.served.adapters_of(base):
                return base, model
        # OpenAI's own answer, word for word (param null): clients match on it.
        raise PrepareError(f"The model `{model}` does not exist or you do not have access to it.", "model_not_found")

    async def prepare(self, request: RouteInput, tokenize: bool = True) -> PreparedRequest:
        """`tokenize=False` (a policy that reads no tokens): the prompt's shape is checked, and its
        length only from its characters (a prompt past the character bound is refused), so nothing
        is tokenized; the engine checks the rest."""
        model, lora_name = self.resolve_model(request)
        tokenizer = await self.tokenizers.get(model)
        chat = request.kind == "chat" or (request.kind == "either" and request.messages is not None)
        if (tokenizer is None or not tokenize) and (chat or request.prompt is not None):
            self._check_untokenized(request, chat, tokenizer)
            return PreparedRequest(model, None, lora_name, request.cache_salt or "", request.session_key or "")
        if chat:
            assert tokenizer is not None
            tokens = await self._chat_tokens(request, tokenizer)
        elif request.prompt is not None:
            assert tokenizer is not None
            tokens = await self._completion_tokens(request.prompt, tokenizer)
        elif request.kind == "completions":
            raise PrepareError("'prompt' is required (a string, a list of token ids, or a list of those)", param="prompt")
        else:
            raise PrepareError(request.missing_prompt)
        return PreparedRequest(model, tokens, lora_name, request.cache_salt or "", request.session_key or "")

    def _check_untokenized(self, request: RouteInput, chat: bool, tokenizer: PromptTokenizer | None) -> None:
        if chat:
            messages = request.messages
            if not isinstance(messages, list) or not messages:
                raise PrepareError("'messages' is required (a non-empty list of messages)", param="messages")
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] for m in messages):
                raise PrepareError("every message must be an object with a string 'role'", param="messages")
            # The rendered prompt holds every message's text, so their sum is a lower bound on its length.
            chars, param = sum(_text_chars(m.get("content")) for m in messages), "messages"
        else:
            prompt = request.prompt
            if isinstance(prompt, str):
                chars = len(prompt)
            elif is_token_ids(prompt):
                chars = 0
                self._check_length(prompt, "prompt")  # type: ignore[arg-type]
            elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_ids(p) for p in prompt):
                chars = max(len(p) if isinstance(p, str) else 0 for p in prompt)
                for p in prompt:
                    if not isinstance(p, str):
                        self._check_length(p, "prompt")
            else:
                raise PrepareError("'prompt' must be a string, a non-empty list of token ids, or a list of those", param="prompt")
            param = "prompt"
        if tokenizer is None:
            return
        limit = tokenizer.char_bound.max_chars(self.max_prompt_tokens)
        if limit is not None and chars > limit:
            raise PrepareError(
                f"prompt has at least {chars} characters; with this model's tokenizer (at most "
                f"{tokenizer.char_bound.chars_per_token} characters per token) that is more than "
                f"{self.max_prompt_tokens} tokens, the most this router accepts (see "
                "--max-prompt-tokens)",
                "too_long",
                param,
            )

    async def _chat_tokens(self, request: RouteInput, tokenizer: PromptTokenizer) -> Sequence[int]:
        messages = request.messages
        if not isinstance(messages, list) or not messages:
            raise PrepareError("'messages' is required (a non-empty list of messages)", param="messages")
        tools = request.tools if isinstance(request.tools, list) else None
        extra = request.template_kwargs if isinstance(request.template_kwargs, dict) else {}
        extra = {k: v for k, v in extra.items() if k not in _RESERVED_TEMPLATE_VARS}
        size = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
        return self._check_length(
            await self._tokenize(
                "messages",
                size,
                tokenizer.encode_chat,
                messages,
                request.add_generation_prompt,
                tools,
                extra,
                self.max_prompt_tokens,
            ),
            "messages",
        )

    async def _completion_tokens(self, prompt: object, tokenizer: PromptTokenizer, where: str = "prompt") -> Sequence[int]:
        if isinstance(prompt, str):
            return self._check_length(
                await self._tokenize("prompt", len(prompt), tokenizer.encode_prompt, prompt, self.max_prompt_tokens, where),
                "prompt",
            )
        if is_token_ids(prompt):
            return self._check_length(prompt, "prompt")  # type: ignore[arg-type]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_ids(p) for p in prompt):
            # A batch goes to one worker: route on its first prompt; every prompt must fit.
            batch = [await self._completion_tokens(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]
            return batch[0]
        raise PrepareError("'prompt' must be a string, a non-empty list of token ids, or a list of those", param="prompt")

    async def _tokenize(self, param: str, size: int, fn, *args) -> Sequence[int]:
        try:
            if size > THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)
        except PromptTooLong as exc:
            raise PrepareError(str(exc), "too_long", param) from exc
        except TokenizationError as exc:
            raise PrepareError(str(exc), param=param) from exc

    def _check_length(self, tokens: Sequence[int], param: str) -> Sequence[int]:
        if len(tokens) > self.max_prompt_tokens:
            raise PrepareError(
                f"prompt has {len(tokens)} tokens, more than this router accepts "
                f"({self.max_prompt_tokens}; see --max-prompt-tokens)",
                "too_long",
                param,
            )
        return tokens
