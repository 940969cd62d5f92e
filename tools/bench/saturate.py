"""`kvroute bench saturate`: a router pinned to one core, driven to saturation by wrk in front of
engines that are not the bottleneck: requests per second and CPU time per request, per router.

    kvroute bench saturate [--peer smg] [--seconds 10] [--rounds 3] [--connections 32] --json

- Engines: nginx from the OS packages (`apt-get install -y nginx wrk`), one process on the other core,
  answering every POST with a canned completion (`--engines` ports, one worker each); without nginx
  or wrk the bench says so in one line and exits 2.
- Targets, one at a time, each pinned to the router core (`--router-core`, default 0) with
  sched_setaffinity as `taskset` does: `kvroute:round_robin`, `kvroute:kv_aware` (its default `--index
  local`), with `--peer smg` SGLang's gateway `smg:round_robin` and `smg:cache_aware` (tools/bench/peers.py),
  and `direct` (wrk straight at one nginx port: the engines' own figure). The control plane, the
  synthetic agents that register the nginx endpoints as workers (each holding a prefix of one of the
  system prompts, so that kv_aware's index has something to match), nginx and wrk run on the other
  core.
- wrk sends chat completions of ~600 words: one of 8 shared system prompts (~560 words) and a new
  question; the same bodies, in the same order, to every target.
- Per target and round: `requests_per_s` is wrk's; `cpu_us_per_request` is the target process's own
  CPU time (utime + stime, /proc, every thread) over the timed window divided by the requests wrk
  completed; for kvroute's routers the control plane's CPU time over the same window is added (it
  serves their fleet, and kv_aware's reservations go through it and back in its follow feed): what
  the router costs the fleet per request. `direct` counts nginx's. Rounds interleave the targets; the
  figures are the medians over rounds, every round's figures are in `rounds`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvroute.tools.bench.children import ChildProcess, pid_of_managed, pin, start_agents
from kvroute.tools.bench.peers import PEERS, start_peer
from kvroute.tools.disturbance import process_cpu_s
from kvroute.tools.local_cluster import LocalCluster, ManagedProcess, free_port, http_ok, long_text, wait_until
from kvroute.tools.tiny_model import build_model_dir

SYSTEM_PROMPTS = 8
QUESTIONS = 64  # distinct requests per system prompt; wrk cycles through all of them


class MissingTool(RuntimeError):
    """nginx or wrk is not installed: the one line the command prints."""


def require_tools() -> None:
    missing = [tool for tool in ("nginx", "wrk") if shutil.which(tool) is None]
    if missing:
        raise MissingTool(f"kvroute bench saturate: error: {' and '.join(missing)} not installed (apt-get install -y nginx wrk)")


def completion_json(model: str) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 600, "completion_tokens": 1, "total_tokens": 601},
        }
    )


def nginx_config(workdir: Path, ports: list[int], model: str) -> str:
    """One worker process, a server per engine port: /health, /v1/models and a canned completion for every
    other path (the request body is read and dropped)."""
    answer = completion_json(model).replace("'", "")
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]})
    temp = workdir / "nginx-temp"
    servers = "\n".join(
        f"""
    server {{
        listen 127.0.0.1:{port} reuseport;
        location = /health {{ return 200 'ok'; }}
        location = /v1/models {{ default_type application/json; return 200 '{models}'; }}
        location / {{ default_type application/json; return 200 '{answer}'; }}
    }}"""
        for port in ports
    )
    return f"""
worker_processes 1;
daemon off;
pid {workdir / "nginx.pid"};
error_log {workdir / "nginx-error.log"} warn;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_body_buffer_size 64k;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
{servers}
}}
"""


def start_nginx(workdir: Path, engines: int, model: str, core: int) -> tuple[ManagedProcess, list[str]]:
    ports = [free_port() for _ in range(engines)]
    (workdir / "nginx-temp").mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_config(workdir, ports, model))
    proc = ManagedProcess(
        "nginx",
        [shutil.which("nginx") or "nginx", "-c", str(conf), "-p", str(workdir), "-e", str(workdir / "nginx-error.log")],
        workdir / "nginx.log",
    )
    proc.start()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    wait_until(lambda: all(http_ok(u + "/health") for u in urls), 30, "nginx", [proc])
    pin_tree(pid_of_managed(proc), str(core))
    return proc, urls


def pin_tree(pid: int, cpus: str) -> None:
    """Pin `pid` and its children (nginx's worker)."""
    pin(pid, cpus)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            pin(int(child), cpus)


def tree_cpu_s(pid: int) -> float:
    """CPU time of `pid` and its direct children (nginx's master and worker)."""
    total = process_cpu_s(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        total += sum(process_cpu_s(int(child)) for child in children.read_text().split())
    return total


def request_bodies(model: str) -> list[str]:
    """SYSTEM_PROMPTS x QUESTIONS chat requests of ~600 words, interleaved over the system prompts."""
    systems = [long_text(5000 + g, 560) for g in range(SYSTEM_PROMPTS)]
    return [
        json.dumps(
            {
                "model": model,
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": systems[i % SYSTEM_PROMPTS]},
                    {"role": "user", "content": f"question {i}: {long_text(i, 40)}"},
                ],
            }
        )
        for i in range(SYSTEM_PROMPTS * QUESTIONS)
    ]


def wrk_script(workdir: Path, bodies: list[str]) -> Path:
    """A wrk Lua script sending `bodies` in turn as POST /v1/chat/completions."""
    quoted = ",\n".join(f"[==[{b}]==]" for b in bodies)
    script = workdir / "bodies.lua"
    script.write_text(f"""
local bodies = {{
{quoted}
}}
local n = #bodies
local i = 0
local headers = {{["Content-Type"] = "application/json"}}
request = function()
  i = i + 1
  return wrk.format("POST", "/v1/chat/completions", headers, bodies[(i % n) + 1])
end
""")
    return script


_REQUESTS = re.compile(r"(\d+) requests in ([\d.]+)(\w+)")
_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def run_wrk(url: str, script: Path, seconds: float, connections: int, core: int) -> dict:
    """wrk on `core` for `seconds` (whole seconds: wrk takes no fractions)."""
    done = subprocess.run(
        [
            "taskset",
            "-c",
            str(core),
            shutil.which("wrk") or "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=False,
    )
    out = done.stdout
    if done.returncode != 0:
        raise RuntimeError(f"wrk against {url} failed ({done.returncode}): {done.stderr or out}")
    m = _REQUESTS.search(out)
    if m is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    duration = float(m.group(2)) * {"ms": 1e-3, "s": 1.0, "m": 60.0}.get(m.group(3), 1.0)
    bad = int(m2.group(1)) if (m2 := _NON_2XX.search(out)) else 0
    errors = sum(int(x) for x in m3.groups()) if (m3 := _ERRORS.search(out)) else 0
    return {"requests": int(m.group(1)), "seconds": duration, "non_2xx": bad, "socket_errors": errors}


def measure(name: str, url: str, pids: dict[str, int], script: Path, seconds: float, connections: int, wrk_core: int) -> dict:
    """wrk against `url`; the CPU time of the processes `pids` (by part: "router", "control_plane", ...)
    over the window, per request and in cores."""
    before = {part: tree_cpu_s(pid) for part, pid in pids.items()}
    started = time.monotonic()
    stats = run_wrk(url, script, seconds, connections, wrk_core)
    parts = {part: tree_cpu_s(pid) - before[part] for part, pid in pids.items()}
    wall = time.monotonic() - started
    requests = max(1, stats["requests"])
    cpu = sum(parts.values())
    return {
        "target": name,
        "requests_per_s": round(stats["requests"] / stats["seconds"], 1),
        "cpu_us_per_request": round(cpu / requests * 1e6, 1),
        "cpu_cores": round(cpu / wall, 3),
        "cpu_us_per_request_by_part": {part: round(v / requests * 1e6, 1) for part, v in parts.items()},
        "requests": stats["requests"],
        "non_2xx": stats["non_2xx"],
        "socket_errors": stats["socket_errors"],
    }


def run_saturate(
    peers: tuple[str, ...] = (),
    seconds: float = 10.0,
    rounds: int = 3,
    connections: int = 32,
    engines: int = 4,
    router_core: int = 0,
    workdir: str = "",
) -> dict:
    require_tools()
    cores = sorted(os.sched_getaffinity(0))
    if router_core not in cores or len(cores) < 2:
        raise MissingTool(
            f"kvroute bench saturate: error: needs core {router_core} and another one; this process may run on {cores}"
        )
    other = next(c for c in cores if c != router_core)
    path = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvroute-bench-saturate-"))
    cluster = LocalCluster(workdir=path, tokenizer_dir=build_model_dir(path / "tiny-llama"), heartbeat_timeout_s=3600)
    model = cluster.model
    procs: list[ManagedProcess] = []
    agents: ChildProcess | None = None
    try:
        nginx, urls = start_nginx(path, engines, model, other)
        procs.append(nginx)
        address = cluster.start_control_plane()
        control_plane = pid_of_managed(cluster.control_plane)
        pin(control_plane, str(other))
        bodies = request_bodies(model)
        script = wrk_script(path, bodies)
        chains = system_prompt_chains(cluster.tokenizer_dir, bodies)
        (path / "prefixes.json").write_text(json.dumps(chains))
        agents = start_agents(
            path,
            "agents",
            address,
            "--workers",
            str(engines),
            "--worker-prefix",
            "nginx-",
            "--model",
            model,
            "--endpoints",
            ",".join(urls),
            "--prefix-file",
            str(path / "prefixes.json"),
            "--heartbeat-s",
            "1",
            taskset=str(other),
        )
        agents.wait_ready(60)
        targets: dict[str, tuple[str, dict[str, int]]] = {"direct": (urls[0], {"engine": pid_of_managed(nginx)})}
        for policy in ("round_robin", "kv_aware"):
            url = cluster.start_router(policy, policy)
            router = cluster.routers[policy]
            pin(pid_of_managed(router), str(router_core))
            wait_until(lambda u=url: http_ok(u + "/ready"), 60, f"router {policy} ready", [router])
            targets[f"kvroute:{policy}"] = (url, {"router": pid_of_managed(router), "control_plane": control_plane})
        for name in peers:
            peer = PEERS[name]
            for policy in peer.policies:
                proc, url = start_peer(peer, policy, urls, path)
                procs.append(proc)
                pin(pid_of_managed(proc), str(router_core))
                targets[f"{name}:{policy}"] = (url, {"router": pid_of_managed(proc)})
        for name, (url, _) in targets.items():  # warm-up: connections, caches, the kv_aware view's first claims
            run_wrk(url, script, 1.0, connections, other)
        runs = [
            [measure(name, url, pids, script, seconds, connections, other) for name, (url, pids) in targets.items()]
            for _ in range(rounds)
        ]
    finally:
        if agents is not None:
            agents.process.stop()
        for proc in procs:
            proc.stop()
        cluster.stop()
    return summarize(runs, seconds, connections, engines, router_core)


def system_prompt_chains(tokenizer_dir: Path, bodies: list[str]) -> list[list[int]]:
    """Each system prompt's block keys as the router computes them (chat template, tiny tokenizer,
    16-token blocks): what the synthetic agents say their workers hold."""
    from kvroute.block_keys import prompt_block_keys
    from kvroute.data_plane.prepare.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    model = tokenizer_dir.name
    return [prompt_block_keys(tokenizer.encode_chat(json.loads(b)["messages"]), 16, model) for b in bodies[:SYSTEM_PROMPTS]]


def summarize(runs: list[list[dict]], seconds: float, connections: int, engines: int, router_core: int) -> dict:
    names = [m["target"] for m in runs[0]]

    def median(name: str, key: str, digits: int = 1) -> float:
        return round(statistics.median(m[key] for run in runs for m in run if m["target"] == name), digits)

    return {
        "requests_per_s": {n: median(n, "requests_per_s") for n in names},
        "cpu_us_per_request": {n: median(n, "cpu_us_per_request") for n in names},
        "cpu_cores": {n: median(n, "cpu_cores", 3) for n in names},
        "cpu_us_per_request_by_part": {
            n: {
                part: round(
                    statistics.median(m["cpu_us_per_request_by_part"][part] for run in runs for m in run if m["target"] == n), 1
                )
                for part in runs[0][i]["cpu_us_per_request_by_part"]
            }
            for i, n in enumerate(names)
        },
        "non_2xx": {n: sum(m["non_2xx"] for run in runs for m in run if m["target"] == n) for n in names},
        "socket_errors": {n: sum(m["socket_errors"] for run in runs for m in run if m["target"] == n) for n in names},
        "seconds": seconds,
        "connections": connections,
        "engines": engines,
        "router_core": router_core,
        "rounds": runs,
    }
