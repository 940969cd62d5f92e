"""Per-model tokenizers: found in a local directory or the local Hugging Face cache (never downloaded),
loaded once when first asked for, at most `max_loaded` at a time (least recently used out first)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kvroute.data_plane.prepare.model_tokenizers import (
    ModelTokenizers,
    TokenizerNotFound,
    hub_cache_dir,
    parse_model_tokenizer,
    resolve_tokenizer_dir,
)
from kvroute.data_plane.prepare.tokenization import load_tokenizer


def _hub_snapshot(hub: Path, model_id: str, tiny_model_dir: Path, commit: str = "abc123") -> Path:
    """The hub cache's layout for one model: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_source_is_a_directory_or_a_model_id_in_the_hub_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = _hub_snapshot(hub, "org/tiny-chat", tiny_model_dir)
    _hub_snapshot(hub, "org/older", tiny_model_dir, commit="0ld")
    assert resolve_tokenizer_dir(str(tiny_model_dir), hub) == tiny_model_dir
    assert resolve_tokenizer_dir("org/tiny-chat", hub) == snapshot
    (hub / "models--org--older" / "refs" / "main").write_text("gone")  # refs/main names no snapshot: the newest
    assert resolve_tokenizer_dir("org/older", hub).name == "0ld"
    with pytest.raises(TokenizerNotFound, match="nothing is downloaded"):
        resolve_tokenizer_dir("org/not-cached", hub)
    with pytest.raises(TokenizerNotFound, match="no tokenizer.json"):
        resolve_tokenizer_dir(str(tmp_path), hub)
    assert hub_cache_dir({"HF_HOME": "/x"}) == Path("/x/hub")
    assert hub_cache_dir({"HF_HUB_CACHE": "/y", "HF_HOME": "/x"}) == Path("/y")
    assert parse_model_tokenizer(" m = org/id ") == ("m", "org/id")
    with pytest.raises(ValueError, match="MODEL=PATH_OR_ID"):
        parse_model_tokenizer("org/id")


def test_tokenizers_load_lazily_once_and_at_most_max_loaded(tmp_path: Path, tiny_model_dir: Path) -> None:
    hub = tmp_path / "hub"
    _hub_snapshot(hub, "org/served-by-name", tiny_model_dir)
    loaded_from: list[Path] = []

    def loader(directory: Path, cache_tokens: int):
        loaded_from.append(directory)
        return load_tokenizer(directory, cache_tokens=cache_tokens)

    tokenizers = ModelTokenizers(
        {"a": str(tiny_model_dir), "b": str(tiny_model_dir)}, "a", max_loaded=2, hub_cache=hub, loader=loader
    )
    tokenizers.check_sources()

    async def scenario() -> None:
        assert loaded_from == []  # nothing until asked for
        first = await asyncio.gather(*(tokenizers.get("a") for _ in range(5)))
        assert len({id(t) for t in first}) == 1 and tokenizers.loads["a"] == 1  # five waiters, one load
        await tokenizers.get("b")
        by_name = await tokenizers.get("org/served-by-name")  # not configured: its own id in the hub cache
        assert by_name is not None and tokenizers.loads["org/served-by-name"] == 1
        assert len(tokenizers.loaded()) == 2 and tokenizers.loaded_now("a") is None  # "a" was the least recent
        await tokenizers.get("a")
        assert tokenizers.loads["a"] == 2 and len(tokenizers.loaded()) == 2
        assert await tokenizers.get("not-anywhere") is None
        assert await tokenizers.get("not-anywhere") is None
        assert len(loaded_from) == 4  # a, b, the hub one, a again; the missing one is looked up once

    asyncio.run(scenario())


def test_a_configured_source_that_does_not_resolve_is_refused_at_start(tmp_path: Path) -> None:
    tokenizers = ModelTokenizers({"m": "org/not-cached"}, "m", hub_cache=tmp_path)
    with pytest.raises(TokenizerNotFound, match="model 'm'"):
        tokenizers.check_sources()


def test_a_tokenizer_that_fails_to_load_is_tried_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not a tokenizer")
    tokenizers = ModelTokenizers({"m": str(broken)}, "m", hub_cache=tmp_path)
    tokenizers.check_sources()  # it is there: whether it loads is known when it is first needed

    async def twice() -> list:
        return [await tokenizers.get("m"), await tokenizers.get("m")]

    assert asyncio.run(twice()) == [None, None]
    failures = [r for r in caplog.records if "loading its tokenizer failed" in r.getMessage()]
    assert len(failures) == 1 and tokenizers.loads["m"] == 0
