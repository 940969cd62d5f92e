"""Engine block hashes against the test vectors of docs/wire-formats.md#sglang-block-hashes and
docs/wire-formats.md#tensorrt-llm-block-hashes, and the labeler's keys."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.tools.sim_engine.engine_hashes import (
    DialectLabeler,
    SglangChainedHashes,
    SglangContentHashes,
    TrtllmV1Hashes,
    TrtllmV2Hashes,
    VllmHashes,
    sglang_namespace_seed,
    sglang_namespaced_hash,
    signed64,
    trtllm_v1_block_hash,
)
from kvroute.tools.sim_engine.prefix_cache import BASE_NAMESPACE, CacheNamespace, PrefixCache, StoredEvent

ONE_TO_16 = list(range(1, 17))


def test_sglang_chained_sha256_matches_the_spec_vector() -> None:
    ((published, digest),) = SglangChainedHashes().chain([0], [ONE_TO_16], None, BASE_NAMESPACE)
    assert digest.hex().startswith("77d735ce") and digest.hex().endswith("42be9b07")
    assert published == 8635429971592222890
    # The second page chains on the whole first digest: SHA256(d1 || u32le tokens).
    page2 = list(range(17, 33))
    (_, first), (second, _) = SglangChainedHashes().chain([0, 0], [ONE_TO_16, page2], None, BASE_NAMESPACE)
    expected = hashlib.sha256(first + struct.pack("<16I", *page2)).digest()
    assert second == int.from_bytes(expected[:8], "big", signed=True)


def test_sglang_salt_and_lora_namespacing_only_from_0_5_20() -> None:
    salted = CacheNamespace(cache_salt="tenant")
    lora = CacheNamespace(lora_name="sql", lora_id=1)
    plain = SglangChainedHashes().chain([0], [ONE_TO_16], None, BASE_NAMESPACE)[0][0]
    assert SglangChainedHashes(namespaced=False).chain([0], [ONE_TO_16], None, salted)[0][0] == plain
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0tenant").digest()
    expected = hashlib.sha256(prior + struct.pack("<16I", *ONE_TO_16)).digest()
    assert SglangChainedHashes(namespaced=True).chain([0], [ONE_TO_16], None, salted)[0][0] == int.from_bytes(
        expected[:8], "big", signed=True
    )
    mapped = SglangChainedHashes(namespaced=True).chain([0], [ONE_TO_16], None, lora)[0][0]
    seed = sglang_namespace_seed("sql")
    assert (
        mapped
        == int.from_bytes(hashlib.sha256(seed + plain.to_bytes(8, "big", signed=True)).digest()[:8], "big", signed=True)
        == sglang_namespaced_hash(seed, plain)
    )


def test_sglang_content_hashes_are_not_chained() -> None:
    page = [5] * 16
    a = SglangContentHashes().chain([0, 0], [ONE_TO_16, page], None, BASE_NAMESPACE)
    b = SglangContentHashes().chain([0], [page], None, BASE_NAMESPACE)
    assert a[1][0] == b[0][0] == hash(tuple(page))  # the same page after another prefix: the same hash


def test_trtllm_v1_matches_the_spec_vector_and_mixes_parent_lora_and_salt() -> None:
    assert trtllm_v1_block_hash(ONE_TO_16) == 0x53FE95E8F74D8634  # = 6052439777046529588
    parent = 0x1234_5678_9ABC_DEF0
    assert trtllm_v1_block_hash([], parent) == (parent * 0xBF58476D1CE4E5B9) & (2**64 - 1)  # seed of an empty block
    base = trtllm_v1_block_hash(ONE_TO_16, parent)
    assert (
        len(
            {
                base,
                trtllm_v1_block_hash(ONE_TO_16, parent, lora_task_id=3),
                trtllm_v1_block_hash(ONE_TO_16, 0, salt_id=7),
                trtllm_v1_block_hash(ONE_TO_16),
            }
        )
        == 4
    )
    assert trtllm_v1_block_hash(ONE_TO_16, parent, salt_id=7) == base  # the salt only enters the first block
    chain = TrtllmV1Hashes().chain([0, 0], [ONE_TO_16, ONE_TO_16], None, BASE_NAMESPACE)
    assert chain[1][0] == trtllm_v1_block_hash(ONE_TO_16, chain[0][0])
    signed = TrtllmV1Hashes(signed=True).chain([0], [ONE_TO_16], None, BASE_NAMESPACE)
    assert signed[0][0] == signed64(6052439777046529588)
    assert signed64(2**64 - 1) == -1 and signed64(2**63 - 1) == 2**63 - 1


def test_trtllm_v2_hashes_are_64_hex_digits_chained() -> None:
    (h1, d1), (h2, _) = TrtllmV2Hashes().chain([0, 0], [ONE_TO_16, ONE_TO_16], None, BASE_NAMESPACE)
    assert len(h1) == 64 and int(h1, 16) >= 0 and h1 != h2 and bytes.fromhex(h1) == d1


@pytest.mark.parametrize("form", ["u64", "i64", "bytes"])
def test_vllm_forms_of_the_identity(form: str) -> None:
    ident = 2**127 + 2**63 + 5
    ((value, _),) = VllmHashes(form).chain([ident], [ONE_TO_16], None, BASE_NAMESPACE)
    assert value == {"u64": 2**63 + 5, "i64": -(2**63) + 5, "bytes": ident.to_bytes(16, "big")}[form]


def test_labeler_keys_are_kvroutes_prompt_keys_and_continue_from_the_parent() -> None:
    ns = CacheNamespace(lora_name="sql", lora_id=1, cache_salt="s")
    cache = PrefixCache(64, 16, "t", labeler=DialectLabeler("m", 16, SglangChainedHashes(namespaced=True)))
    tokens = list(range(100, 164))
    hashes = cache.chain_hashes(tokens, namespace=ns)
    alloc = cache.allocate(hashes, 64, 65, ns)
    cache.commit(alloc, hashes[:2], tokens[:32])
    cache.commit(alloc, hashes[2:], tokens[32:])  # a second run continues the chain from its parent record
    first, second = cache.take_events()
    assert isinstance(first, StoredEvent) and second.parent_block_hash == first.block_hashes[-1]
    expected = SglangChainedHashes(namespaced=True).chain([0] * 4, [tokens[i : i + 16] for i in range(0, 64, 16)], None, ns)
    assert first.block_hashes + second.block_hashes == [p for p, _ in expected]
    keys = cache.block_keys()
    assert keys["GPU"] == prompt_block_keys(tokens, 16, "m", "sql", "s") and keys["CPU"] == []
    with pytest.raises(RuntimeError):
        PrefixCache(8, 4).block_keys()
