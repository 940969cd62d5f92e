"""What each simulated engine/version sends on the wire: one `Dialect` per name, pure data.

Every fact here is from docs/wire-formats.md:
- field names and order per version: docs/wire-formats.md#vllm-event-fields,
  docs/wire-formats.md#sglang-events-per-version, docs/wire-formats.md#tensorrt-llm-streaming-publisher;
- array vs map events: docs/wire-formats.md#vllm-array-and-map-eras; batch length:
  docs/wire-formats.md#vllm-event-batch;
- hash form: docs/wire-formats.md#vllm-block-hashes, docs/wire-formats.md#sglang-block-hashes,
  docs/wire-formats.md#tensorrt-llm-block-hashes;
- replay framing: docs/wire-formats.md#replay-reply-framings; bind rule: docs/wire-formats.md#sockets-and-bind-rules;
  publisher default and replay SNDHWM: docs/wire-formats.md#publisher-configuration; data-parallel support:
  docs/wire-formats.md#data-parallel-endpoints;
- CPU medium names: docs/wire-formats.md#vllm-medium-locality-and-kv-groups,
  docs/wire-formats.md#sglang-events-per-version.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.tools.sim_engine.engine_hashes import (
    HashScheme,
    SglangChainedHashes,
    SglangContentHashes,
    TrtllmV1Hashes,
    TrtllmV2Hashes,
    VllmHashes,
)

# vLLM BlockStored / BlockRemoved fields in wire order, with the version that added each (docs/wire-formats.md#vllm-event-fields).
_VLLM_STORED = (
    ("block_hashes", (0, 9, 0)),
    ("parent_block_hash", (0, 9, 0)),
    ("token_ids", (0, 9, 0)),
    ("block_size", (0, 9, 0)),
    ("lora_id", (0, 9, 0)),
    ("medium", (0, 10, 2)),
    ("lora_name", (0, 14)),
    ("extra_keys", (0, 17)),
    ("group_idx", (0, 20)),
    ("kv_cache_spec_kind", (0, 22)),
    ("kv_cache_spec_sliding_window", (0, 22)),
    ("locality", (0, 26)),
    ("ownership", (0, 29)),
    ("session_id", (0, 30)),
    ("lookahead_token_ids", (0, 33)),
)
_VLLM_REMOVED = (
    ("block_hashes", (0, 9, 0)),
    ("medium", (0, 10, 2)),
    ("group_idx", (0, 20)),
    ("locality", (0, 26)),
    ("ownership", (0, 29)),
)
# Fields declared without a default, so a map event always carries them, nil or not (docs/wire-formats.md#msgspec-encoding-rules).
_VLLM_REQUIRED = frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"})

_SGLANG_STORED_0_4_8 = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


@dataclass(frozen=True)
class Dialect:
    name: str
    engine: str  # "vllm" | "sglang" | "trtllm": API, metrics and config flavour
    transport: str  # "zmq" | "pull" (TRT-LLM's POST /kv_cache_events)
    events: str  # "array" | "map" | "json"
    stored_fields: tuple[str, ...] = ()
    removed_fields: tuple[str, ...] = ()
    required_fields: frozenset[str] = frozenset()  # map events: written even when nil
    omit_defaults: bool = True  # map events: leave out fields that are at their default (None)
    batch_has_rank: bool = True  # [ts, events, rank] (else vLLM 0.9.0's [ts, events])
    hash_kind: str = "vllm-digest"  # vllm-builtin | vllm-digest | sglang-content | sglang-sha256 | trtllm-v1
    hash_forms: tuple[str, ...] = ("int",)  # the first is the default
    lora_on_wire: str | None = "lora_id"  # how events name a request's adapter: lora_name, lora_id or not
    replay_framing: str | None = None  # "old" | "new"
    cpu_medium: str | None = None  # the CPU tier's medium name; None = the tier cannot be represented
    honours_cache_salt: bool = True
    publisher_default: str = "zmq"  # kv-events-config "publisher" when the JSON leaves it out
    needs_enable_flag: bool = True  # vLLM/TRT-LLM need enable_kv_cache_events; SGLang enables by the flag itself
    binds_any_address: bool = False  # SGLang >= 0.5.13 binds tcp://0.0.0.0:... too
    always_binds: bool = False  # TRT-LLM's publisher
    explicit_bind_key: bool = False  # SGLang >= 0.5.22: "bind": true|false
    replay_sndhwm_scaled: bool = False  # vLLM 0.33 sets the ROUTER's SNDHWM to 2*(buffer_steps+1)
    data_parallel: bool = True
    coalesce_stores: bool = False  # SGLang merges consecutive stores of one chain
    has_locality: bool = False
    default_block_size: int = 16

    @property
    def version(self) -> str | None:
        """The engine version the dialect stands for (TensorRT-LLM's are transports, not versions)."""
        return None if self.engine == "trtllm" else self.name.split("-", 1)[1]

    def hash_scheme(self, form: str | None = None) -> HashScheme:
        """The engine's published block hash for `form` ("int", "bytes" or "hex"; None = the default)."""
        form = form or self.hash_forms[0]
        if form not in self.hash_forms:
            raise ValueError(f"dialect {self.name} has no {form!r} block hashes (it sends: {', '.join(self.hash_forms)})")
        if self.hash_kind == "vllm-builtin":
            return VllmHashes("i64")
        if self.hash_kind == "vllm-digest":
            return VllmHashes("bytes" if form == "bytes" else "u64")
        if self.hash_kind == "sglang-content":
            return SglangContentHashes()
        if self.hash_kind == "sglang-sha256":
            return SglangChainedHashes(namespaced=self.events == "map")  # salt/LoRA namespacing from 0.5.20
        if form == "hex":
            return TrtllmV2Hashes()
        return TrtllmV1Hashes(signed=self.transport == "zmq")


def _vllm(version: tuple[int, ...]) -> Dialect:
    name = "vllm-" + ".".join(map(str, version))
    since = version >= (0, 10, 2)
    return Dialect(
        name=name,
        engine="vllm",
        transport="zmq",
        events="map" if version >= (0, 24) else "array",  # docs/wire-formats.md#vllm-array-and-map-eras
        stored_fields=tuple(f for f, v in _VLLM_STORED if version >= v),
        removed_fields=tuple(f for f, v in _VLLM_REMOVED if version >= v),
        required_fields=_VLLM_REQUIRED,
        batch_has_rank=version >= (0, 9, 1),
        # Builtin hash (signed) until 0.10.1; then the digest's last 8 bytes, or the bytes themselves
        # (docs/wire-formats.md#vllm-block-hashes).
        hash_kind="vllm-digest" if since else "vllm-builtin",
        hash_forms=("int", "bytes") if since else ("int",),
        lora_on_wire="lora_name" if version >= (0, 14) else "lora_id",
        replay_framing="new" if version >= (0, 26) else "old",
        cpu_medium="CPU" if since else None,
        publisher_default="zmq" if version >= (0, 12) else "null",
        replay_sndhwm_scaled=version >= (0, 33),
        data_parallel=version >= (0, 9, 1),
        has_locality=version >= (0, 26),
    )


VLLM_VERSIONS = ((0, 9, 0), (0, 9, 1), (0, 10, 2), (0, 14), (0, 17), (0, 20), (0, 22), (0, 24), (0, 26), (0, 33))

_SGLANG = (
    Dialect(
        name="sglang-0.4.8",
        engine="sglang",
        transport="zmq",
        events="array",
        stored_fields=_SGLANG_STORED_0_4_8,
        removed_fields=("block_hashes",),
        hash_kind="sglang-content",
        lora_on_wire=None,
        replay_framing="old",
        honours_cache_salt=False,
        publisher_default="null",
        needs_enable_flag=False,
        coalesce_stores=True,
    ),
    # 0.5.9 adds medium but only ever sends "GPU" (docs/wire-formats.md#sglang-events-per-version): no CPU tier.
    Dialect(
        name="sglang-0.5.9",
        engine="sglang",
        transport="zmq",
        events="array",
        stored_fields=_SGLANG_STORED_0_4_8 + ("medium",),
        removed_fields=("block_hashes", "medium"),
        hash_kind="sglang-sha256",
        lora_on_wire=None,
        replay_framing="old",
        honours_cache_salt=False,
        publisher_default="null",
        needs_enable_flag=False,
        coalesce_stores=True,
    ),
    # Maps from 0.5.20; its structs have no omit_defaults, so every key is written
    # (docs/wire-formats.md#sglang-events-per-version).
    Dialect(
        name="sglang-0.5.20",
        engine="sglang",
        transport="zmq",
        events="map",
        stored_fields=_SGLANG_STORED_0_4_8 + ("medium", "cache_salt", "session_id"),
        removed_fields=("block_hashes", "medium"),
        omit_defaults=False,
        hash_kind="sglang-sha256",
        lora_on_wire=None,
        replay_framing="old",
        cpu_medium="CPU_PINNED",
        publisher_default="null",
        needs_enable_flag=False,
        binds_any_address=True,
        coalesce_stores=True,
    ),
    Dialect(
        name="sglang-0.5.22",
        engine="sglang",
        transport="zmq",
        events="map",
        stored_fields=_SGLANG_STORED_0_4_8 + ("medium", "cache_salt", "session_id", "lora_name"),
        removed_fields=("block_hashes", "medium"),
        omit_defaults=False,
        hash_kind="sglang-sha256",
        lora_on_wire="lora_name",
        replay_framing="new",
        cpu_medium="CPU_PINNED",
        publisher_default="null",
        needs_enable_flag=False,
        binds_any_address=True,
        explicit_bind_key=True,
        coalesce_stores=True,
    ),
)

_TRTLLM = (
    # POST /kv_cache_events JSON (docs/wire-formats.md#tensorrt-llm-pull-path-json); the CPU tier is the secondary cache
    # level ("updated" events).
    Dialect(
        name="trtllm-pull",
        engine="trtllm",
        transport="pull",
        events="json",
        hash_kind="trtllm-v1",
        hash_forms=("int", "hex"),
        cpu_medium="secondary",
        default_block_size=32,
    ),
    # The 2026 streaming publisher (docs/wire-formats.md#tensorrt-llm-streaming-publisher): vLLM >= 0.24-style maps plus
    # mm_keys; medium is always "GPU".
    Dialect(
        name="trtllm-zmq",
        engine="trtllm",
        transport="zmq",
        events="map",
        stored_fields=(
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "mm_keys",
        ),
        removed_fields=("block_hashes", "medium", "group_idx", "locality"),
        required_fields=_VLLM_REQUIRED,
        hash_kind="trtllm-v1",
        replay_framing="new",
        always_binds=True,
        has_locality=True,
        default_block_size=32,
    ),
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (*map(_vllm, VLLM_VERSIONS), *_SGLANG, *_TRTLLM)}
DEFAULT_DIALECT = "vllm-0.26"  # map events and the 4-frame replay framing: what the sim engine always sent


def get_dialect(name: str) -> Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"unknown dialect {name!r}; choose one of: {', '.join(DIALECTS)}") from None
