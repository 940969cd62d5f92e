"""`kvroute agent`: one per engine (GPU node); engine KV events -> kvroute block keys -> control plane.

Example (vLLM binds `tcp://*:5557` / `tcp://*:5558`):
  kvroute agent --control-plane cp:50051 --engine vllm --kv-events tcp://127.0.0.1:5557 \\
      --replay-endpoint tcp://127.0.0.1:5558 --engine-url http://10.0.0.7:8000 --block-size 16 --metrics-port 9400
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kvroute import aio
from kvroute.telemetry import setup_tracing, shutdown_tracing

SUPPORTED_ENGINES = ("vllm",)  # same as worker_agent.agent.SUPPORTED_ENGINES (not imported: keeps --help light)


def _engine(value: str) -> str:
    if value not in SUPPORTED_ENGINES:
        raise argparse.ArgumentTypeError(
            f"engine {value!r} is not supported yet; this agent reads vLLM's KV-event wire format "
            f"(choose from: {', '.join(SUPPORTED_ENGINES)})")
    return value


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _port(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {value!r}")
    return n


def _log_level(value: str) -> str:
    level = value.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"unknown log level {value!r} (DEBUG, INFO, WARNING, ERROR)")
    return level


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-plane", default="127.0.0.1:50051", metavar="HOST:PORT", help="control plane gRPC address")
    p.add_argument("--engine", default="vllm", type=_engine, metavar="{vllm}",
                   help="engine kind whose KV events to read (only vllm for now)")
    p.add_argument("--kv-events", default="tcp://127.0.0.1:5557", metavar="ENDPOINT",
                   help="engine's ZMQ KV-event PUB endpoint (the agent connects to it)")
    p.add_argument("--kv-events-bind", action="store_true",
                   help="bind --kv-events instead of connecting (vLLM connects when its endpoint has no '*')")
    p.add_argument("--replay-endpoint", default=None, metavar="ENDPOINT",
                   help="engine's ZMQ replay (ROUTER) endpoint: fills sequence gaps and catches up at start")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (vLLM's kv-events-config topic)")
    p.add_argument("--engine-url", default="http://127.0.0.1:8000", metavar="URL",
                   help="engine's OpenAI-compatible base URL: advertised to routers, polled for /metrics and "
                        "asked for the model (GET /v1/models) when --model is not given")
    p.add_argument("--worker-id", default=None, metavar="ID",
                   help="worker id; when unset, HOST:PORT of --engine-url (a loopback host becomes this machine's hostname)")
    p.add_argument("--model", default=None, metavar="NAME", help="served model name; when unset, asked from the engine (GET /v1/models)")
    p.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                   help="engine KV block size in tokens (if events carry another, the agent re-registers with it)")
    p.add_argument("--metrics-port", type=_port, default=0, help="serve the agent's /metrics and /health on this port (0 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics listener")
    p.add_argument("--log-level", type=_log_level, default="INFO", help="Python logging level")


def config_from_args(args: argparse.Namespace):
    from worker_agent.agent import AgentConfig

    return AgentConfig(control_plane=args.control_plane, kv_events=args.kv_events, engine_url=args.engine_url,
                       worker_id=args.worker_id, model=args.model, block_size=args.block_size, engine=args.engine,
                       replay_endpoint=args.replay_endpoint, kv_events_bind=args.kv_events_bind, topic=args.topic,
                       metrics_host=args.metrics_host, metrics_port=args.metrics_port)


def run(args: argparse.Namespace) -> int:
    from worker_agent.agent import WorkerAgent

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = WorkerAgent(config_from_args(args))
    setup_tracing("kvroute-agent")

    async def main() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await agent.run()
        except asyncio.CancelledError:
            logging.getLogger("kvroute.agent").info("agent %s stopping", agent.identity.worker_id)
        return 0

    try:
        return aio.run(main())
    finally:
        shutdown_tracing()
