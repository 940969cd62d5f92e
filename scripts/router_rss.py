"""A router process's memory around large requests: starts `kvroute router` on the tiny local model
(no control plane: it fails open, and with no worker a request that gets through every check is a
503), sends rounds of large chat bodies, N at once, and prints each answer with its time, the
router's RSS after each round and its peak (VmHWM).

    python scripts/router_rss.py --mb 10 --concurrency 2
    python scripts/router_rss.py --mb 4.1 --concurrency 2 -- --max-prompt-tokens 1000000   # tokenized
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvroute.tools.local_cluster import free_port, http_ok, kvroute_argv, wait_until
from kvroute.tools.tiny_model import build_model_dir


def proc_status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def post(url: str, data: bytes) -> tuple[int, float, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    return status, time.monotonic() - started, body


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=10.0, help="characters of each message, in millions")
    p.add_argument("--concurrency", type=int, default=1, help="requests sent at once per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("router_args", nargs="*", help="extra `kvroute router` flags (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvroute-rss-") as tmp:
        model = build_model_dir(Path(tmp) / "tiny")
        port = free_port()
        with open(Path(tmp) / "router.log", "wb") as log:
            router = subprocess.Popen(
                kvroute_argv(
                    "router",
                    "--control-plane",
                    f"127.0.0.1:{free_port()}",
                    "--tokenizer",
                    str(model),
                    "--model",
                    "tiny",
                    "--port",
                    str(port),
                    "--grpc-port",
                    "off",
                    *args.router_args,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: http_ok(url + "/health"), 30, "router")
            post(url + "/v1/route", json.dumps({"model": "tiny", "prompt": "warm up"}).encode())
            print(f"idle: RSS {proc_status_mb(router.pid, 'VmRSS'):.0f} MB")
            chars = int(args.mb * 1e6)
            for r in range(args.rounds):
                bodies = []
                for i in range(args.concurrency):  # distinct texts, so the segment cache cannot answer a later one
                    text = (
                        f"request {r} {i}: the cache router sends each prompt to the worker that holds its prefix "
                        * (chars // 80 + 1)
                    )[:chars]
                    bodies.append(
                        json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}).encode()
                    )
                with ThreadPoolExecutor(args.concurrency) as pool:
                    results = list(pool.map(lambda body: post(url + "/v1/chat/completions", body), bodies))
                time.sleep(1.0)
                for (status, seconds, answer), body in zip(results, bodies):
                    print(f"round {r}: {len(body) / 1e6:.1f} MB body -> {status} in {seconds:.2f} s: {answer[:100]!r}")
                print(
                    f"round {r}: RSS {proc_status_mb(router.pid, 'VmRSS'):.0f} MB, "
                    f"peak {proc_status_mb(router.pid, 'VmHWM'):.0f} MB"
                )
        finally:
            router.terminate()
            router.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
