"""PNG plots of a simulation: TTFT CDF per policy, and hit rate per policy against the ceilings."""

from __future__ import annotations

from pathlib import Path

from kvroute.tools.simulator.fleet import PolicyRun


def write_plots(runs: dict[str, PolicyRun], oracle: float, oracle_infinite: float, out_dir: str | Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ttft_cdf.png", out / "hit_rate.png"]

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, run in runs.items():
        xs = sorted(t * 1000 for t in run.ttft_s)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", lw=0.6, ls=":")
    ax.set_title(f"TTFT CDF — {title}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    names = list(runs)
    rates = [runs[n].hit_rate * 100 for n in names]
    bars = ax.bar(names, rates, color="tab:blue")
    for bar, rate in zip(bars, rates):
        ax.annotate(f"{rate:.1f}%", (bar.get_x() + bar.get_width() / 2, rate), ha="center", va="bottom", fontsize=8)
    ax.axhline(oracle * 100, color="tab:green", ls="--", label=f"pooled-cache ceiling {oracle:.1%}")
    ax.axhline(oracle_infinite * 100, color="tab:red", ls=":", label=f"infinite cache {oracle_infinite:.1%}")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, max([oracle_infinite * 100, *rates]) * 1.15 + 1)
    ax.set_title(f"Hit rate vs ceiling — {title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)
    return paths
