"""`kvroute sim-engine`: a GPU-free engine stand-in (OpenAI API, prefix cache, real KV events).

`--dialect` picks the engine and version whose KV events, hashes and metrics it reproduces
(vLLM 0.9.0 ... 0.33, SGLang 0.4.8 ... 0.5.22, TensorRT-LLM pull or ZMQ; see `dialects.py`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvroute.addresses import listen_host, port
from kvroute.listeners import run_service
from kvroute.process import (
    add_log_level_argument,
    add_port_file_argument,
    non_negative,
    positive,
    process_setup,
    wait_for_stop_signal,
    write_port_file,
)
from kvroute.tools.sim_engine.pd import DEFAULT_TRANSFER_MS_PER_BLOCK

log = logging.getLogger("kvroute.sim_engine")


def _adapter_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.tools.sim_engine.cost_model import CostModel
    from kvroute.tools.sim_engine.dialects import DEFAULT_DIALECT, DIALECTS

    d = CostModel()
    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=port, default=8000, help="HTTP port of the OpenAI-compatible API (0 = any free port)")
    p.add_argument("--model", default="tiny-llama", help="served model name")
    p.add_argument("--tokenizer", required=True, help="local model directory holding tokenizer.json (+ tokenizer_config.json)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV cache capacity in blocks")
    p.add_argument(
        "--dialect",
        choices=list(DIALECTS),
        default=DEFAULT_DIALECT,
        help=f"engine and version to imitate on the wire, in its metrics and its hashes (default {DEFAULT_DIALECT})",
    )
    p.add_argument(
        "--block-size",
        "--page-size",
        dest="block_size",
        type=positive(int),
        default=None,
        help="tokens per KV block (SGLang: page size); default 16, TensorRT-LLM 32",
    )
    p.add_argument("--max-model-len", type=int, default=32768, help="longest prompt + output accepted")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per scheduler step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument(
        "--kv-events-config",
        default="",
        help="vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\'',
    )
    p.add_argument(
        "--event-hash-form",
        choices=["int", "bytes", "hex"],
        default=None,
        help="block hashes in events: int (default), bytes (vLLM >= 0.10.2 with "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), hex (TensorRT-LLM pull, v2_sha256)",
    )
    p.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="data-parallel rank: KV-event ports are offset by it and batches carry it",
    )
    p.add_argument(
        "--event-buffer-max-size",
        type=int,
        default=10000,
        help="trtllm-pull: most KV-cache events kept for POST /kv_cache_events (oldest dropped)",
    )
    p.add_argument(
        "--lora-adapters",
        type=_adapter_names,
        default=(),
        metavar="A,B",
        help="LoRA adapter names served on top of --model (requests name them as `model`)",
    )
    p.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=0,
        help="CPU offload tier: evicted GPU blocks move to an LRU of this many blocks (0 = off)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="run this many times faster than the cost model")
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s, help="cost model: prefill rate")
    p.add_argument("--decode-step-ms", type=float, default=d.decode_step_s * 1000, help="cost model: decode step base time")
    p.add_argument(
        "--decode-per-seq-ms",
        type=float,
        default=d.decode_per_seq_s * 1000,
        help="cost model: extra decode time per running sequence",
    )
    p.add_argument(
        "--decode-per-context-token-ns",
        type=float,
        default=d.decode_per_context_token_s * 1e9,
        help="cost model: extra decode time per KV-cache token attended (KV reads)",
    )
    p.add_argument(
        "--step-overhead-ms", type=float, default=d.step_overhead_s * 1000, help="cost model: fixed time per scheduler step"
    )
    p.add_argument(
        "--cpu-load-tokens-per-s",
        type=float,
        default=d.cpu_load_tokens_per_s,
        help="cost model: rate of loading cached tokens back from the CPU tier",
    )
    p.add_argument(
        "--role",
        choices=("prefill", "decode", "both"),
        default=None,
        help="prefill/decode disaggregation: the part this engine plays (default: none, whole requests; "
        "`both` takes P/D fields but keeps serving whole requests)",
    )
    p.add_argument(
        "--pd-protocol",
        choices=("vllm", "sglang"),
        default=None,
        help="P/D fields it reads: vllm (kv_transfer_params) or sglang (bootstrap host/port/room); "
        "default with --role: the dialect's engine",
    )
    p.add_argument(
        "--pd-transfer-ms-per-block",
        type=non_negative(float),
        default=DEFAULT_TRANSFER_MS_PER_BLOCK,
        metavar="MS",
        help="cost model: time a decode leg waits per transferred KV block",
    )
    p.add_argument("--default-max-tokens", type=int, default=16, help="output length when a request sets no max_tokens")
    p.add_argument(
        "--hash-seed",
        default=None,
        help="fixed seed for engine block hashes (default: random per process, like vLLM without PYTHONHASHSEED)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated output tokens")
    add_log_level_argument(p)
    add_port_file_argument(p)


def build_publisher(args: argparse.Namespace, config):
    """The dialect's event publisher: ZMQ (None when the config leaves it off) or TRT-LLM's pull queue."""
    from kvroute.tools.sim_engine.dialects import get_dialect
    from kvroute.tools.sim_engine.kv_publisher import KvEventPublisher
    from kvroute.tools.sim_engine.trtllm_events import TrtllmEventQueue

    dialect = get_dialect(config.dialect)
    if args.data_parallel_rank < 0:
        raise ValueError("--data-parallel-rank must not be negative")
    if dialect.transport == "pull":
        if args.kv_events_config:
            raise ValueError(
                f"{dialect.name} has no ZMQ publisher (its events are polled with POST /kv_cache_events): drop --kv-events-config"
            )
        return TrtllmEventQueue(
            config.num_blocks,
            config.cpu_offload_blocks,
            config.max_model_len,
            args.event_buffer_max_size,
            config.event_hash_form == "hex",
            args.data_parallel_rank or None,
        )
    return KvEventPublisher.from_cli(args.kv_events_config, config.block_size, dialect, args.data_parallel_rank)


def build_engine(args: argparse.Namespace):
    """Engine + (optional) KV-event publisher from parsed arguments. Raises ValueError/OSError on bad input."""
    from kvroute.tools.sim_engine.cost_model import CostModel
    from kvroute.tools.sim_engine.dialects import get_dialect
    from kvroute.tools.sim_engine.engine import EngineConfig, SimEngine
    from kvroute.tools.sim_engine.tokenizer import load_engine_tokenizer

    block_size = args.block_size or get_dialect(args.dialect).default_block_size
    config = EngineConfig(
        model=args.model,
        num_blocks=args.num_blocks,
        block_size=block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        speedup=args.speedup,
        hash_seed=args.hash_seed,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        dialect=args.dialect,
        lora_adapters=args.lora_adapters,
        cpu_offload_blocks=args.cpu_offload_blocks,
        event_hash_form=args.event_hash_form,
    )
    cost = CostModel(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_s=args.decode_step_ms / 1000,
        decode_per_seq_s=args.decode_per_seq_ms / 1000,
        decode_per_context_token_s=args.decode_per_context_token_ns / 1e9,
        step_overhead_s=args.step_overhead_ms / 1000,
        cpu_load_tokens_per_s=args.cpu_load_tokens_per_s,
    )
    tokenizer = load_engine_tokenizer(args.tokenizer)
    return SimEngine(config, tokenizer, cost, build_publisher(args, config))


async def serve(args: argparse.Namespace) -> int:
    import zmq

    from kvroute.listeners import ListenError
    from kvroute.tools.sim_engine.server import start_server

    try:
        engine = build_engine(args)
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"kvroute sim-engine: {exc}", file=sys.stderr)
        return 2
    try:
        runner, port = await start_server(
            engine, args.host, args.port, args.role, args.pd_protocol, args.pd_transfer_ms_per_block
        )
    except ListenError:
        await engine.stop()
        raise
    log.info(
        "sim engine ready on http://%s:%d (%s, model %s, %d blocks of %d tokens, %s%s)",
        args.host,
        port,
        engine.dialect.name,
        args.model,
        args.num_blocks,
        engine.config.block_size,
        _events_summary(engine),
        f", P/D role {args.role or 'both'}" if args.role or args.pd_protocol else "",
    )
    write_port_file(args.port_file, {"http": port, **_event_ports(engine)})
    await wait_for_stop_signal()
    log.info("sim engine shutting down")
    await runner.cleanup()
    await engine.stop()
    return 0


def _event_ports(engine) -> dict[str, int]:
    """The ports the engine's ZMQ sockets bound ("kv_events", "replay"): none when it connects or publishes none."""
    from kvroute.tools.sim_engine.kv_publisher import KvEventPublisher

    pub = engine.publisher
    if not isinstance(pub, KvEventPublisher) or not pub.binds:
        return {}
    endpoints = {"kv_events": pub.last_endpoint, "replay": pub.replay_last_endpoint}
    return {name: int(e.rsplit(":", 1)[1]) for name, e in endpoints.items() if e and e.startswith("tcp://")}


def _events_summary(engine) -> str:
    from kvroute.tools.sim_engine.kv_publisher import KvEventPublisher

    pub = engine.publisher
    if pub is None:
        return "kv events off"
    if not isinstance(pub, KvEventPublisher):
        return "kv events: POST /kv_cache_events"
    replay = f", replay {pub.replay_last_endpoint} ({pub.replay_framing} framing)" if pub.replay_endpoint else ""
    return f"kv events {pub.last_endpoint} ({'bound' if pub.binds else 'connected'}){replay}"


def run(args: argparse.Namespace) -> int:
    with process_setup("kvroute-sim-engine", args.log_level):
        return run_service("sim-engine", serve(args))  # a port in use: one line, exit 2
