"""The sim engine's prefill/decode legs over HTTP, in-process: what a vLLM prefill leg returns, what
a decode leg requires and reports, SGLang's bootstrap fields, and a decode leg computing no prompt."""

from __future__ import annotations

import aiohttp
import pytest

from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.engine import EngineConfig, SimEngine
from kvroute.tools.sim_engine.server import start_server
from kvroute.tools.sim_engine.tokenizer import load_engine_tokenizer

PROMPT = " ".join(["prefill and decode run on different workers of the fleet"] * 8)


@pytest.fixture
async def start(tiny_model_dir):
    started = []

    async def start_engine(role: str, protocol: str) -> str:
        engine = SimEngine(
            EngineConfig(num_blocks=256, max_model_len=1024, speedup=50), load_engine_tokenizer(tiny_model_dir), CostModel()
        )
        runner, port = await start_server(engine, "127.0.0.1", 0, role, protocol, transfer_ms_per_block=0.5)
        started.append((runner, engine))
        return f"http://127.0.0.1:{port}"

    yield start_engine
    for runner, engine in started:
        await runner.cleanup()
        await engine.stop()


async def post(url: str, body: dict) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_vllm_prefill_returns_transfer_params_that_a_decode_leg_takes(start) -> None:
    prefill, decode = await start("prefill", "vllm"), await start("decode", "vllm")
    status, _, answer = await post(
        prefill, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    blocks = answer["usage"]["prompt_tokens"] // 16
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] == list(range(blocks))
    assert params["remote_engine_id"] == "sim-" + prefill.removeprefix("http://")
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", int(prefill.rsplit(":", 1)[1]))

    status, headers, answer = await post(decode, {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
    assert status == 200, answer
    assert headers["x-sim-kv-transfer"] == f"from={params['remote_engine_id']};blocks={blocks}"
    assert answer["usage"]["completion_tokens"] == 4
    async with aiohttp.ClientSession() as session, session.get(decode + "/kvroute/pd") as resp:
        assert await resp.json() == {
            "role": "decode",
            "protocol": "vllm",
            "prefill_legs": 0,
            "decode_legs": 1,
            "blocks_received": blocks,
        }
        # The transferred prompt was stored, not computed: its blocks are in the decode engine's cache.
        async with session.get(decode + "/kvroute/blocks") as blocks_resp:
            assert (await blocks_resp.json())["counts"]["gpu"] >= blocks


@pytest.mark.parametrize(
    "params,message",
    [
        ("yes", "kv_transfer_params must be an object"),
        ({"do_remote_prefill": True, "remote_engine_id": "x"}, "remote_block_ids (a list)"),
        ({"do_remote_prefill": True, "remote_block_ids": [1]}, "remote_engine_id (a string)"),
    ],
)
async def test_a_malformed_remote_prefill_is_a_400(start, params, message) -> None:
    decode = await start("decode", "vllm")
    status, _, answer = await post(decode, {"prompt": PROMPT, "kv_transfer_params": params})
    assert status == 400 and message in answer["error"]["message"], answer
    assert answer["error"]["param"] == "kv_transfer_params"


async def test_sglang_legs_need_the_bootstrap_fields(start) -> None:
    prefill, decode = await start("prefill", "sglang"), await start("decode", "sglang")
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}
    for url in (prefill, decode):
        status, _, answer = await post(url, {"prompt": PROMPT})
        assert status == 400 and answer["error"]["param"] == "bootstrap_host", answer
        status, _, answer = await post(url, {"prompt": PROMPT, **bootstrap, "bootstrap_room": 2**63})
        assert status == 400 and answer["error"]["param"] == "bootstrap_room", answer
    status, _, answer = await post(prefill, {"prompt": PROMPT, "max_tokens": 8, **bootstrap})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1, answer  # the prefill answers after its prompt
    status, headers, answer = await post(decode, {"prompt": PROMPT, "max_tokens": 8, **bootstrap})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    blocks = answer["usage"]["prompt_tokens"] // 16
    assert headers["x-sim-kv-transfer"] == f"from=127.0.0.1:8998;blocks={blocks};room={2**63 - 1}"


async def test_an_engine_without_a_role_has_no_pd_state(tiny_model_dir) -> None:
    engine = SimEngine(EngineConfig(num_blocks=64, max_model_len=1024), load_engine_tokenizer(tiny_model_dir))
    runner, port = await start_server(engine, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/kvroute/pd") as resp:
            assert resp.status == 404
    finally:
        await runner.cleanup()
        await engine.stop()
