"""Reuse the tokens of prompt prefixes the router has already tokenized (issue: tokenization
dominates the routing decision: ~10 ms for 8k tokens, against well under 1 ms for the rest).

A Hugging Face tokenizer cuts its input at added tokens (`<|end|>`, `<|eot_id|>`, ...) before
normalizing, pre-tokenizing and merging, so text before the end of an added token never merges
with text after it: tokens(A + B) == tokens(A) + tokens(B) when A ends with such a token. Chat
templates put one after every message, so a conversation's system prompt and earlier turns are
"segments" whose tokens can be cached and a new turn only tokenizes what is new.

The cache is keyed by a chained hash of the segment texts (segment i's key covers all text up
to its end), so a cached segment is only reused after exactly the same text before it.

Not every tokenizer keeps that split clean (a Metaspace pre-tokenizer that prepends "▁" only to
the first piece, an added token that strips whitespace to its right, a post-processor that appends
EOS), so at load time each candidate boundary token is checked on probe strings: the split
encoding must equal the whole encoding, else that token is not used as a boundary. With no usable
boundary the cache is simply off and every prompt is tokenized whole.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable

import xxhash
from tokenizers import Tokenizer

_PROBES = ("hello world", " leading space", "\nnew line", "x", "  two spaces", "Ünïcode ✓", "<", "1234")
_MODE_SEEDS = {False: 0x6B76726F75746531, True: 0x6B76726F75746532}  # chat (no specials) / completions (with)

EncodeBatch = Callable[[list[str], bool], list[list[int]]]


# Below this many characters in all, pieces are encoded one by one: starting the tokenizer's
# thread pool costs more than it saves (a 2-piece batch of a chat turn: ~85 us, one by one: ~25 us).
_SMALL_BATCH_CHARS = 4096


def _encode_batch(tokenizer: Tokenizer) -> EncodeBatch:
    def encode(texts: list[str], add_special: bool) -> list[list[int]]:
        if sum(map(len, texts)) < _SMALL_BATCH_CHARS:  # short: holding the GIL this long is fine
            return [tokenizer.encode(t, add_special_tokens=add_special).ids for t in texts]
        # encode_batch releases the GIL (encode does not) and runs the pieces in parallel.
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=add_special)]

    return encode


def safe_boundary_tokens(tokenizer: Tokenizer) -> list[str]:
    """Added tokens after which the tokenizer's output splits exactly (checked on probe strings)."""
    encode = _encode_batch(tokenizer)
    rights = encode(list(_PROBES), False)  # the same for every token: encoded once
    pairs = [(i, j) for i in range(len(_PROBES)) for j in range(len(_PROBES))]

    def splits_cleanly(token: str) -> bool:
        # Two batch calls per mode, not one call per probe pair: tokenizers with hundreds of
        # reserved added tokens are checked at router start-up.
        for add_special in (False, True):
            lefts = encode([a + token for a in _PROBES], add_special)
            wholes = encode([_PROBES[i] + token + _PROBES[j] for i, j in pairs], add_special)
            if any(whole != lefts[i] + rights[j] for whole, (i, j) in zip(wholes, pairs)):
                return False
        return True

    # rstrip/single_word look at the text after the token; normalized tokens match normalized
    # text, which a raw-text scan would not see the same way.
    return [
        added.content
        for added in tokenizer.get_added_tokens_decoder().values()
        if added.content and not (added.rstrip or added.single_word or added.normalized) and splits_cleanly(added.content)
    ]


# One cached segment costs ~260 bytes besides its ids (dict entry, key, array object; measured with
# tracemalloc on CPython 3.11): a ten-token user turn costs 300 bytes, not 40. Charging it in token
# units (4 bytes each) keeps `max_tokens` a memory bound, ~4 bytes x max_tokens, whatever the
# segments' lengths. Found by the soak: unique short turns grew a router by 9.4 MB in 30 minutes
# while the cache held 0.36M of its 4M tokens.
SEGMENT_OVERHEAD_TOKENS = 64


def _chain(key: int, piece: str) -> int:
    return xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"), seed=key)


class SegmentTokenCache:
    """Tokens of text segments ending in a boundary token, keyed by the chained hash of the text
    up to them; LRU bounded by the number of cached tokens, each segment charged its ids plus
    SEGMENT_OVERHEAD_TOKENS for its bookkeeping. Thread-safe (long prompts are tokenized in worker
    threads)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 4_000_000, boundaries: list[str] | None = None) -> None:
        self._encode = _encode_batch(tokenizer)
        self.boundaries = safe_boundary_tokens(tokenizer) if boundaries is None else boundaries
        # Longest first: at one position the tokenizer matches the longest added token.
        alternatives = sorted(self.boundaries, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self.max_tokens = max_tokens
        # Packed u32 ids: a hit is a memcpy, and the block-key hash takes the packed bytes as they are.
        self._segments: OrderedDict[int, array] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self.hit_tokens = 0
        self.miss_tokens = 0

    @property
    def enabled(self) -> bool:
        return self._pattern is not None and self.max_tokens > 0

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int | None = None) -> array:
        """Exactly the tokenizer's `encode(text, add_special_tokens)` ids, packed as array('I'),
        reusing cached segments. A prompt of more than `max_tokens` tokens will be rejected: its new
        segments are not kept (they would evict the segments of prompts that are served)."""
        ends = [m.end() for m in self._pattern.finditer(text)] if self.enabled else []  # type: ignore[union-attr]
        if not ends:
            return array("I", self._encode([text], add_special_tokens)[0])
        tokens = array("I")
        key = _MODE_SEEDS[add_special_tokens]  # chained: the key of everything before `start`
        start = hit = 0
        with self._lock:
            for end in ends:
                next_key = _chain(key, text[start:end])
                cached = self._segments.get(next_key)
                if cached is None:
                    break
                self._segments.move_to_end(next_key)
                tokens += cached
                key, start, hit = next_key, end, hit + 1
        self.hit_tokens += len(tokens)
        if start == len(text):
            return tokens
        # The rest, piece by piece in one batch call, so each new full segment can be cached. The
        # piece after the last boundary (e.g. the generation prompt's tail) is never cached.
        cuts = ends[hit:]
        if not cuts or cuts[-1] != len(text):
            cuts.append(len(text))
        pieces = [text[a:b] for a, b in zip([start, *cuts[:-1]], cuts)]
        if add_special_tokens and start == 0:  # only the prompt's first piece gets the post-processor's BOS
            encoded = self._encode(pieces[:1], True) + self._encode(pieces[1:], False)
        else:
            encoded = self._encode(pieces, False)
        new: list[tuple[int, array]] = []
        for piece, ids, cut in zip(pieces, encoded, cuts):
            packed = array("I", ids)
            tokens += packed
            self.miss_tokens += len(ids)
            if cut <= ends[-1]:
                key = _chain(key, piece)
                new.append((key, packed))
        if max_tokens is None or len(tokens) <= max_tokens:
            self._store(new)
        return tokens

    def _store(self, new: list[tuple[int, array]]) -> None:
        with self._lock:
            for key, ids in new:
                if key in self._segments:
                    continue
                self._segments[key] = ids
                self._cached_tokens += len(ids) + SEGMENT_OVERHEAD_TOKENS
            while self._cached_tokens > self.max_tokens and self._segments:
                _, ids = self._segments.popitem(last=False)
                self._cached_tokens -= len(ids) + SEGMENT_OVERHEAD_TOKENS

    @property
    def charged_tokens(self) -> int:
        """What the cache holds against `max_tokens`: its ids plus each segment's overhead."""
        return self._cached_tokens
