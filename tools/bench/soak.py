"""`kvroute bench soak --minutes N`: the whole fleet under a mixed workload with churn, for a while.

One control plane, 4 sim engines with agents, 2 routers; readiness-gated clients (as in `bench
kill`) send ~`rate` chat requests per second of a few shared system prompts. Every `churn_s` one
disturbance, in turn: engine-0 restarted, engine-1's prefix cache reset, engine-2's agent
restarted, engine-3 restarted with its LoRA adapters changed. Every `sample_s` the RSS and open file
descriptors of every process and the control plane's index size are sampled.

What should stay flat is checked on the processes that run the whole time (the control plane, the
routers, the agents of engines 0, 1 and 3, engines 1 and 2): from the first sample after `warmup_s`
to the last, RSS may grow by at most `max(rss_growth_pct % of it, rss_slack_mb)` and open fds by at
most `fd_slack`. The rest are restarted by the churn, so their figures start over.

The routers' tokenizer segment cache is a bounded LRU that keeps every new user turn, so it grows
until full: with the default budget (4M tokens, ~16 MB) 20 req/s fill it in about two hours, and a
30-minute run would read the fill as growth. The soak runs the routers with a `router_cache_tokens`
budget that is full before the warm-up ends, and samples the cache's own gauge
(kvroute_router_tokenizer_cache_bytes) next to RSS so that what remains is what is not bounded.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.prom_text import sample_sums
from kvroute.tools.bench.kill import RetryingLoad
from kvroute.tools.local_cluster import LocalCluster, ManagedProcess, free_port, http_get, http_ok, http_post_json, wait_until
from kvroute.tools.procfs import open_fds, rss_bytes

RSS_GROWTH_PCT = 5.0  # the bound issue 17 asks for (+-5% from minute 5); docs/benchmarks/2026-12-04-soak-and-kill.md
RSS_SLACK_MB = 4.0  # below this, growth is allocator noise on a short run
FD_SLACK = 4


@dataclass
class Sample:
    at_s: float
    rss_mb: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    index_entries: float = 0.0
    tokenizer_cache_mb: dict[str, float] = field(default_factory=dict)


def _proc_stats(process: ManagedProcess) -> tuple[float, int] | None:
    if process.popen is None or process.popen.poll() is not None:
        return None
    pid = process.popen.pid
    try:
        rss = rss_bytes(pid)
        return (rss / (1024 * 1024), open_fds(pid)) if rss else None
    except OSError:
        return None


class Churn:
    """One disturbance every `every_s`, in turn (module docstring), in a thread of its own."""

    def __init__(self, cluster: LocalCluster, every_s: float) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.done: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._adapters_on = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        engines = self.cluster.engines
        actions = [
            ("engine-0 restarted", lambda: self._restart(engines[0].engine)),
            ("engine-1 prefix cache reset", lambda: http_post_json(engines[1].url + "/reset_prefix_cache")),
            ("engine-2's agent restarted", lambda: self._restart(engines[2].agent)),
            ("engine-3 restarted with other adapters", lambda: self._change_adapters(engines[3].engine)),
        ]
        i = 0
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            name, action = actions[i % len(actions)]
            action()
            self.done.append((round(time.monotonic() - started, 1), name))
            i += 1

    @staticmethod
    def _restart(process: ManagedProcess | None) -> None:
        assert process is not None
        process.stop()
        process.start()

    def _change_adapters(self, engine: ManagedProcess) -> None:
        engine.stop()
        argv = [a for a in engine.argv if a != "--lora-adapters" and not a.startswith("soak-adapter")]
        self._adapters_on = not self._adapters_on
        engine.argv = argv + (["--lora-adapters", "soak-adapter-a,soak-adapter-b"] if self._adapters_on else [])
        engine.start()


def run_soak(
    minutes: float,
    sample_s: float = 60.0,
    churn_s: float = 20.0,
    rate: float = 20.0,
    warmup_s: float = 300.0,
    workdir: Path | None = None,
    plots: Path | None = None,
    router_cache_tokens: int = 16384,
) -> dict:
    from kvroute.tools.tiny_model import build_model_dir

    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=build_model_dir(workdir / "tiny-llama"))
    samples: list[Sample] = []
    try:
        cp_metrics = f"http://127.0.0.1:{free_port()}"
        cluster.start_control_plane(extra_args=("--metrics-port", cp_metrics.rsplit(":", 1)[1]))
        engines = cluster.start_sim_fleet(4, "--speedup", "20", "--num-blocks", "1024")
        urls = [cluster.start_router(f"r{i}", "kv_aware", "--tokenizer-cache-tokens", str(router_cache_tokens)) for i in range(2)]
        for url in urls:
            wait_until(lambda u=url: http_ok(u + "/ready"), 30, "router ready")
        steady = {
            "control-plane": cluster.control_plane,
            "router-r0": cluster.routers["r0"],
            "router-r1": cluster.routers["r1"],
            "agent-engine-0": engines[0].agent,
            "agent-engine-1": engines[1].agent,
            "agent-engine-3": engines[3].agent,
            "engine-1": engines[1].engine,
            "engine-2": engines[2].engine,
        }
        churned = {"engine-0": engines[0].engine, "agent-engine-2": engines[2].agent, "engine-3": engines[3].engine}
        load, churn = RetryingLoad(cluster, urls, rate), Churn(cluster, churn_s)
        load.start()
        churn.start()
        started = time.monotonic()
        end = started + minutes * 60
        while True:
            sample = Sample(round(time.monotonic() - started, 1))
            for name, process in {**steady, **churned}.items():
                stats = _proc_stats(process) if process is not None else None
                if stats is not None:
                    sample.rss_mb[name], sample.fds[name] = round(stats[0], 1), stats[1]
            try:
                status, body = http_get(cp_metrics + "/metrics")
                if status == 200:
                    sample.index_entries = sample_sums(body.decode(), {"kvroute_cp_index_entries"}).get(
                        "kvroute_cp_index_entries", 0.0
                    )
            except OSError:
                pass
            for i, url in enumerate(urls):
                try:
                    status, body = http_get(url + "/metrics")
                    if status == 200:
                        cache = sample_sums(body.decode(), {"kvroute_router_tokenizer_cache_bytes"})
                        sample.tokenizer_cache_mb[f"router-r{i}"] = round(
                            cache.get("kvroute_router_tokenizer_cache_bytes", 0.0) / 2**20, 2
                        )
                except OSError:
                    pass
            samples.append(sample)
            if time.monotonic() >= end:
                break
            time.sleep(max(0.0, min(sample_s, end - time.monotonic())))
        churn.stop()
        sent = load.stop()
    finally:
        cluster.stop()
    return _report(samples, list(steady), sent, churn.done, warmup_s, plots)


def _report(samples: list[Sample], steady: list[str], sent, churned: list, warmup_s: float, plots: Path | None) -> dict:
    after = [s for s in samples if s.at_s >= warmup_s] or samples[-1:]
    first, last = after[0], samples[-1]
    growth, violations = {}, []
    for name in steady:
        if name not in first.rss_mb or name not in last.rss_mb:
            violations.append(f"{name}: not running at both ends")
            continue
        rss0, rss1 = first.rss_mb[name], last.rss_mb[name]
        fd0, fd1 = first.fds[name], last.fds[name]
        pct = 100.0 * (rss1 - rss0) / rss0
        growth[name] = {
            "rss_mb_from": rss0,
            "rss_mb_to": rss1,
            "rss_pct": round(pct, 2),
            "fds_from": fd0,
            "fds_to": fd1,
            "tokenizer_cache_mb": [first.tokenizer_cache_mb.get(name), last.tokenizer_cache_mb.get(name)],
        }
        if rss1 - rss0 > max(RSS_GROWTH_PCT / 100 * rss0, RSS_SLACK_MB):
            violations.append(f"{name}: RSS {rss0} -> {rss1} MB ({pct:+.1f}%)")
        if fd1 - fd0 > FD_SLACK:
            violations.append(f"{name}: open fds {fd0} -> {fd1}")
    if plots is not None:
        _plot(samples, plots)
    ok = sum(1 for s in sent if s.status == 200)
    return {
        "minutes": round(samples[-1].at_s / 60, 2),
        "samples": len(samples),
        "warmup_s": warmup_s,
        "requests": len(sent),
        "requests_ok": ok,
        "churn_events": len(churned),
        "index_entries_first_last": [first.index_entries, last.index_entries],
        "bound": {"rss_growth_pct": RSS_GROWTH_PCT, "rss_slack_mb": RSS_SLACK_MB, "fd_slack": FD_SLACK},
        "growth": growth,
        "violations": violations,
        "table": [
            {
                "at_s": s.at_s,
                "rss_mb": s.rss_mb,
                "fds": s.fds,
                "index_entries": s.index_entries,
                "tokenizer_cache_mb": s.tokenizer_cache_mb,
            }
            for s in samples
        ],
    }


def _plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({n for s in samples for n in s.rss_mb})
    fig, (ax_rss, ax_fd) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for name in names:
        xs = [s.at_s / 60 for s in samples if name in s.rss_mb]
        ax_rss.plot(xs, [s.rss_mb[name] for s in samples if name in s.rss_mb], label=name)
        ax_fd.plot(xs, [s.fds[name] for s in samples if name in s.fds], label=name)
    ax_rss.set_ylabel("RSS (MB)")
    ax_fd.set_ylabel("open fds")
    ax_fd.set_xlabel("minutes")
    ax_rss.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)


def format_table(result: dict) -> str:
    lines = [
        (
            f"soak: {result['minutes']} min, {result['requests']} requests ({result['requests_ok']} ok), "
            f"{result['churn_events']} churn events; index entries {result['index_entries_first_last']}"
        ),
        ("| process (runs throughout) | RSS MB after warm-up | RSS MB at the end | change | fds | tokenizer cache MB |"),
        "|---|---|---|---|---|---|",
    ]
    for name, g in result["growth"].items():
        cache = g["tokenizer_cache_mb"]
        lines.append(
            f"| {name} | {g['rss_mb_from']} | {g['rss_mb_to']} | {g['rss_pct']:+.1f}% | "
            f"{g['fds_from']} -> {g['fds_to']} | {'' if cache[0] is None else f'{cache[0]} -> {cache[1]}'} |"
        )
    lines.append("violations: " + ("; ".join(result["violations"]) or "none"))
    return "\n".join(lines)
