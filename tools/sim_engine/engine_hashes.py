"""The block hashes each simulated engine publishes, and the labeler that attaches them to cached blocks.

The prefix cache identifies blocks by its own chained xxh3 (`PrefixCache.chain_hashes`). What an
engine puts in its KV events is its own hash function's value, written from docs/wire-formats.md
(sections and test vectors named below; no engine code):

- vLLM: the cache identity itself, as vLLM's wire form of the era: signed int64 (0.9.x builtin
  `hash`), unsigned 64-bit (>= 0.10.2: the last 8 bytes of the digest) or, with the
  keep-bytes option, the 16-byte digest (docs/wire-formats.md#vllm-block-hashes).
- SGLang 0.4.8-0.5.5: `hash(tuple(page_tokens))`, content only, not chained
  (docs/wire-formats.md#sglang-block-hashes). Python's hash of a tuple of ints does not depend on
  PYTHONHASHSEED, so this is SGLang's exact value.
- SGLang >= 0.5.6: d_i = SHA256(d_{i-1} || tokens as u32 LE), no prior for the first page; the
  wire value is the first 8 bytes of d_i, big-endian, signed (docs/wire-formats.md#sglang-block-hashes, test vector
  tokens 1..16).
  From 0.5.20 a cache salt starts the chain at SHA256("sglang-cache-salt-v1\\0" + salt), and a
  LoRA adapter maps each published value through `sglang_namespaced_hash`.
- TensorRT-LLM v1_block_key (docs/wire-formats.md#tensorrt-llm-block-hashes, test vector tokens 1..16
  parent 0): a 64-bit mix over the token ids seeded by the parent hash; a LoRA task id and (first block only) a cache-salt id are
  mixed in. Published as uint64 on the pull path and as signed int64 by the 2026 ZMQ publisher.
- TensorRT-LLM v2_sha256: a 64-hex-digit SHA-256 chain (the form is TensorRT-LLM's,
  docs/wire-formats.md#tensorrt-llm-pull-path-json; the hashed layout, parent digest || u32 LE tokens || namespace, is ours).

Two inputs are not pinned down by the sources and are ours (docs/wire-formats.md#choices-that-are-ours),
said so where they are used: the SGLang LoRA namespace seed and the TRT-LLM cache-salt id (TRT-LLM's own is blake3 or
std::hash depending on the build, neither portable).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvroute.block_keys import chain_block_keys, namespace_seed, pack_token_ids
from kvroute.tools.sim_engine.prefix_cache import BlockHash, BlockRecord, CacheNamespace

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def signed64(value: int) -> int:
    """An unsigned 64-bit value read as two's-complement int64."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


def _u32le(tokens: Sequence[int]) -> bytes:
    packed = pack_token_ids(tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts; copy, the caller's array stays as it is
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()


# ---------------------------------------------------------------- SGLang (docs/wire-formats.md#sglang-block-hashes)

SGLANG_SALT_DOMAIN = b"sglang-cache-salt-v1\0"
SGLANG_NAMESPACE_DOMAIN = b"sglang-kv-event-namespace-v1"


def sglang_content_hash(page_tokens: Sequence[int]) -> int:
    """SGLang 0.4.8-0.5.5: Python's hash of the page's token tuple (content only)."""
    return hash(tuple(page_tokens))


def sglang_page_digest(prior: bytes | None, page_tokens: Sequence[int]) -> bytes:
    """SGLang >= 0.5.6: one link of the chained SHA-256 (no prior for a request's first page)."""
    return hashlib.sha256((prior or b"") + _u32le(page_tokens)).digest()


def sglang_wire_hash(digest: bytes) -> int:
    """The published value of a page digest: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


def sglang_salt_prior(cache_salt: str) -> bytes:
    return hashlib.sha256(SGLANG_SALT_DOMAIN + cache_salt.encode()).digest()


def sglang_namespace_seed(extra_key: str) -> bytes:
    """Seed of the LoRA namespace mapping. The sources only name the domain string
    (docs/wire-formats.md#sglang-block-hashes); joining it to the adapter name with a NUL byte is our reading."""
    return hashlib.sha256(SGLANG_NAMESPACE_DOMAIN + b"\0" + extra_key.encode()).digest()


def sglang_namespaced_hash(seed: bytes, wire_hash: int) -> int:
    """First 8 bytes (signed) of SHA256(seed || hash as 8-byte big-endian signed)."""
    return sglang_wire_hash(hashlib.sha256(seed + wire_hash.to_bytes(8, "big", signed=True)).digest())


# ---------------------------------------------------------------- TensorRT-LLM (docs/wire-formats.md#tensorrt-llm-block-hashes)

_MIX64_A, _MIX64_B, _MIX32 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x45D9F3B
_GOLDEN32 = 0x9E3779B9


def _mix32(x: int) -> int:
    x = (((x >> 16) ^ x) * _MIX32) & _U32
    x = (((x >> 16) ^ x) * _MIX32) & _U32
    return (x >> 16) ^ x


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * _MIX64_A) & _U64
    x = ((x ^ (x >> 27)) * _MIX64_B) & _U64
    return x ^ (x >> 31)


def _combine(seed: int, term: int) -> int:
    """seed ^= term + (seed << 6) + (seed >> 2), in 64 bits; `term` already holds the golden-ratio constant."""
    return seed ^ ((term + (seed << 6) + (seed >> 2)) & _U64)


def trtllm_v1_block_hash(
    tokens: Sequence[int], parent: int = 0, salt_id: int | None = None, lora_task_id: int | None = None
) -> int:
    """TRT-LLM's BlockKeyHasher (v1_block_key) for one block; `parent` 0 = a request's first block."""
    seed = (len(tokens) ^ (parent * _MIX64_A)) & _U64
    if parent == 0 and salt_id is not None:
        seed = _combine(seed, (_mix64(salt_id) + _GOLDEN32) & _U64)
    for token in tokens:
        seed = _combine(seed, (_mix32(token & _U32) + _GOLDEN32) & _U32)  # the token term wraps at 32 bits
    if lora_task_id is not None:
        seed = _combine(seed, (_mix64(lora_task_id & _U64) + _GOLDEN32) & _U64)
    return seed


def trtllm_salt_id(cache_salt: str) -> int:
    """Our stand-in for TRT-LLM's salt id (blake3 or std::hash in TRT-LLM builds: not portable)."""
    return xxhash.xxh3_64_intdigest(cache_salt.encode())


def trtllm_v2_digest(prior: bytes | None, tokens: Sequence[int], namespace: CacheNamespace) -> bytes:
    material = b"" if prior else ("\0".join((namespace.lora_name or "", namespace.cache_salt or ""))).encode()
    return hashlib.sha256((prior or b"") + _u32le(tokens) + material).digest()


# ---------------------------------------------------------------- schemes


class HashScheme(Protocol):
    def chain(
        self, identities: Sequence[int], blocks: list[Sequence[int]], parent: BlockRecord | None, namespace: CacheNamespace
    ) -> list[tuple[BlockHash, object]]:
        """(published hash, chaining state) of each block of a run."""
        ...


@dataclass(frozen=True)
class VllmHashes:
    """vLLM: the cache identity in the era's wire form: "u64", "i64" (builtin hash) or "bytes"."""

    form: str = "u64"

    def chain(self, identities, blocks, parent, namespace):
        if self.form == "u64":
            return [(h & _U64, None) for h in identities]
        if self.form == "i64":
            return [(signed64(h), None) for h in identities]
        return [(h.to_bytes(16, "big"), None) for h in identities]


class SglangContentHashes:
    def chain(self, identities, blocks, parent, namespace):
        return [(sglang_content_hash(block), None) for block in blocks]


@dataclass(frozen=True)
class SglangChainedHashes:
    """SGLang >= 0.5.6; `namespaced` = 0.5.20+ (salt prior and LoRA mapping)."""

    namespaced: bool = False

    def chain(self, identities, blocks, parent, namespace):
        if parent is not None:
            prior = parent.state
        elif self.namespaced and namespace.cache_salt:
            prior = sglang_salt_prior(namespace.cache_salt)
        else:
            prior = None
        seed = sglang_namespace_seed(namespace.lora_name) if self.namespaced and namespace.lora_name else None
        out = []
        for block in blocks:
            prior = sglang_page_digest(prior, block)
            value = sglang_wire_hash(prior)
            out.append((sglang_namespaced_hash(seed, value) if seed else value, prior))
        return out


@dataclass(frozen=True)
class TrtllmV1Hashes:
    """TRT-LLM v1_block_key; `signed` for the ZMQ publisher, which translates hashes to int64."""

    signed: bool = False

    def chain(self, identities, blocks, parent, namespace):
        h = parent.state if parent is not None else 0
        salt_id = trtllm_salt_id(namespace.cache_salt) if namespace.cache_salt else None
        out = []
        for block in blocks:
            h = trtllm_v1_block_hash(block, h, salt_id, namespace.lora_id)
            out.append((signed64(h) if self.signed else h, h))
        return out


class TrtllmV2Hashes:
    def chain(self, identities, blocks, parent, namespace):
        prior = parent.state if parent is not None else None
        out = []
        for block in blocks:
            prior = trtllm_v2_digest(prior, block, namespace)
            out.append((prior.hex(), prior))
        return out


class DialectLabeler:
    """Labels committed blocks with the engine's published hash and kvroute's block key.

    The key chain is kvroute's (`kvroute.block_keys`): seeded by (model, block size, LoRA adapter,
    cache salt) for a request's first block, else continued from the parent block's key, exactly
    what an agent derives from the BlockStored events.
    """

    def __init__(self, model: str, block_size: int, scheme: HashScheme) -> None:
        self.model, self.block_size, self.scheme = model, block_size, scheme

    def label(
        self, identities: Sequence[int], tokens: Sequence[int], parent: BlockRecord | None, namespace: CacheNamespace
    ) -> list[BlockRecord]:
        bs = self.block_size
        blocks = [tokens[i * bs : (i + 1) * bs] for i in range(len(identities))]
        seed = (
            parent.key
            if parent is not None
            else namespace_seed(self.model, bs, namespace.lora_name or "", namespace.cache_salt or "")
        )
        keys = chain_block_keys(tokens, bs, seed)
        previous = parent.published if parent is not None else None
        records = []
        for block, key, (published, state) in zip(blocks, keys, self.scheme.chain(identities, blocks, parent, namespace)):
            records.append(BlockRecord(published, previous, block, namespace, key, state))
            previous = published
        return records
