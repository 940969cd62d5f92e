"""`kvroute agent`."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import urllib.parse
import urllib.request

from kvroute import aio
from kvroute.telemetry import setup_tracing, shutdown_tracing


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-plane", default="127.0.0.1:50051", metavar="HOST:PORT", help="control plane gRPC address")
    p.add_argument("--engine", default="vllm", help="engine kind whose KV events to read (supported: vllm)")
    p.add_argument("--kv-events", default="tcp://127.0.0.1:5557", metavar="ENDPOINT",
                   help="engine's ZMQ KV-event PUB endpoint to connect to")
    p.add_argument("--kv-events-bind", action="store_true",
                   help="bind the SUB socket instead (vLLM connects when its endpoint has no '*')")
    p.add_argument("--replay-endpoint", default=None, metavar="ENDPOINT",
                   help="engine's ZMQ replay (ROUTER) endpoint, used to fill gaps and catch up at start")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to")
    p.add_argument("--engine-url", default="http://127.0.0.1:8000", metavar="URL",
                   help="engine's OpenAI-compatible base URL: advertised to routers, polled for /metrics")
    p.add_argument("--worker-id", default=None, metavar="ID", help="worker id (default: HOST:PORT of --engine-url)")
    p.add_argument("--model", default=None, help="served model name (default: asked from the engine's /v1/models)")
    p.add_argument("--block-size", type=int, default=16, help="engine KV block size in tokens (corrected from events)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve the agent's /metrics on this port (0 = off)")
    p.add_argument("--log-level", default="INFO", help="Python logging level")


def _model_from_engine(engine_url: str) -> str:
    try:
        with urllib.request.urlopen(engine_url.rstrip("/") + "/v1/models", timeout=30) as resp:
            return json.load(resp)["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"--model not given and {engine_url}/v1/models did not name one: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    from worker_agent.agent import AgentConfig, WorkerAgent

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine != "vllm":
        print(f"unsupported --engine {args.engine!r}: this agent reads vLLM KV events (use --engine vllm)",
              file=sys.stderr)
        return 2
    worker_id = args.worker_id or urllib.parse.urlsplit(args.engine_url).netloc or socket.gethostname()
    config = AgentConfig(control_plane=args.control_plane, kv_events=args.kv_events, engine_url=args.engine_url,
                         worker_id=worker_id, model=args.model or _model_from_engine(args.engine_url),
                         block_size=args.block_size, engine=args.engine, replay_endpoint=args.replay_endpoint,
                         kv_events_bind=args.kv_events_bind, topic=args.topic, metrics_port=args.metrics_port)
    setup_tracing("kvroute-agent")
    logging.getLogger("kvroute.agent").info("agent %s: %s -> %s", worker_id, args.kv_events, args.control_plane)

    async def main() -> int:
        await WorkerAgent(config).run()
        return 0

    try:
        return aio.run(main())
    finally:
        shutdown_tracing()
