"""PromptKeyCache returns exactly prompt_block_keys while reusing remembered prefixes."""

from __future__ import annotations

import random

from kvroute.block_keys import prompt_block_keys
from kvroute.data_plane.prepare.prompt_keys import CHECKPOINT_BLOCKS, PromptKeyCache


def test_same_keys_as_the_plain_chain_for_shared_and_unrelated_prompts() -> None:
    rng = random.Random(7)
    cache = PromptKeyCache(max_checkpoints=64)
    system = [rng.randrange(60_000) for _ in range(6000)]
    for i in range(150):
        prompt = system[: rng.randrange(0, len(system))] + [rng.randrange(60_000) for _ in range(rng.randrange(0, 400))]
        if i % 7 == 0:
            prompt = [rng.randrange(60_000) for _ in range(rng.randrange(0, 3000))]  # unrelated
        for bs, lora, salt in ((16, "", ""), (32, "adapter", ""), (16, "", "salt")):
            assert cache.keys(prompt, bs, "m", lora, salt) == prompt_block_keys(prompt, bs, "m", lora, salt)
    assert cache.hit_blocks > cache.hashed_blocks  # the shared system prompt was mostly reused
    assert len(cache._chains) <= 64  # bounded


def test_namespaces_never_share_keys() -> None:
    cache = PromptKeyCache()
    prompt = list(range(CHECKPOINT_BLOCKS * 16 * 3))
    base = cache.keys(prompt, 16, "m")
    assert cache.keys(prompt, 16, "m", lora_name="a") != base
    assert cache.keys(prompt, 16, "m", cache_salt="s") != base
    assert cache.keys(prompt, 16, "other") != base
    assert cache.keys(prompt, 16, "m") == base
