"""The character bound (data_plane/prepare/char_bound.py): K is the most characters one token can cover, so
no prompt that fits in N tokens is ever longer than N * K characters; pipelines that can drop text
get no bound. Also: an over-long prompt never reaches the tokenizer, and one that is tokenized and
rejected leaves nothing in the segment cache."""

from __future__ import annotations

import random
import unicodedata

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvroute.data_plane.prepare.char_bound import CANONICAL_DECOMPOSITION_MAX, char_bound
from kvroute.data_plane.prepare.tokenization import PromptTokenizer, PromptTooLong, load_tokenizer
from kvroute.tools.tiny_model import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> PromptTokenizer:
    return load_tokenizer(tiny_model_dir)


def test_canonical_decomposition_max_is_unicodes() -> None:
    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)) == CANONICAL_DECOMPOSITION_MAX


def test_tiny_tokenizer_bound_is_its_longest_token(tiny: PromptTokenizer) -> None:
    vocab = tiny.tokenizer.get_vocab(with_added_tokens=True)
    assert tiny.char_bound.chars_per_token == max(map(len, vocab)) == 13


def test_no_prompt_that_fits_is_rejected(tiny: PromptTokenizer) -> None:
    """The worst case for the bound: text made only of the longest tokens, decoded back to text."""
    k = tiny.char_bound.chars_per_token
    assert k is not None
    entries = sorted(tiny.tokenizer.get_vocab(), key=len, reverse=True)
    rng = random.Random(5)
    texts = [
        tiny.tokenizer.decode([tiny.tokenizer.token_to_id(entries[0])] * 300),
        tiny.tokenizer.decode([tiny.tokenizer.token_to_id(rng.choice(entries[:50])) for _ in range(300)]),
        tiny.tokenizer.decode(list(range(7, 2048))),
    ]
    for text in texts:
        n = len(tiny.tokenizer.encode(text).ids)
        assert len(text) <= n * k, (len(text), n)
        assert len(tiny.encode_prompt(text, max_tokens=n)) == n  # exactly at the limit: accepted


def test_an_over_long_prompt_never_reaches_the_tokenizer(tiny: PromptTokenizer) -> None:
    before = tiny.tokenized_chars
    with pytest.raises(PromptTooLong, match="characters"):
        tiny.encode_prompt("x" * 13001, max_tokens=1000)
    with pytest.raises(PromptTooLong):  # chat: the rendered text counts (here only the content is long)
        tiny.encode_chat([{"role": "user", "content": "x" * 13000}], max_tokens=1000)
    assert tiny.tokenized_chars == before
    tiny.encode_prompt("x" * 1000, max_tokens=1000)
    assert tiny.tokenized_chars == before + 1000


def test_a_rejected_prompt_is_not_kept_in_the_segment_cache(tiny: PromptTokenizer) -> None:
    cache = tiny.segment_cache
    assert cache is not None and cache.enabled
    held = len(cache._segments)
    history = [{"role": "user", "content": "cache " * 400}, {"role": "assistant", "content": "ok"}]
    ids = tiny.encode_chat(history + [{"role": "user", "content": "next"}], max_tokens=300)  # 400+ tokens: too many
    assert len(ids) > 300 and len(cache._segments) == held
    tiny.encode_chat(history + [{"role": "user", "content": "next"}], max_tokens=1000)
    assert len(cache._segments) > held


def _bpe(vocab: dict[str, int], **kw) -> Tokenizer:
    return Tokenizer(models.BPE(vocab=vocab, merges=[], **kw))


VOCAB = {"<unk>": 0, "a": 1, "b": 2, "▁": 3, "ab": 4, "abba": 5}


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: _bpe(VOCAB, unk_token="<unk>"), 5),  # one unk per unknown character
        (lambda: _bpe(VOCAB, unk_token="<unk>", fuse_unk=True), None),  # a run of them is one token
        (lambda: _bpe(VOCAB), None),  # unknown characters vanish
        (lambda: _bpe(VOCAB, byte_fallback=True), 5),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), normalizer=normalizers.NFKC()), 5 * CANONICAL_DECOMPOSITION_MAX),
        (
            lambda: _with(
                _bpe(VOCAB, unk_token="<unk>"),
                normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
            ),
            5,
        ),  # Llama-2 style
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), normalizer=normalizers.Replace("ab", "")), None),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), normalizer=normalizers.Strip()), None),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), normalizer=normalizers.BertNormalizer()), None),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), pre_tokenizer=pre_tokenizers.Whitespace()), None),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), pre_tokenizer=pre_tokenizers.Metaspace()), 5),
        (lambda: _with(_bpe(VOCAB, unk_token="<unk>"), pre_tokenizer=pre_tokenizers.Split("a", "removed")), None),
        (lambda: _with(_bpe(VOCAB), pre_tokenizer=pre_tokenizers.ByteLevel()), None),  # its vocab lacks the byte alphabet
        (lambda: Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), None),
        (lambda: Tokenizer(models.Unigram([("<unk>", 0.0), ("abc", -1.0)], 0, byte_fallback=False)), None),
        (lambda: _truncating(_bpe(VOCAB, unk_token="<unk>")), None),
    ],
)
def test_bound_by_pipeline(build, expected) -> None:
    bound = char_bound(build())
    assert bound.chars_per_token == expected, bound
    assert bound.why


def test_added_tokens_count(tiny: PromptTokenizer) -> None:
    tok = _bpe(VOCAB, unk_token="<unk>")
    tok.add_special_tokens(["<|a much longer special token|>"])
    assert char_bound(tok).chars_per_token == len("<|a much longer special token|>")
    assert PromptTokenizer(tok, CHAT_TEMPLATE).char_bound.chars_per_token == 31


def _with(tok: Tokenizer, **parts) -> Tokenizer:
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


def _truncating(tok: Tokenizer) -> Tokenizer:
    tok.enable_truncation(16)
    return tok
