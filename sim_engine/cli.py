"""`kvroute sim-engine`: a GPU-free vLLM stand-in (OpenAI API, prefix cache, real vLLM KV events)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvroute import aio
from kvroute.telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger("kvroute.sim_engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sim_engine.cost_model import CostModel

    d = CostModel()
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API (0 = any free port)")
    p.add_argument("--model", default="tiny-llama", help="served model name")
    p.add_argument("--tokenizer", required=True, help="local model directory holding tokenizer.json (+ tokenizer_config.json)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV cache capacity in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=32768, help="longest prompt + output accepted")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per scheduler step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument("--kv-events-config", default="", help="vLLM's KV events JSON, e.g. "
                   '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\'')
    p.add_argument("--wire-era", choices=["map", "array"], default="map",
                   help="event encoding: map = vLLM 0.24-0.33 (default), array = vLLM 0.22-0.23")
    p.add_argument("--replay-framing", choices=["new", "old"], default="new",
                   help="replay reply framing: new = vLLM >= 0.26 (with topic), old = earlier")
    p.add_argument("--speedup", type=float, default=1.0, help="run this many times faster than the cost model")
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s, help="cost model: prefill rate")
    p.add_argument("--decode-step-ms", type=float, default=d.decode_step_s * 1000, help="cost model: decode step base time")
    p.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_s * 1000,
                   help="cost model: extra decode time per running sequence")
    p.add_argument("--decode-per-context-token-ns", type=float, default=d.decode_per_context_token_s * 1e9,
                   help="cost model: extra decode time per KV-cache token attended (KV reads)")
    p.add_argument("--step-overhead-ms", type=float, default=d.step_overhead_s * 1000,
                   help="cost model: fixed time per scheduler step")
    p.add_argument("--default-max-tokens", type=int, default=16, help="output length when a request sets no max_tokens")
    p.add_argument("--hash-seed", default=None,
                   help="fixed seed for engine block hashes (default: random per process, like vLLM without PYTHONHASHSEED)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated output tokens")
    p.add_argument("--log-level", default="INFO", help="Python logging level")


def build_engine(args: argparse.Namespace):
    """Engine + (optional) KV-event publisher from parsed arguments. Raises ValueError/OSError on bad input."""
    from data_plane.tokenization import load_tokenizer
    from sim_engine.cost_model import CostModel
    from sim_engine.engine import EngineConfig, SimEngine
    from sim_engine.kv_publisher import KvEventPublisher

    config = EngineConfig(model=args.model, num_blocks=args.num_blocks, block_size=args.block_size,
                          max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, speedup=args.speedup, hash_seed=args.hash_seed,
                          default_max_tokens=args.default_max_tokens, seed=args.seed)
    cost = CostModel(prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_ms / 1000,
                     decode_per_seq_s=args.decode_per_seq_ms / 1000,
                     decode_per_context_token_s=args.decode_per_context_token_ns / 1e9,
                     step_overhead_s=args.step_overhead_ms / 1000)
    tokenizer = load_tokenizer(args.tokenizer)
    publisher = KvEventPublisher.from_cli(args.kv_events_config, args.block_size, args.wire_era, args.replay_framing)
    return SimEngine(config, tokenizer, cost, publisher)


async def serve(args: argparse.Namespace) -> int:
    import zmq

    from sim_engine.server import start_server

    try:
        engine = build_engine(args)
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"kvroute sim-engine: {exc}", file=sys.stderr)
        return 2
    try:
        runner, port = await start_server(engine, args.host, args.port)
    except OSError as exc:
        print(f"kvroute sim-engine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        await engine.stop()
        return 2
    pub = engine.publisher
    events = (f"kv events {pub.last_endpoint} ({args.wire_era} era"
              + (f", replay {pub.replay_last_endpoint} {args.replay_framing} framing)" if pub.replay_endpoint else ")")
              if pub else "kv events off")
    log.info("sim engine ready on http://%s:%d (model %s, %d blocks of %d tokens, %s)", args.host, port, args.model,
             args.num_blocks, args.block_size, events)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("sim engine shutting down")
    await runner.cleanup()
    await engine.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("kvroute-sim-engine")
    try:
        return aio.run(serve(args))
    finally:
        shutdown_tracing()
