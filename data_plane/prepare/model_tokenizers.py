"""Every served model's own tokenizer, loaded when first needed and bounded in number.

    tokenizers = ModelTokenizers({"llama": "models/llama", "Qwen/Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B"},
                                 default_model="llama", max_loaded=8)
    tokenizer = await tokenizers.get("llama")   # PromptTokenizer, or None: the model has no tokenizer

Contract:
- A model's tokenizer comes from its configured source (`--tokenizer`, `--model-tokenizer MODEL=...`),
  else from the model's own name: a source is a local directory holding `tokenizer.json`, or a
  model id found in the local Hugging Face hub cache (`resolve_tokenizer_dir`). Nothing is ever
  downloaded: a router routes on what is on its disk.
- A model with no tokenizer (none configured, its name not in the cache) or whose tokenizer fails to
  load gets `None`: its requests are routed without their tokens (on load), and the log says so once
  per model; it is not looked up again until the router restarts.
- Loading runs in a worker thread (a tokenizer takes ~0.1-1 s: its segment-cache probes), once per
  model however many requests wait for it; at most `max_loaded` stay loaded, the least recently
  used one is dropped past that (its segment cache with it) and loaded again when asked for.
- `loads[model]` counts loads (a model loaded again and again says `max_loaded` is too small);
  `tokenized_chars` and `charged_tokens` are the sums over every loaded tokenizer (plus, for the
  first, the ones dropped), for the router's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

from kvroute.data_plane.prepare.tokenization import PromptTokenizer, load_tokenizer

log = logging.getLogger("kvroute.router.tokenizers")

DEFAULT_MAX_LOADED = 8
_MAX_REMEMBERED_MISSES = 1024  # names of models without a tokenizer, each looked up once


class TokenizerNotFound(FileNotFoundError):
    """A configured tokenizer source is neither a local directory with tokenizer.json nor a model id
    in the local Hugging Face cache."""


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where Hugging Face keeps downloaded models: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (huggingface_hub's documented order)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def cached_snapshot(model_id: str, hub_cache: Path) -> Path | None:
    """The snapshot directory of `model_id` (ORG/NAME) in the hub cache that holds tokenizer.json: the
    one `refs/main` names, else the newest; None when the cache has none."""
    if not model_id or model_id.startswith(("/", ".")) or ".." in model_id.split("/"):
        return None
    repo = hub_cache / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file():
        pinned = snapshots / main.read_text().strip()
        if (pinned / "tokenizer.json").is_file():
            return pinned
    found = [d for d in snapshots.iterdir() if (d / "tokenizer.json").is_file()]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def resolve_tokenizer_dir(source: str, hub_cache: Path | None = None) -> Path:
    """A tokenizer source -> the directory holding its tokenizer.json: `source` itself when it is a
    local directory, else the model id's snapshot in the hub cache. TokenizerNotFound otherwise."""
    directory = Path(source).expanduser()
    if directory.is_dir():
        if not (directory / "tokenizer.json").is_file():
            raise TokenizerNotFound(
                f"no tokenizer.json in {directory} (a tokenizer is a local model directory "
                "or a model id in the local Hugging Face cache)"
            )
        return directory
    cache = hub_cache if hub_cache is not None else hub_cache_dir()
    snapshot = cached_snapshot(source, cache)
    if snapshot is None:
        raise TokenizerNotFound(
            f"{source!r} is no local directory, and no model of that id with a tokenizer.json is "
            f"in the Hugging Face cache {cache} (nothing is downloaded: fetch it beforehand)"
        )
    return snapshot


def default_model_name(source: str) -> str:
    """The model a tokenizer source serves when no name is given: a directory's name, else the model id."""
    directory = Path(source).expanduser()
    return directory.resolve().name if directory.is_dir() else source


def parse_model_tokenizer(value: str) -> tuple[str, str]:
    """`MODEL=PATH_OR_ID` -> (model, source); ValueError when either side is empty."""
    model, sep, source = value.partition("=")
    if not sep or not model.strip() or not source.strip():
        raise ValueError(f"{value!r} is not MODEL=PATH_OR_ID")
    return model.strip(), source.strip()


class ModelTokenizers:
    def __init__(
        self,
        sources: Mapping[str, str],
        default_model: str,
        cache_tokens: int = 4_000_000,
        max_loaded: int = DEFAULT_MAX_LOADED,
        hub_cache: Path | None = None,
        loader: Callable[[Path, int], PromptTokenizer] | None = None,
    ) -> None:
        """`sources`: model -> local directory or model id (checked by `check_sources`); `cache_tokens`:
        each tokenizer's segment-cache budget (--tokenizer-cache-tokens)."""
        self.sources = dict(sources)
        self.default_model = default_model
        self.cache_tokens, self.max_loaded = cache_tokens, max(1, max_loaded)
        self.hub_cache = hub_cache
        self._loader = loader or (lambda directory, cache_tokens: load_tokenizer(directory, cache_tokens=cache_tokens))
        self._loaded: OrderedDict[str, PromptTokenizer] = OrderedDict()
        self._loading: dict[str, asyncio.Future[PromptTokenizer | None]] = {}
        self._without: set[str] = set()  # models found to have no tokenizer
        self.loads: Counter[str] = Counter()
        self._dropped_chars = 0  # tokenized_chars of tokenizers no longer loaded
        self._lookup = True  # False: only the preloaded tokenizers exist
        self.configured = frozenset(self.sources)  # models given a tokenizer by configuration (or preloaded)

    @classmethod
    def preloaded(cls, tokenizers: Mapping[str, PromptTokenizer], default_model: str) -> ModelTokenizers:
        """Already loaded tokenizers (tests, tools): nothing else is looked up."""
        out = cls({}, default_model, max_loaded=max(1, len(tokenizers)))
        out._loaded.update(tokenizers)
        out._lookup = False
        out.configured = frozenset(tokenizers)
        return out

    def check_sources(self) -> None:
        """Every configured source resolves (TokenizerNotFound naming the first that does not)."""
        for model, source in self.sources.items():
            try:
                resolve_tokenizer_dir(source, self.hub_cache)
            except TokenizerNotFound as exc:
                raise TokenizerNotFound(f"model {model!r}: {exc}") from None

    def loaded(self) -> list[PromptTokenizer]:
        return list(self._loaded.values())

    @property
    def tokenized_chars(self) -> int:
        return self._dropped_chars + sum(t.tokenized_chars for t in self._loaded.values())

    @property
    def charged_tokens(self) -> int:
        return sum(t.segment_cache.charged_tokens for t in self._loaded.values() if t.segment_cache is not None)

    def loaded_now(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer if it is loaded (marked as used), else None; never loads."""
        tokenizer = self._loaded.get(model)
        if tokenizer is not None:
            self._loaded.move_to_end(model)
        return tokenizer

    def load_now(self, model: str) -> PromptTokenizer | None:
        """Load the model's tokenizer in this thread (at start: the default model's, so that a bad one
        stops the router there). Raises what loading raises."""
        tokenizer = self.loaded_now(model)
        if tokenizer is None:
            tokenizer = self._load(model)
            self._keep(model, tokenizer)
        return tokenizer

    async def get(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer, loaded in a worker thread when it is not (one load per model however
        many ask); None when the model has none, or it failed to load (logged)."""
        tokenizer = self.loaded_now(model)
        if tokenizer is not None or model in self._without or not self._lookup:
            return tokenizer
        pending = self._loading.get(model)
        if pending is None:
            pending = self._loading[model] = asyncio.ensure_future(self._load_in_thread(model))
            pending.add_done_callback(lambda _f: self._loading.pop(model, None))
        return await asyncio.shield(pending)

    async def _load_in_thread(self, model: str) -> PromptTokenizer | None:
        try:
            tokenizer = await asyncio.to_thread(self._load, model)
        except TokenizerNotFound as exc:
            self._remember_without(model)
            if model in self.sources:  # configured, checked at start, and gone since
                log.error("model %r: cannot load its tokenizer (%s): routing its requests on load alone", model, exc)
            else:
                log.warning(
                    "model %r has no tokenizer (no --model-tokenizer for it, and no model of that id in the "
                    "Hugging Face cache): its requests are routed on load alone",
                    model,
                )
            return None
        except Exception as exc:  # noqa: BLE001 - a bad tokenizer file must not fail requests for it
            self._remember_without(model)
            log.error("model %r: loading its tokenizer failed (%s): routing its requests on load alone", model, exc)
            return None
        self._keep(model, tokenizer)
        return tokenizer

    def _remember_without(self, model: str) -> None:
        """Not looked up again (until a restart): one log line, not one failed load per request."""
        if len(self._without) >= _MAX_REMEMBERED_MISSES:
            self._without.clear()
        self._without.add(model)

    def _load(self, model: str) -> PromptTokenizer:
        directory = resolve_tokenizer_dir(self.sources.get(model, model), self.hub_cache)
        tokenizer = self._loader(directory, self.cache_tokens)
        # The default model's loads at start, before the listeners, where a busy port must be the only
        # line printed (the router's "listening" line names the model); the others' on their first request.
        log.log(
            logging.DEBUG if model == self.default_model else logging.INFO, "model %r: tokenizer loaded from %s", model, directory
        )
        return tokenizer

    def _keep(self, model: str, tokenizer: PromptTokenizer) -> None:
        self.loads[model] += 1
        self._loaded[model] = tokenizer
        self._loaded.move_to_end(model)
        while len(self._loaded) > self.max_loaded:
            dropped, old = self._loaded.popitem(last=False)
            self._dropped_chars += old.tokenized_chars
            log.info("model %r: tokenizer unloaded (more than --max-loaded-tokenizers=%d in use)", dropped, self.max_loaded)
