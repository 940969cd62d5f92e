"""`kvroute agent`: one per engine (GPU node); engine KV events -> kvroute block keys -> control plane.

Examples:
  # vLLM (binds tcp://*:5557 / tcp://*:5558)
  kvroute agent --control-plane cp:50051 --engine vllm --kv-events tcp://127.0.0.1:5557 \\
      --replay-endpoint tcp://127.0.0.1:5558 --engine-url http://10.0.0.7:8000 --block-size 16 --metrics-port 9400
  # SGLang with 4 data-parallel ranks (ranks publish on ports 5557..5560, replay on 5567..5570)
  kvroute agent --engine sglang --kv-events tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5567 \\
      --data-parallel-size 4 --engine-url http://10.0.0.8:30000 --block-size 64
  # TensorRT-LLM (trtllm-serve; KV events are pulled from POST /kv_cache_events)
  kvroute agent --engine trtllm --engine-url http://10.0.0.9:8000 --block-size 32
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvroute.addresses import control_plane_addresses, http_url, listen_host, port_or_off, zmq_endpoint
from kvroute.listeners import run_service
from kvroute.process import add_log_level_argument, add_port_file_argument, on_stop_signal, process_setup
from kvroute.tls import TlsConfigError, add_grpc_message_argument, add_tls_arguments, tls_files_from_args
from kvroute.worker_agent.limits import (
    DEFAULT_GRPC_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_BATCH_EVENTS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_POLL_BYTES,
)

# Same as kvroute.worker_agent.agent.SUPPORTED_ENGINES / TRANSPORTS (not imported: keeps --help light).
SUPPORTED_ENGINES = ("vllm", "sglang", "trtllm")
TRANSPORTS = ("zmq", "http")


def _engine(value: str) -> str:
    if value not in SUPPORTED_ENGINES:
        raise argparse.ArgumentTypeError(
            f"engine {value!r} is not supported: this agent reads the KV events of {', '.join(SUPPORTED_ENGINES)}"
        )
    return value


def _role(value: str) -> str:
    from kvroute.roles import parse_role

    try:
        return parse_role(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _transport(value: str) -> str:
    if value != "auto" and value not in TRANSPORTS:
        raise argparse.ArgumentTypeError(f"transport {value!r} is not one of {', '.join(TRANSPORTS)}, auto")
    return value


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def _positive_seconds(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}") from None
    if not 0 < n < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control-plane",
        type=control_plane_addresses,
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="control plane gRPC address (replicas: HOST:PORT,HOST:PORT,...)",
    )
    p.add_argument(
        "--engine",
        default="vllm",
        type=_engine,
        metavar="{vllm,sglang,trtllm}",
        help="engine kind whose KV events to read (each has its own wire format)",
    )
    p.add_argument(
        "--kv-events-transport",
        default="auto",
        type=_transport,
        metavar="{zmq,http,auto}",
        help="how KV events arrive: zmq = the engine's ZMQ publisher at --kv-events (vLLM, SGLang, and "
        "TensorRT-LLM's streaming publisher); http = TensorRT-LLM's pull path, POST /kv_cache_events on "
        "--engine-url (trtllm-serve with kv_cache_config.event_buffer_max_size > 0; one poller per "
        "server); auto = http for trtllm, zmq otherwise",
    )
    p.add_argument(
        "--kv-events",
        type=zmq_endpoint,
        default="tcp://127.0.0.1:5557",
        metavar="ENDPOINT",
        help="engine's ZMQ KV-event PUB endpoint (the agent connects to it; default: vLLM's own default on "
        "this host); with data parallelism, rank 0's: rank r publishes on port + r. A publisher not "
        "connected, or a stream silent while the engine works, is logged and makes /ready 503",
    )
    p.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="bind --kv-events instead of connecting (vLLM connects when its endpoint has no '*')",
    )
    p.add_argument(
        "--replay-endpoint",
        type=zmq_endpoint,
        default=None,
        metavar="ENDPOINT",
        help="engine's ZMQ replay (ROUTER) endpoint: fills sequence gaps and catches up at start; "
        "with data parallelism, rank 0's (rank r: port + r)",
    )
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (the engine's kv-events-config topic)")
    p.add_argument(
        "--kv-events-poll-interval-ms",
        type=_positive_int,
        default=100,
        metavar="MS",
        help="http transport: pause between two POST /kv_cache_events",
    )
    p.add_argument(
        "--kv-events-max-frame-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_FRAME_BYTES,
        metavar="N",
        help="zmq transport: largest frame the KV-event SUB and replay sockets accept (ZMQ_MAXMSGSIZE; the "
        "default holds a whole 8-GPU node's KV cache as one batch); ZMQ drops the connection that "
        "carried a larger one, the agent connects again and replays or resets what was lost",
    )
    p.add_argument(
        "--kv-events-max-batch-events",
        type=_positive_int,
        default=DEFAULT_MAX_BATCH_EVENTS,
        metavar="N",
        help="most events one batch (ZMQ) or response body (http) may hold; a larger one is dropped "
        "before it is decoded and handled as a lost batch",
    )
    p.add_argument(
        "--kv-events-max-poll-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_POLL_BYTES,
        metavar="N",
        help="http transport: largest POST /kv_cache_events response body read; a larger one is dropped "
        "(its events are lost: the rank is reset)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the engine runs N data-parallel ranks behind --engine-url (vLLM/SGLang --dp-size, TRT-LLM "
        "attention DP): one kvroute worker per rank, '<worker-id>-dp<rank>', each registered with its "
        "rank (routers pin requests with X-data-parallel-rank). Unset: not a data-parallel engine",
    )
    p.add_argument(
        "--data-parallel-rank-start",
        type=_non_negative_int,
        default=0,
        metavar="R",
        help="first global rank this agent serves (multi-node DP: ranks R..R+N-1 publish on port + rank)",
    )
    p.add_argument(
        "--engine-url",
        type=http_url,
        default="http://127.0.0.1:8000",
        metavar="URL",
        help="engine's OpenAI-compatible base URL (default: vLLM's own default on this host): advertised to "
        "routers, polled for /metrics (load) and /v1/models (model when --model is not given, LoRA "
        "adapters every 5 s); the workers are registered only while it answers GET /v1/models",
    )
    p.add_argument(
        "--engine-gone-after-s",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="after this long without an answer from the engine's GET /v1/models, withdraw its workers from "
        "the control plane (routers stop sending there); they register again when it answers",
    )
    p.add_argument(
        "--worker-id",
        default=None,
        metavar="ID",
        help="worker id; when unset, HOST:PORT of --engine-url (a loopback host becomes this machine's hostname)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME", help="served model name; when unset, asked from the engine (GET /v1/models)"
    )
    p.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        metavar="N",
        help="engine KV block size in tokens (SGLang: page size; TRT-LLM: tokens_per_block); if events "
        "carry another, the agent re-registers with it",
    )
    p.add_argument(
        "--role",
        type=_role,
        default="",
        metavar="{prefill,decode,both}",
        help="the engine's part under prefill/decode disaggregation, registered with the worker: "
        "prefill, decode, or both (default: serves whole requests); routers in P/D mode "
        "(kvroute router --pd) send each leg to a worker of its role",
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        help="serve the agent's /metrics, /health (liveness) and /ready (readiness) on this port "
        "(0 = any free port; default off)",
    )
    p.add_argument("--metrics-host", type=listen_host, default="127.0.0.1", help="address of the /metrics listener")
    add_tls_arguments(p)
    add_grpc_message_argument(p, DEFAULT_GRPC_MAX_MESSAGE_BYTES)
    add_log_level_argument(p)
    add_port_file_argument(p)


def config_from_args(args: argparse.Namespace):
    from kvroute.worker_agent.agent import AgentConfig

    return AgentConfig(
        control_plane=args.control_plane,
        kv_events=args.kv_events,
        engine_url=args.engine_url,
        worker_id=args.worker_id,
        model=args.model,
        block_size=args.block_size,
        engine=args.engine,
        role=args.role,
        kv_events_transport=None if args.kv_events_transport == "auto" else args.kv_events_transport,
        replay_endpoint=args.replay_endpoint,
        kv_events_bind=args.kv_events_bind,
        topic=args.topic,
        kv_events_poll_interval_s=args.kv_events_poll_interval_ms / 1000,
        kv_events_max_frame_bytes=args.kv_events_max_frame_bytes,
        kv_events_max_batch_events=args.kv_events_max_batch_events,
        kv_events_max_poll_bytes=args.kv_events_max_poll_bytes,
        data_parallel_size=args.data_parallel_size,
        data_parallel_rank_start=args.data_parallel_rank_start,
        engine_gone_after_s=args.engine_gone_after_s,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        port_file=args.port_file,
        tls=tls_files_from_args(args, server=False),
        grpc_max_message_bytes=args.grpc_max_message_bytes,
    )


def run(args: argparse.Namespace) -> int:
    from kvroute.worker_agent.agent import WorkerAgent

    with process_setup("kvroute-agent", args.log_level):
        try:
            agent = WorkerAgent(config_from_args(args))
        except (ValueError, TlsConfigError) as exc:  # options that do not fit together (each is valid on its own)
            print(f"kvroute agent: error: {exc}", file=sys.stderr)
            return 2
        return run_service("agent", _run_until_stopped(agent))  # a port or bind endpoint in use: one line, exit 2


async def _run_until_stopped(agent) -> int:
    on_stop_signal(asyncio.current_task().cancel)
    try:
        await agent.run()
    except asyncio.CancelledError:
        logging.getLogger("kvroute.agent").info("agent %s stopping", ", ".join(w.identity.worker_id for w in agent.workers))
    return 0
