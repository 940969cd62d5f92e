"""Golden KV-event fixtures (tests/worker_agent/fixtures/wire): committed bytes of every version row of the wire
spec for vLLM and SGLang, TensorRT-LLM's streaming bytes and its pull-path JSON, each decoded to the
events written by hand next to it, then resolved to the block keys a router computes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from kvroute.block_keys import prompt_block_keys
from kvroute.worker_agent import sglang_wire, vllm_wire
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.worker_agent.trtllm_events import RankEvents, RankReset, TrtllmEventConverter

FIXTURES = Path(__file__).parent / "fixtures" / "wire"
MODEL = "fixture-model"
DECODERS = {"vllm": vllm_wire.decode_payload, "sglang": sglang_wire.decode_payload}
EVENT_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
BIN = sorted(FIXTURES.glob("*.bin"))
JSON = sorted(p for p in FIXTURES.glob("*.json") if not p.name.endswith(".expected.json"))


def expected_of(path: Path) -> dict:
    return json.loads(path.with_suffix(".expected.json").read_text())


def event(spec: dict):
    fields = dict(spec)
    return EVENT_TYPES[fields.pop("event")](**fields)


def check_routes(resolver: BlockResolver, routes: list[dict]) -> None:
    for r in routes:
        keys = prompt_block_keys(r["tokens"], r["block_size"], MODEL, r["lora_name"], r["cache_salt"])
        held = set(resolver.held_keys(r["medium"]))
        assert [i for i, k in enumerate(keys) if k in held] == r["held"], r


def generator():
    spec = importlib.util.spec_from_file_location("wire_fixture_generator", FIXTURES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", BIN, ids=lambda p: p.stem)
def test_msgpack_fixture_decodes_to_the_expected_events(path: Path) -> None:
    expected = expected_of(path)
    batch = DECODERS[expected["dialect"]](7, path.read_bytes())
    assert batch.seq == 7 and batch.dp_rank == expected["dp_rank"]
    assert batch.events == [event(e) for e in expected["events"]]
    assert batch.unknown_events == expected["unknown_events"] and len(batch.bad_events) == expected["bad_events"]
    assert batch.unknown_fields == expected["unknown_fields"]
    resolver = BlockResolver(MODEL)
    resolver.apply(batch.events)
    check_routes(resolver, expected["routes"])


@pytest.mark.parametrize("path", JSON, ids=lambda p: p.stem)
def test_trtllm_json_fixture_converts_to_the_expected_actions(path: Path) -> None:
    expected = expected_of(path)
    converter = TrtllmEventConverter(expected["ranks"])
    actions = converter.feed(path.read_bytes())
    want = []
    for a in expected["actions"]:
        if a["action"] == "reset":
            want.append(("reset", a["rank"]))
        else:
            want.append(("events", a["rank"], a["first_id"], a["last_id"], [event(e) for e in a["events"]]))
    got = [("reset", a.rank) if type(a) is RankReset else ("events", a.rank, a.first_id, a.last_id, a.events) for a in actions]
    assert got == want
    counters = converter.counters.as_dict()
    assert {k: counters[k] for k in expected["counters"]} == expected["counters"]
    if "routes" in expected:
        resolver = BlockResolver(MODEL, expected["block_size"])
        for a in actions:
            if type(a) is RankEvents:
                resolver.apply(a.events)
        check_routes(resolver, expected["routes"])


def test_a_fixture_per_spec_version_row() -> None:
    names = {p.stem for p in BIN} | {p.stem for p in JSON}
    vllm_rows = ["0.9.0", "0.9.1", "0.10.2", "0.14", "0.17", "0.20", "0.22", "0.24", "0.26", "0.29", "0.30", "0.33"]
    # SGLang: one per row of docs/wire-formats.md#sglang-events-per-version, + EAGLE
    sglang_rows = ["0.4.7", "0.5.5", "0.5.13", "0.5.20", "0.5.22", "0.5.23-eagle-bigram"]
    assert {f"vllm-{v}" for v in vllm_rows} <= names and {f"sglang-{v}" for v in sglang_rows} <= names
    assert {"trtllm-stream-1.4", "trtllm-json-classic", "trtllm-json-v2-dp"} <= names


# Array-era element counts including the tag (docs/wire-formats.md#vllm-array-and-map-eras,
# docs/wire-formats.md#sglang-events-per-version): the replicas must match them.
ARRAY_LENGTHS = {
    "vllm-0.9.0": (6, 2),
    "vllm-0.9.1": (6, 2),
    "vllm-0.10.2": (7, 3),
    "vllm-0.10.2-bytes-hashes": (7, 3),
    "vllm-0.14": (8, None),
    "vllm-0.17": (9, None),
    "vllm-0.20": (10, 4),
    "vllm-0.22": (12, 4),
    "sglang-0.4.7": (6, 2),
    "sglang-0.5.5": (6, 2),
    "sglang-0.5.13": (7, 3),
}


@pytest.mark.parametrize("name", sorted(ARRAY_LENGTHS))
def test_array_era_fixtures_have_the_spec_lengths(name: str) -> None:
    batch = msgspec.msgpack.decode((FIXTURES / f"{name}.bin").read_bytes())
    assert len(batch) == (2 if name == "vllm-0.9.0" else 3)
    lengths = {e[0]: len(e) for e in batch[1] if e[0] != "AllBlocksCleared"}
    stored, removed = ARRAY_LENGTHS[name]
    assert lengths["BlockStored"] == stored and lengths.get("BlockRemoved") == removed


def test_map_era_fixtures_are_maps() -> None:
    for name in ("vllm-0.24", "vllm-0.33", "sglang-0.5.20", "sglang-0.5.22", "trtllm-stream-1.4"):
        events = msgspec.msgpack.decode((FIXTURES / f"{name}.bin").read_bytes())[1]
        assert all(isinstance(e, dict) and "type" in e for e in events), name


def test_generator_reproduces_the_committed_fixtures() -> None:
    gen = generator()
    fixtures = gen.all_fixtures()
    committed = {p.name for p in FIXTURES.iterdir() if p.name != "generate.py" and p.suffix in (".bin", ".json")}
    produced = set()
    for name, (suffix, payload, expected) in fixtures.items():
        produced |= {f"{name}{suffix}", f"{name}.expected.json"}
        assert (FIXTURES / f"{name}{suffix}").read_bytes() == payload, name
        assert (FIXTURES / f"{name}.expected.json").read_bytes() == gen.expected_bytes(expected), name
    assert committed == produced  # no stale fixture without a generator entry


def test_replicas_reproduce_the_spec_example_bytes() -> None:
    """The byte examples of docs/wire-formats.md#vllm-example-bytes, rebuilt from the replicas: checks the
    replicas, not the decoder."""
    gen = generator()
    s090 = gen.vllm_schema("0.9.0")
    assert s090.payload([s090.stored([-2, 3], None, [1, 2, 3, 4], 2, None)], rank=None) == bytes.fromhex(
        "92 cb3ff8000000000000 91 96 ab"
    ) + b"BlockStored" + bytes.fromhex("92 fe 03 c0 94 01 02 03 04 02 c0")
    s1002 = gen.vllm_schema("0.10.2")
    assert s1002.payload([s1002.stored([2**64 - 1, 5], None, [1, 2, 3, 4], 4, None, "GPU")]).startswith(
        bytes.fromhex("93 cb3ff8000000000000 91 97 ab")
        + b"BlockStored"
        + bytes.fromhex("92 cf ffffffffffffffff 05 c0 94 01020304 04 c0 a3")
        + b"GPU"
    )
    s033 = gen.vllm_schema("0.33.0")
    payload = s033.payload(
        [s033.stored([8866452693264111234], None, [1, 2], 2, None, "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention")]
    )
    assert len(payload) == 175 and payload.startswith(bytes.fromhex("93cb3ff800000000000091de000aa4") + b"type")
