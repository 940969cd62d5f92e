"""Block keys of prompts that share long prefixes, without rehashing the shared part.

Chat traffic repeats prefixes (a system prompt, a conversation's earlier turns): the keys of
their blocks are the same every time. `PromptKeyCache.keys(...)` returns exactly
`kvroute.block_keys.prompt_block_keys(...)`, but remembers chains at checkpoints every
`CHECKPOINT_BLOCKS` blocks, found again by a 128-bit digest of the prefix's token bytes (one
C call over the bytes, ~1 µs per 8k tokens, where the chain costs a Python-level hash call per
block). A new prompt reuses the longest remembered checkpoint and chains only the blocks after it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from kvroute.block_keys import chain_block_keys, namespace_seed, pack_token_ids

CHECKPOINT_BLOCKS = 32


class PromptKeyCache:
    def __init__(self, max_checkpoints: int = 16384) -> None:
        self.max_checkpoints = max_checkpoints
        # (seed, digest of a prefix) -> (a chain that starts with that prefix, the prefix's blocks); the
        # checkpoints of one prompt share its list, so memory is one chain per distinct prompt.
        self._chains: OrderedDict[tuple[int, int], tuple[list[int], int]] = OrderedDict()
        self._seeds: dict[tuple[str, int, str, str], int] = {}
        self.hit_blocks = 0
        self.hashed_blocks = 0

    def keys(self, token_ids: Sequence[int], block_size: int, model: str, lora_name: str = "", cache_salt: str = "") -> list[int]:
        seed = self._seed(model, block_size, lora_name, cache_salt)
        tokens = pack_token_ids(token_ids)
        n_blocks = len(tokens) // block_size
        if n_blocks < CHECKPOINT_BLOCKS or self.max_checkpoints <= 0:
            return chain_block_keys(tokens, block_size, seed)
        data = memoryview(tokens).cast("B")
        stride = 4 * block_size * CHECKPOINT_BLOCKS
        last = n_blocks // CHECKPOINT_BLOCKS
        digests = {}
        keys: list[int] = []
        found = 0
        for c in range(last, 0, -1):  # longest remembered checkpoint first
            digest = digests[c] = xxhash.xxh3_128_intdigest(data[: c * stride])
            cached = self._chains.get((seed, digest))
            if cached is not None:
                self._chains.move_to_end((seed, digest))
                keys, found = cached[0][: cached[1]], c
                break
        start = found * CHECKPOINT_BLOCKS
        keys += chain_block_keys(tokens[start * block_size :], block_size, keys[-1] if keys else seed)
        self.hit_blocks += start
        self.hashed_blocks += n_blocks - start
        for c in range(found + 1, last + 1):
            digest = digests.get(c)
            if digest is None:  # pragma: no cover - every checkpoint above `found` was digested
                digest = xxhash.xxh3_128_intdigest(data[: c * stride])
            self._chains[(seed, digest)] = (keys, c * CHECKPOINT_BLOCKS)
        while len(self._chains) > self.max_checkpoints:
            self._chains.popitem(last=False)
        return keys

    def _seed(self, model: str, block_size: int, lora_name: str, cache_salt: str) -> int:
        ns = (model, block_size, lora_name or "", cache_salt or "")
        seed = self._seeds.get(ns)
        if seed is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            seed = self._seeds[ns] = namespace_seed(model, block_size, lora_name, cache_salt)
        return seed
