"""The segment token cache returns exactly the tokenizer's ids, and turns itself off where a
tokenizer does not split cleanly after its added tokens."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvroute.data_plane.prepare.token_cache import SegmentTokenCache, safe_boundary_tokens
from kvroute.data_plane.prepare.tokenization import load_tokenizer


def _random_chat_text(rng: random.Random) -> str:
    words = ["the", "cache", "<|end|>", "router", "ü", "<|user|>", "x", "", " y\n", "z", "<s>", "12", "\t"]
    parts = ["<|system|>\n", "<|user|>\n", "<|end|>\n", "<|assistant|>\n"]
    return "".join(
        rng.choice(parts) if rng.random() < 0.4 else " ".join(rng.choice(words) for _ in range(rng.randint(0, 20)))
        for _ in range(rng.randint(1, 12))
    )


def test_cached_ids_equal_the_tokenizers_on_random_texts(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    cache = SegmentTokenCache(tokenizer)
    assert "<|end|>" in cache.boundaries and cache.enabled
    rng = random.Random(5)
    for _ in range(400):
        text = _random_chat_text(rng)
        for add_special in (False, True):
            for _ in range(2):  # second time from the cache
                assert list(cache.encode(text, add_special)) == tokenizer.encode(text, add_special_tokens=add_special).ids
    assert cache.hit_tokens > 0 and cache.miss_tokens > 0


def test_a_new_turn_only_tokenizes_what_is_new(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    system = {"role": "system", "content": "you are a cache router " * 300}
    first = tok.encode_chat([system, {"role": "user", "content": "first question"}])
    cache = tok.segment_cache
    assert cache is not None
    before = cache.miss_tokens
    second = tok.encode_chat([system, {"role": "user", "content": "another question"}])
    assert cache.miss_tokens - before < 20  # the ~1500-token system segment came from the cache
    uncached = load_tokenizer(tiny_model_dir, cache_tokens=0)
    assert uncached.segment_cache is None
    assert second == uncached.encode_chat([system, {"role": "user", "content": "another question"}])
    assert first[:100] == second[:100]


def test_budget_bounds_the_cache(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    cache = SegmentTokenCache(tokenizer, max_tokens=500)
    for i in range(50):
        cache.encode(f"<|system|>\nprompt number {i} " * 20 + "<|end|>\n", False)
    assert cache.charged_tokens <= 500


def test_budget_bounds_memory_with_short_segments(tiny_model_dir: Path) -> None:
    # Unique short turns (a chat's last user message) are mostly bookkeeping, not ids: the budget
    # must bound the bytes they take, ~4 per token of budget, not only the ids they hold.
    import tracemalloc

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    cache = SegmentTokenCache(tokenizer, max_tokens=50_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            cache.encode(f"<|user|>\nquestion {i}<|end|>\n", False)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown <= 1.5 * 4 * 50_000, f"{grown} bytes for a 50k-token budget"


def test_tokenizer_that_prepends_to_its_first_piece_gets_no_boundaries() -> None:
    # Metaspace with prepend_scheme="first" adds "▁" to the first piece only, so tokens after an
    # added token depend on what came before: splitting there would change the ids.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|end|>"])
    tok.train_from_iterator(["hello world new line two spaces x 1234"] * 50, trainer)
    assert tok.encode("a<|end|>hello").ids != tok.encode("a<|end|>").ids + tok.encode("hello").ids
    assert safe_boundary_tokens(tok) == []
    cache = SegmentTokenCache(tok)
    assert not cache.enabled
    assert list(cache.encode("a<|end|>hello", False)) == tok.encode("a<|end|>hello", add_special_tokens=False).ids
