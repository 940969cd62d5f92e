"""kvroute block keys: the one hashing scheme the agent and the router must agree on.

Engine block hashes are opaque per-worker ids (they change with engine version, hash
algorithm and PYTHONHASHSEED), so kvroute derives its own key for every *full* block of
token ids:

    seed    = xxh3_64(b"kvroute-block-key-v1\\0" + model \\0 lora_name \\0 cache_salt \\0 block_size)
    key[0]  = xxh3_64(u32le(tokens[0:bs]),      seed=seed)
    key[i]  = xxh3_64(u32le(tokens[i*bs:(i+1)*bs]), seed=key[i-1])

Chaining makes a key identify the whole prefix up to and including its block, so a
prefix match is "walk the keys until a worker stops holding them". The agent computes keys
from BlockStored.token_ids (continuing from the parent's key), the router from the
tokenized prompt. Golden vectors in tests/test_block_keys.py pin this; changing it is a
wire break.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_SEED_DOMAIN = b"kvroute-block-key-v1\0"
_xxh3 = xxhash.xxh3_64_intdigest


def namespace_seed(model: str, block_size: int, lora_name: str = "", cache_salt: str = "") -> int:
    """Seed of the first block's key: requests in different namespaces never share keys."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    material = "\0".join((model, lora_name or "", cache_salt or "", str(block_size)))
    return _xxh3(_SEED_DOMAIN + material.encode("utf-8"))


_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_token_ids(token_ids: Sequence[int]) -> array:
    """Token ids as array('I'), the packed form the router's tokenizer and the simulator pass
    around; an array('I') is returned as it is (no per-token work). ValueError outside u32."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids
    try:
        return array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must fit in an unsigned 32-bit integer") from exc


def _u32le(token_ids: Sequence[int]) -> bytes:
    packed = pack_token_ids(token_ids)
    if packed.itemsize != 4:  # pragma: no cover - exotic platforms only
        raise RuntimeError("platform 'I' array is not 32-bit")
    if not _LITTLE_ENDIAN:  # pragma: no cover - big-endian hosts; copy, the caller's array stays as it is
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()


def chain_block_keys(token_ids: Sequence[int], block_size: int, parent_key: int) -> list[int]:
    """Keys of every full block of `token_ids`, chained from `parent_key`.

    `parent_key` is the key of the block before `token_ids[0]`, or `namespace_seed(...)`
    when `token_ids` starts the prompt. A trailing partial block gets no key (engines only
    cache full blocks).
    """
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    data = memoryview(_u32le(token_ids[: n_blocks * block_size]))
    stride = 4 * block_size
    keys = [0] * n_blocks
    key = parent_key
    for i in range(n_blocks):
        key = _xxh3(data[i * stride : (i + 1) * stride], seed=key)
        keys[i] = key
    return keys


def prompt_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str = "",
    cache_salt: str = "",
) -> list[int]:
    """Keys of a prompt's full blocks in its namespace (what the router queries with)."""
    return chain_block_keys(token_ids, block_size, namespace_seed(model, block_size, lora_name, cache_salt))
