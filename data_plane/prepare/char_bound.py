"""How many characters of text one token can stand for, read from a tokenizer's own configuration.

The router rejects a prompt whose text is longer than `max_prompt_tokens * K` characters without
tokenizing it (tokenizing megabytes costs seconds and ~100 bytes of memory per character). That
is only allowed if no prompt that fits in `max_prompt_tokens` tokens can be that long, so K must
be the most characters any single token can cover, for this tokenizer:

- every token the model emits is a vocabulary entry or an added token, and covers at most as many
  characters of the *normalized* text as its string has: a byte-level entry has one character
  per byte (and a character is at least one byte), a Metaspace entry one per character
  ("▁" stands for one space), a byte-fallback entry `<0xAB>` one byte;
- the normalizer may shrink the text: NFC/NFKC compose at most `CANONICAL_DECOMPOSITION_MAX`
  code points into one; a string Replace shrinks by len(pattern) / len(content);
- provided nothing is dropped on the way: no normalizer or pre-tokenizer that deletes characters
  (Strip, StripAccents, BERT's cleaning, SentencePiece's precompiled map, whitespace splitters,
  a Replace or Split that removes), no unknown character that vanishes (a BPE without unk token
  or byte fallback) or merges with its neighbours into one token (`fuse_unk`, Unigram's unk,
  WordPiece's and WordLevel's whole-word [UNK]), and no truncation.

So K = normalizer shrink x longest entry. For a pipeline that may drop text there is no such K and
the bound is off (`None`): the body-size cap is then what limits the tokenizer's work. A chat
template only adds text and the bound is checked on the rendered text, so a template that leaves
something out (e.g. old reasoning) cannot cause a false rejection either.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

# The longest canonical decomposition of one code point (Greek with breathing, accent and
# iota subscript, e.g. U+1F82): what NFC/NFKC can compose into one character. Checked against
# Python's unicodedata by the tests.
CANONICAL_DECOMPOSITION_MAX = 4

_NON_SHRINKING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # keep all text unless behavior is Removed


@dataclass(frozen=True)
class CharBound:
    """`chars_per_token` is K, or None when the tokenizer may drop text (then `why` says what)."""

    chars_per_token: int | None
    why: str

    def max_chars(self, max_tokens: int) -> int | None:
        return None if self.chars_per_token is None else max_tokens * self.chars_per_token


def _normalizer_shrink(spec: dict | None) -> tuple[float | None, str]:
    if spec is None:
        return 1.0, ""
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            factor, why = _normalizer_shrink(part)
            if factor is None:
                return None, why
            total *= factor
        return total, ""
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1.0, ""
    if kind in _COMPOSING_NORMALIZERS:
        return float(CANONICAL_DECOMPOSITION_MAX), ""
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is not None and content:
            return max(1.0, len(pattern) / len(content)), ""
        return None, "a Replace normalizer may remove text"
    return None, f"the {kind} normalizer may remove text"


def _pre_tokenizer_keeps_text(spec: dict | None) -> tuple[bool, str]:
    if spec is None:
        return True, ""
    kind = spec.get("type")
    if kind == "Sequence":
        for part in spec.get("pretokenizers", []):
            keeps, why = _pre_tokenizer_keeps_text(part)
            if not keeps:
                return False, why
        return True, ""
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True, ""
    if kind in _SPLITTING_PRE_TOKENIZERS and spec.get("behavior") != "Removed":
        return True, ""
    return False, f"the {kind} pre-tokenizer may drop text"


def _uses_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_uses_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _model_entries(model: dict, pre_tokenizer: dict | None) -> tuple[list[str] | None, str]:
    """The model's vocabulary strings, or None with the reason when it can lose text."""
    kind = model.get("type")
    if kind == "BPE":
        vocab = list(model.get("vocab", {}))
        byte_level = _uses_byte_level(pre_tokenizer) and set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)
        if byte_level or model.get("byte_fallback"):
            return vocab, ""
        if model.get("unk_token") and not model.get("fuse_unk"):
            return vocab, ""  # one unk token per unknown character
        return None, (
            "a run of unknown characters becomes one token (fuse_unk)"
            if model.get("unk_token")
            else "unknown characters are dropped (no unk token, no byte fallback)"
        )
    if kind == "Unigram":
        if model.get("byte_fallback"):
            return [piece for piece, _score in model.get("vocab", [])], ""
        return None, "a run of unknown characters becomes one unk token (Unigram without byte fallback)"
    return None, f"a {kind} model turns a whole unknown word into one token"


def char_bound(tokenizer: Tokenizer) -> CharBound:
    config: dict[str, Any] = json.loads(tokenizer.to_str())
    if config.get("truncation"):
        return CharBound(None, "the tokenizer truncates")
    shrink, why = _normalizer_shrink(config.get("normalizer"))
    if shrink is None:
        return CharBound(None, why)
    keeps, why = _pre_tokenizer_keeps_text(config.get("pre_tokenizer"))
    if not keeps:
        return CharBound(None, why)
    entries, why = _model_entries(config.get("model", {}), config.get("pre_tokenizer"))
    if entries is None:
        return CharBound(None, why)
    longest = max(map(len, entries + [a.get("content", "") for a in config.get("added_tokens", [])]), default=1)
    k = max(1, math.ceil(shrink * longest))
    return CharBound(k, f"longest token {longest} characters" + (f" x {shrink:g} (normalizer)" if shrink > 1 else ""))
