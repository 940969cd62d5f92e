"""Golden vectors pin kvroute's block keys: agent and router must compute identical keys forever."""

from __future__ import annotations

import pytest

from kvroute.block_keys import chain_block_keys, namespace_seed, prompt_block_keys

# Computed once with the scheme in kvroute/block_keys.py; a change here is a wire break.
GOLDEN_SEED = 7055138172396458146  # namespace_seed("m", 16)
GOLDEN_KEYS = [5184855369764459965, 14942883022103350168]  # tokens 1..32, block 16, model "m"


def test_golden_vectors() -> None:
    assert namespace_seed("m", 16) == GOLDEN_SEED
    assert prompt_block_keys(list(range(1, 33)), 16, "m") == GOLDEN_KEYS


def test_partial_block_gets_no_key() -> None:
    assert prompt_block_keys(list(range(1, 40)), 16, "m") == GOLDEN_KEYS
    assert prompt_block_keys(list(range(1, 16)), 16, "m") == []


def test_chaining_continues_from_parent() -> None:
    tokens = list(range(100, 164))
    full = prompt_block_keys(tokens, 16, "m")
    head = prompt_block_keys(tokens[:32], 16, "m")
    tail = chain_block_keys(tokens[32:], 16, head[-1])
    assert head + tail == full


def test_key_depends_on_whole_prefix() -> None:
    a = prompt_block_keys([1] * 16 + [2] * 16, 16, "m")
    b = prompt_block_keys([3] * 16 + [2] * 16, 16, "m")
    assert a[1] != b[1]


@pytest.mark.parametrize("field", ["model", "lora_name", "cache_salt", "block_size"])
def test_namespaces_never_share_keys(field: str) -> None:
    base = {"model": "m", "block_size": 16, "lora_name": "", "cache_salt": ""}
    other = dict(base, **{field: 32 if field == "block_size" else "x"})
    assert namespace_seed(**base) != namespace_seed(**other)


def test_rejects_out_of_range_tokens() -> None:
    with pytest.raises(ValueError, match="32-bit"):
        prompt_block_keys([-1] * 16, 16, "m")
    with pytest.raises(ValueError, match="32-bit"):
        prompt_block_keys([2**32] * 16, 16, "m")
    with pytest.raises(ValueError, match="block_size"):
        namespace_seed("m", 0)


def test_pack_token_ids_passes_packed_arrays_through_and_rejects_ids_past_u32() -> None:
    from array import array

    from kvroute.block_keys import pack_token_ids

    packed = array("I", [1, 2, 3])
    assert pack_token_ids(packed) is packed
    assert pack_token_ids([1, 2, 3]) == packed and pack_token_ids(array("q", [1, 2, 3])) == packed
    with pytest.raises(ValueError, match="32-bit"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="32-bit"):
        pack_token_ids([-1])
