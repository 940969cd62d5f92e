"""The sim engine over HTTP per dialect: the audit endpoint, LoRA adapters and cache_salt, the CPU tier,
fault hooks, resets, each engine's own metrics and TensorRT-LLM's pull path. Events are read back over
real replay sockets (or POST /kv_cache_events) with a generic decode."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.block_keys import prompt_block_keys
from kvroute.tools.sim_engine.cli import build_publisher
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.dialects import DIALECTS
from kvroute.tools.sim_engine.engine import EngineConfig, SimEngine
from kvroute.tools.sim_engine.kv_publisher import END_SEQ, KvEventPublisher
from kvroute.tools.sim_engine.server import start_server
from kvroute.tools.sim_engine.tokenizer import load_engine_tokenizer

MODEL = "tiny-llama"
ZMQ_EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_engine_tokenizer(tiny_model_dir)


class Engine:
    """A sim engine served in-process, with helpers to call it."""

    def __init__(self, engine: SimEngine, url: str, http: aiohttp.ClientSession) -> None:
        self.engine, self.url, self.http = engine, url, http

    async def complete(self, prompt: list[int], **body) -> tuple[int, dict]:
        async with self.http.post(
            self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **body}
        ) as r:
            return r.status, await r.json()

    async def get_json(self, path: str):
        async with self.http.get(self.url + path) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def post(self, path: str, body: dict | None = None) -> tuple[int, object]:
        async with self.http.post(self.url + path, json=body) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    async def audit(self) -> dict:
        return await self.get_json("/kvroute/blocks")

    async def batches(self) -> list[tuple[int, list]]:
        """(seq, events) of every batch still in the replay buffer, decoded generically, in order."""
        pub = self.engine.publisher
        await pub.flush()
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_last_endpoint)
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            out = []
            while True:
                *_, seq8, payload = await asyncio.wait_for(dealer.recv_multipart(), 2)
                if seq8 == END_SEQ:
                    return out
                out.append((int.from_bytes(seq8, "big"), msgspec.msgpack.decode(payload)[1]))
        finally:
            ctx.destroy(linger=0)

    async def events(self) -> list:
        return [e for _, events in await self.batches() for e in events]


@pytest.fixture
async def start(tokenizer):
    engines = []
    http = aiohttp.ClientSession()

    async def _start(kv_events: str | None = ZMQ_EVENTS, event_buffer_max_size: int = 10000, **config) -> Engine:
        config = EngineConfig(**{"num_blocks": 256, "max_model_len": 1024, "speedup": 50, **config})
        args = SimpleNamespace(kv_events_config=kv_events, data_parallel_rank=0, event_buffer_max_size=event_buffer_max_size)
        engine = SimEngine(config, tokenizer, CostModel(), build_publisher(args, config))
        runner, port = await start_server(engine, "127.0.0.1", 0)
        engines.append((runner, engine))
        return Engine(engine, f"http://127.0.0.1:{port}", http)

    try:
        yield _start
    finally:
        await http.close()
        for runner, engine in engines:
            await runner.cleanup()
            await engine.stop()


def prompt(seed: int, blocks: int = 3, block_size: int = 16) -> list[int]:
    return [100 + (seed * 37 + i) % 1900 for i in range(blocks * block_size)]


def stored_of(events: list) -> list:
    return [e for e in events if (e["type"] if isinstance(e, dict) else e[0]) == "BlockStored"]


# ---------------------------------------------------------------- audit


@pytest.mark.parametrize("dialect,block_size", [("vllm-0.26", 16), ("sglang-0.5.9", 32), ("trtllm-zmq", 64)])
async def test_audit_is_the_cached_prompt_blocks_minus_lru_evictions(start, dialect: str, block_size: int) -> None:
    eng = await start(num_blocks=8, block_size=block_size, dialect=dialect)
    a, b, c = (prompt(i, 3, block_size) for i in range(3))
    for p in (a, b, c):  # 3 full blocks + 1 output token: 4 blocks each; C needs two of A's blocks
        assert (await eng.complete(p))[0] == 200
    keys = {name: prompt_block_keys(p, block_size, MODEL) for name, p in (("a", a), ("b", b), ("c", c))}
    audit = await eng.audit()
    # A is released tail first, so its last two blocks are the least recently used (vLLM's free order).
    assert audit["tiers"] == {"gpu": sorted(keys["a"][:1] + keys["b"] + keys["c"]), "cpu": []}
    assert audit["counts"] == {"gpu": 7, "cpu": 0} and audit["block_size"] == block_size and audit["model"] == MODEL
    assert audit["used_blocks"] == 0 and audit["num_blocks"] == 8


async def test_audit_with_a_cpu_tier_and_the_events_that_moved_blocks(start) -> None:
    eng = await start(num_blocks=8, dialect="vllm-0.26", cpu_offload_blocks=8)
    a, b, c = (prompt(i) for i in range(3))
    for p in (a, b, c):
        await eng.complete(p)
    ka = prompt_block_keys(a, 16, MODEL)
    audit = await eng.audit()
    assert audit["tiers"]["cpu"] == sorted(ka[1:]) and audit["counts"] == {"gpu": 7, "cpu": 2}
    events = await eng.events()
    moved = [e for e in events if e.get("medium") == "CPU"]
    assert [(e["type"], e.get("locality")) for e in moved] == [("BlockStored", "LOCAL")] * 2
    removed_gpu = [e for e in events if e["type"] == "BlockRemoved"]
    assert {h for e in removed_gpu for h in e["block_hashes"]} == {h for e in moved for h in e["block_hashes"]}
    # A again: its prefix continues on the CPU tier and is loaded back (a hit, charged at the load rate).
    status, body = await eng.complete(a + [7])
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    audit = await eng.audit()
    assert set(ka) <= set(audit["tiers"]["gpu"]) and not set(ka) & set(audit["tiers"]["cpu"])
    async with eng.http.get(eng.url + "/metrics") as r:
        text = await r.text()
    label = '{model_name="tiny-llama"}'
    assert f"vllm:external_prefix_cache_hits_total{label} 32.0" in text  # blocks 2 and 3
    assert f"vllm:prefix_cache_hits_total{label} 16.0" in text and f"vllm:prefix_cache_queries_total{label} 193.0" in text
    assert f"vllm:external_prefix_cache_queries_total{label} {193 - 16}.0" in text


@pytest.mark.parametrize("dialect", [name for name, d in DIALECTS.items() if d.transport == "zmq"])
async def test_every_dialect_publishes_every_step_and_audits_its_namespaces(start, dialect: str) -> None:
    d = DIALECTS[dialect]
    eng = await start(dialect=dialect, num_blocks=8, lora_adapters=("sql",), cpu_offload_blocks=8 if d.cpu_medium else 0)
    keys = []
    for i, (model, salt) in enumerate([(MODEL, None), ("sql", None), (MODEL, "x"), ("sql", "y"), (MODEL, None)]):
        p = prompt(70 + i, 2)  # 2 full blocks + 1 output token: 3 blocks reserved, 2 cached
        assert (await eng.complete(p, model=model, **({"cache_salt": salt} if salt else {})))[0] == 200
        keys.append(
            prompt_block_keys(p, 16, MODEL, "" if model == MODEL else model, salt if d.honours_cache_salt and salt else "")
        )
    batches = await eng.batches()
    assert [seq for seq, _ in batches] == list(range(len(batches)))  # no batch failed to encode
    # The 4th and 5th requests evict 3 blocks, least recently used first: request 1's tail and head, request 2's tail.
    evicted = [keys[0][1], keys[0][0], keys[1][1]]
    audit = await eng.audit()
    assert audit["tiers"]["gpu"] == sorted([keys[1][0]] + keys[2] + keys[3] + keys[4])
    assert audit["tiers"]["cpu"] == (sorted(evicted) if d.cpu_medium else [])


# ---------------------------------------------------------------- LoRA adapters and cache_salt


async def test_adapters_are_listed_and_served_in_their_own_namespace(start) -> None:
    eng = await start(lora_adapters=("sql", "chat"))
    models = (await eng.get_json("/v1/models"))["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", MODEL), ("chat", MODEL)]
    p = prompt(1)
    status, body = await eng.complete(p, model="sql")
    assert status == 200 and body["model"] == "sql" and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await eng.complete(p))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # base: a miss
    assert (await eng.complete(p, model="sql"))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    status, body = await eng.complete(p, model="nope")
    assert status == 404 and body["error"]["message"] == "The model `nope` does not exist."
    audit = await eng.audit()
    assert audit["tiers"]["gpu"] == sorted(prompt_block_keys(p, 16, MODEL) + prompt_block_keys(p, 16, MODEL, "sql"))
    sql_stored = stored_of(await eng.events())[0]
    assert sql_stored["lora_name"] == "sql" and sql_stored["lora_id"] == 1 and sql_stored["extra_keys"] == [["sql"]] * 3


@pytest.mark.parametrize("dialect", ["vllm-0.10.2", "vllm-0.14", "sglang-0.5.9", "sglang-0.5.22", "trtllm-zmq"])
async def test_the_adapter_on_the_wire_per_dialect(start, dialect: str) -> None:
    eng = await start(dialect=dialect, lora_adapters=("a", "b"))
    await eng.complete(prompt(2), model="b")
    (event,) = stored_of(await eng.events())
    if dialect == "vllm-0.10.2":
        assert len(event) == 7 and event[5] == 2  # only the adapter's int id
    elif dialect == "vllm-0.14":
        assert len(event) == 8 and event[5:] == [2, "GPU", "b"]
    elif dialect == "sglang-0.5.9":
        assert event[5] is None  # SGLang arrays never name the adapter
    elif dialect == "sglang-0.5.22":
        assert event["lora_name"] == "b" and event["lora_id"] is None
    else:
        assert event["lora_id"] == 2 and event["lora_name"] is None
    assert (await eng.audit())["tiers"]["gpu"] == sorted(prompt_block_keys(prompt(2), 16, MODEL, "b"))


async def test_cache_salt_namespaces_blocks_and_is_on_the_wire(start) -> None:
    eng = await start(dialect="vllm-0.17")
    p = prompt(3)
    assert (await eng.complete(p))[0] == 200
    assert (await eng.complete(p, cache_salt="x"))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await eng.complete(p, cache_salt="x"))[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    for bad in ("", 5):
        status, body = await eng.complete(p, cache_salt=bad)
        assert status == 400 and body["error"]["param"] == "cache_salt"
    plain, salted = stored_of(await eng.events())
    assert plain[8] is None and salted[8] == [["x"], None, None]  # the salt rides on the first block only
    assert (await eng.audit())["tiers"]["gpu"] == sorted(
        prompt_block_keys(p, 16, MODEL) + prompt_block_keys(p, 16, MODEL, "", "x")
    )


@pytest.mark.parametrize("dialect,honoured", [("sglang-0.5.9", False), ("sglang-0.5.20", True)])
async def test_sglang_honours_cache_salt_from_0_5_20(start, dialect: str, honoured: bool) -> None:
    eng = await start(dialect=dialect)
    p = prompt(4)
    await eng.complete(p)
    hit = (await eng.complete(p, cache_salt="x"))[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit == (0 if honoured else 32)
    if honoured:
        assert stored_of(await eng.events())[1]["cache_salt"] == "x"
        assert len((await eng.audit())["tiers"]["gpu"]) == 6


# ---------------------------------------------------------------- faults and resets


@pytest.mark.parametrize("dialect", ["vllm-0.26", "vllm-0.10.2"])
async def test_reset_prefix_cache_emits_all_blocks_cleared(start, dialect: str) -> None:
    eng = await start(dialect=dialect)
    await eng.complete(prompt(9), max_tokens=2)
    assert (await eng.post("/reset_prefix_cache"))[0] == 200
    assert (await eng.audit())["tiers"] == {"gpu": [], "cpu": []}
    batches = await eng.batches()
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    stored = stored_of([e for _, events in batches for e in events])
    assert stored and (stored[0]["parent_block_hash"] if isinstance(stored[0], dict) else stored[0][2]) is None
    assert batches[-1][1] == ([{"type": "AllBlocksCleared"}] if dialect == "vllm-0.26" else [["AllBlocksCleared"]])


async def test_fault_hooks_over_http(start) -> None:
    eng = await start()
    pub: KvEventPublisher = eng.engine.publisher
    status, state = await eng.post("/kvroute/faults", {"drop_next_batches": 1})
    assert status == 200 and state == {"next_seq": 0, "drop_next_batches": 1, "dropped_by_fault": 0, "restarts": 0}
    await eng.complete(prompt(5))
    await pub.flush()
    assert pub.faults.dropped_by_fault == 1 and [seq for seq, _ in pub.buffer] == [0]  # withheld, still replayable
    for bad in ({"drop_next_batches": -1}, {"drop_next_batches": True}, {"restart_publisher": "yes"}, {"other": 1}):
        assert (await eng.post("/kvroute/faults", bad))[0] == 400
    status, state = await eng.post("/kvroute/faults", {"restart_publisher": True})
    assert status == 200 and state["next_seq"] == 0 and state["restarts"] == 1 and not pub.buffer
    assert (await eng.audit())["counts"]["gpu"] == 3  # the cache itself survives a publisher restart
    status, _ = await eng.post("/kvroute/faults", {"drop_cache": True})
    assert status == 200 and (await eng.audit())["counts"]["gpu"] == 0
    await pub.flush()
    assert not pub.buffer  # dropping the cache sent nothing


async def test_faults_without_kv_events_are_a_conflict(start) -> None:
    eng = await start(kv_events=None)
    assert (await eng.post("/kvroute/faults", {"drop_next_batches": 1}))[0] == 409
    assert (await eng.post("/kvroute/faults", {"drop_cache": True})) == (200, {})


async def test_sglang_flush_cache_is_its_reset(start) -> None:
    eng = await start(dialect="sglang-0.5.22")
    await eng.complete(prompt(6))
    async with eng.http.get(eng.url + "/flush_cache") as r:
        assert r.status == 200
    assert (await eng.audit())["counts"]["gpu"] == 0
    assert (await eng.events())[-1] == {"type": "AllBlocksCleared"}


# ---------------------------------------------------------------- metrics in each engine's names


async def test_sglang_metrics_names(start) -> None:
    eng = await start(dialect="sglang-0.5.20")
    p = prompt(7)
    await eng.complete(p)
    await eng.complete(p)
    async with eng.http.get(eng.url + "/metrics") as r:
        text = await r.text()
    label = '{model_name="tiny-llama"}'
    assert f"sglang:num_running_reqs{label} 0.0" in text and f"sglang:num_queue_reqs{label} 0.0" in text
    assert f"sglang:token_usage{label} 0.0" in text
    assert f"sglang:cached_tokens_total{label} 32.0" in text and f"sglang:prompt_tokens_total{label} 96.0" in text
    assert f"sglang:cache_hit_rate{label} {32 / 96}" in text and f"sglang:num_requests_total{label} 2.0" in text
    assert "vllm:" not in text


async def test_vllm_metrics_keep_the_names_the_demo_reads(start) -> None:
    eng = await start(dialect="vllm-0.9.0")
    await eng.complete(prompt(8))
    async with eng.http.get(eng.url + "/metrics") as r:
        text = await r.text()
    assert 'vllm:prefix_cache_queries_total{model_name="tiny-llama"} 48.0' in text
    assert "vllm:prefix_cache_hits_total" in text and "external_prefix_cache" not in text and "sglang:" not in text
    version = await eng.get_json("/version")
    assert version["version"] == "0.9.0" and version["engine"] == "vllm"


# ---------------------------------------------------------------- TensorRT-LLM pull path


async def drain(eng: Engine) -> list[dict]:
    status, events = await eng.post("/kv_cache_events")
    assert status == 200
    return events


async def test_trtllm_pull_events(start) -> None:
    eng = await start(
        kv_events=None,
        dialect="trtllm-pull",
        block_size=16,
        num_blocks=8,
        cpu_offload_blocks=4,
        lora_adapters=("sql",),
        max_model_len=512,
    )
    (created,) = await drain(eng)
    assert created == {"event_id": 0, "window_size": 512, "data": {"type": "created", "num_blocks_per_cache_level": [8, 4]}}
    ones = list(range(1, 17))
    await eng.complete(ones + ones, max_tokens=1)
    (stored,) = await drain(eng)
    assert stored["event_id"] == 1 and stored["window_size"] == 512 and set(stored) == {"event_id", "data", "window_size"}
    data = stored["data"]
    assert data["type"] == "stored" and data["parent_hash"] is None and len(data["blocks"]) == 2
    first, second = data["blocks"]
    assert first["block_hash"] == 6052439777046529588  # the v1_block_key vector of docs/wire-formats.md#tensorrt-llm-block-hashes
    assert first["tokens"][:2] == [
        {"type": "unique_token", "token_id": 1, "token_extra_id": 0},
        {"type": "unique_token", "token_id": 2, "token_extra_id": 0},
    ]
    assert len(second["tokens"]) == 16 and first["cache_level"] == 0 and first["priority"] == 35
    assert "lora_id" not in first and "cache_salt" not in first
    assert await drain(eng) == []  # draining is destructive

    for i in range(4):  # four more 2-block prompts: the first prompt's blocks go to the secondary level
        await eng.complete(prompt(20 + i, 2), max_tokens=1)
    events = await drain(eng)
    updates = [e["data"] for e in events if e["data"]["type"] == "updated"]
    assert {u["block_hash"] for u in updates} >= {first["block_hash"], second["block_hash"]}
    assert all(
        u["cache_level"] == {"type": "event_diff", "old_value": 0, "new_value": 1} and u["priority"] is None for u in updates
    )
    assert not [e for e in events if e["data"]["type"] == "removed"]  # offloaded, not gone
    assert [e["event_id"] for e in events] == list(range(2, 2 + len(events)))

    await eng.complete(ones + ones + [5], max_tokens=1)  # the prefix is on the secondary level: onboarded back
    onboard = [e["data"] for e in await drain(eng) if e["data"]["type"] == "updated"]
    assert onboard[:2] == [
        {
            "type": "updated",
            "block_hash": h,
            "priority": None,
            "cache_level": {"type": "event_diff", "old_value": 1, "new_value": 0},
        }
        for h in (first["block_hash"], second["block_hash"])
    ]

    await eng.complete(prompt(30, 1), model="sql", cache_salt="t", max_tokens=1)
    (lora,) = [e["data"] for e in await drain(eng) if e["data"]["type"] == "stored"]
    assert lora["blocks"][0]["lora_id"] == 1 and lora["blocks"][0]["cache_salt"] == "t"

    audit = await eng.audit()
    assert (await eng.post("/reset_prefix_cache"))[0] == 200
    (cleared,) = await drain(eng)
    assert cleared["data"]["type"] == "removed"
    assert len(cleared["data"]["block_hashes"]) == audit["counts"]["gpu"] + audit["counts"]["cpu"]


async def test_trtllm_pull_hex_hashes_buffer_limit_and_faults(start) -> None:
    eng = await start(kv_events=None, dialect="trtllm-pull", event_hash_form="hex", event_buffer_max_size=3)
    for i in range(4):
        await eng.complete(prompt(40 + i, 1), max_tokens=1)
    events = await drain(eng)
    assert [e["event_id"] for e in events] == [2, 3, 4]  # created and the first store fell out of the buffer
    assert all(e["hash_algo"] == "v2_sha256" for e in events)
    block_hash = events[0]["data"]["blocks"][0]["block_hash"]
    assert isinstance(block_hash, str) and len(block_hash) == 64 and int(block_hash, 16) >= 0
    assert (await eng.post("/kvroute/faults", {"drop_next_batches": 1}))[0] == 200
    await eng.complete(prompt(50, 1), max_tokens=1)
    await eng.complete(prompt(51, 1), max_tokens=1)
    assert [e["event_id"] for e in await drain(eng)] == [6]  # event 5 was lost with its step
    status, state = await eng.post("/kvroute/faults", {"restart_publisher": True})
    assert status == 200 and state["restarts"] == 1
    (created,) = await drain(eng)
    assert created["event_id"] == 0 and created["data"]["type"] == "created"


async def test_trtllm_metrics_are_drained_iteration_stats(start) -> None:
    eng = await start(kv_events=None, dialect="trtllm-pull", block_size=16)
    p = prompt(60)
    await eng.complete(p, max_tokens=2)
    await eng.complete(p, max_tokens=1)
    async with eng.http.get(eng.url + "/metrics") as r:
        assert r.content_type == "application/json"
        stats = await r.json()
    assert [s["iter"] for s in stats] == list(range(len(stats))) and len(stats) >= 3
    last = stats[-1]
    assert last["numActiveRequests"] == 0 and last["numQueuedRequests"] == 0 and last["numCompletedRequests"] == 1
    kv = last["kvCacheStats"]
    assert kv["maxNumBlocks"] == 256 and kv["tokensPerBlock"] == 16 and kv["usedNumBlocks"] == 0
    assert kv["freeNumBlocks"] == 256 and kv["reusedBlocks"] == 2 and kv["missedBlocks"] == 4
    assert kv["cacheHitRate"] == pytest.approx(2 / 6) and kv["allocNewBlocks"] == 4 + 2
    assert stats[0]["inflightBatchingStats"]["numCtxTokens"] == 48 and stats[0]["numActiveRequests"] == 1
    async with eng.http.get(eng.url + "/metrics") as r:
        assert await r.json() == []
    assert (await eng.get_json("/version"))["version"] is None  # TRT-LLM dialects are transports, not versions
