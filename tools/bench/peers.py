"""Other routers to measure kvroute against, installed from the package index into cached
virtualenvs and run as processes in front of the same engines.

    smg          SGLang's model gateway (`sglang-router`, Rust): `smg launch --worker-urls ...
                 --policy round_robin|cache_aware`; it needs nothing from an engine but /health (each instance
                 gets its own Prometheus port: the default one cannot be shared).
    vllm-router  vLLM's router (`vllm-router`, Rust, a fork of the same gateway): `vllm-router
                 --worker-urls ... --policy round_robin|cache_aware`. Neither policy asks the engine to
                 render or tokenize (its kv_aware reads the engines' KV events instead), so it runs
                 against sim engines as they are.

Each peer's venv lives under `<cache>/peers/<package>-<version>/` (default cache: `.kvroute-cache`
in the working directory, `KVROUTE_CACHE` overrides) and is built once with pip; later runs reuse it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from kvroute.tools.local_cluster import ManagedProcess, free_port, http_ok, wait_until


@dataclass(frozen=True)
class Peer:
    name: str  # what `--peer` takes
    package: str
    version: str
    executable: str  # the console script the package installs
    policies: tuple[str, ...]


PEERS = {
    "smg": Peer("smg", "sglang-router", "0.3.2", "smg", ("round_robin", "cache_aware")),
    "vllm-router": Peer("vllm-router", "vllm-router", "0.1.17", "vllm-router", ("round_robin", "cache_aware")),
}


def cache_dir() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE", ".kvroute-cache")).resolve()


def peer_bin(peer: Peer) -> Path:
    """The peer's executable, installing it into its cached venv first if needed."""
    root = cache_dir() / "peers" / f"{peer.package}-{peer.version}"
    exe = root / "bin" / peer.executable
    if exe.exists():
        return exe
    print(f"installing {peer.package}=={peer.version} into {root} (once)", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", f"{peer.package}=={peer.version}"], check=True)
    if not exe.exists():
        raise RuntimeError(f"{peer.package} installed no {peer.executable} in {root / 'bin'}")
    return exe


def start_peer(peer: Peer, policy: str, engine_urls: list[str], workdir: Path) -> tuple[ManagedProcess, str]:
    """Run the peer with `policy` in front of `engine_urls`; (its process, its base URL) once it answers."""
    port = free_port()
    # Each instance gets its own metrics port: two instances must not share the default one.
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *engine_urls,
    ]
    if peer.name == "smg":
        argv = [str(peer_bin(peer)), "launch", "--log-level", "warn", *common]
    elif peer.name == "vllm-router":
        argv = [str(peer_bin(peer)), "--log-level", "warning", *common]
    else:  # pragma: no cover - PEERS names only the peers above
        raise ValueError(f"unknown peer {peer.name!r}")
    proc = ManagedProcess(f"{peer.name}-{policy}", argv, workdir / f"{peer.name}-{policy}.log")
    proc.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(url + "/health"), 60, f"{peer.name} {policy}", [proc])
    return proc, url
