"""`kvroute sim-engine`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kvroute import aio
from kvroute.telemetry import setup_tracing


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sim_engine.cost_model import CostModel

    d = CostModel()
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    p.add_argument("--model", default="tiny-llama", help="served model name")
    p.add_argument("--tokenizer", required=True, help="local model directory holding tokenizer.json")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV cache capacity in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=32768, help="longest prompt + output accepted")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per scheduler step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument("--kv-events-config", default="", help="vLLM-style KV events JSON, e.g. "
                   '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\'')
    p.add_argument("--wire-era", choices=["map", "array"], default="map",
                   help="event encoding: map = vLLM 0.24-0.33, array = vLLM 0.22-0.23")
    p.add_argument("--replay-framing", choices=["new", "old"], default="new",
                   help="replay reply framing: new = vLLM >= 0.26 (with topic), old = earlier")
    p.add_argument("--speedup", type=float, default=1.0, help="run this many times faster than the cost model")
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s, help="cost model: prefill rate")
    p.add_argument("--decode-step-ms", type=float, default=d.decode_step_s * 1000, help="cost model: decode step time")
    p.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_s * 1000,
                   help="cost model: extra decode time per running sequence")
    p.add_argument("--hash-seed", default=None, help="fixed seed for engine block hashes (default: random per process, like vLLM)")
    p.add_argument("--log-level", default="INFO", help="Python logging level")


async def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from data_plane.tokenization import load_tokenizer
    from sim_engine.cost_model import CostModel
    from sim_engine.kv_publisher import KvEventPublisher
    from sim_engine.server import EngineConfig, SimEngine

    config = EngineConfig(model=args.model, num_blocks=args.num_blocks, block_size=args.block_size,
                          max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, speedup=args.speedup, hash_seed=args.hash_seed)
    cost = CostModel(prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_ms / 1000,
                     decode_per_seq_s=args.decode_per_seq_ms / 1000)
    publisher = KvEventPublisher.from_cli(args.kv_events_config, args.block_size, args.wire_era, args.replay_framing)
    engine = SimEngine(config, load_tokenizer(args.tokenizer), cost, publisher)
    engine.start()
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logging.getLogger("kvroute.sim_engine").info(
        "sim engine ready on http://%s:%d (model %s, %d blocks of %d, kv events %s)", args.host, args.port,
        args.model, args.num_blocks, args.block_size, publisher.endpoint if publisher else "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if publisher:
        publisher.close()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("kvroute-sim-engine")
    return aio.run(serve(args))
