"""Starting a real vLLM (CPU build, tiny random-weight model) for the real-vLLM tier: the flags and
environment ../shared/specs/real-vllm-on-cpu.md found to work on a CPU-only machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvroute.tools.local_cluster import EngineHandle, LocalCluster, ManagedProcess, free_port, http_ok, wait_until
from kvroute.tools.tiny_model import build_model_dir

BLOCK_SIZE = 32  # the CPU attention backend rejects 16
VLLM_START_S = 240


def new_cluster(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[LocalCluster, Path]:
    """A LocalCluster (nothing started) in a directory of its own, and the tiny model's directory."""
    workdir = tmp_path_factory.mktemp(name)
    model_dir = build_model_dir(workdir / "tiny-llama")
    return LocalCluster(workdir=workdir, tokenizer_dir=model_dir, block_size=BLOCK_SIZE), model_dir


def vllm_python() -> str:
    python = os.environ.get("KVROUTE_VLLM_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.fail("KVROUTE_VLLM_PYTHON must point at a Python with vLLM installed (run `make test-vllm`)")
    return python


def vllm_env(index: int) -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(index % 2),
    }


def start_vllm(
    cluster: LocalCluster, model_dir: Path, index: int, *extra: str, max_model_len: int = 2048, num_blocks: int = 128
) -> EngineHandle:
    """vLLM number `index` of `cluster`, publishing KV events on ports it binds; `extra` are more flags."""
    port, ev_port, replay_port = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "",
    }
    proc = ManagedProcess(
        f"vllm-{index}",
        [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            cluster.model,
            "--load-format",
            "dummy",
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            "8",
            "--num-gpu-blocks-override",
            str(num_blocks),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-events-config",
            json.dumps(config),
            *extra,
        ],
        cluster.workdir / f"vllm-{index}.log",
    )
    proc.start(env=vllm_env(index))
    handle = EngineHandle(f"vllm-{index}", f"http://127.0.0.1:{port}", ev_port, replay_port, proc, block_size=BLOCK_SIZE)
    cluster.engines.append(handle)
    return handle


def wait_vllm_healthy(engine: EngineHandle) -> None:
    wait_until(lambda: http_ok(engine.url + "/health"), VLLM_START_S, f"{engine.worker_id} healthy", [engine.engine], interval=1)
