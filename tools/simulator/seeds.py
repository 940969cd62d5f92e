"""Several seeds of one comparison, summarised per policy.

A p99 over 8000 requests moves by whole milliseconds when a dozen requests change side of it, and
which policy has the lowest p50 can flip between seeds when policies are within 1% of each other.
One seed cannot tell such a tie from a win; the same comparison over several seeds (each a new
workload draw, new engine randomness, new tie-breaks) can: `kvroute simulate --seeds 3,4,5,6,7`.

`summarize(per_seed)` takes {seed: {policy: result}} (result: the dict `kvroute simulate` prints per
policy) and gives, per policy, the mean, min and max of hit rate, TTFT p50 and p99, and on how many
seeds it had the lowest p50 and the lowest p99 among the router policies. References that are not
router policies (`ttft_oracle`) are summarised but never counted as the lowest.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.tools.simulator.fleet import TTFT_ORACLE

NOT_A_ROUTER_POLICY = frozenset({TTFT_ORACLE})
METRICS = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")


def summarize(per_seed: Mapping[int, Mapping[str, Mapping[str, float]]]) -> dict[str, dict]:
    if not per_seed:
        raise ValueError("no seeds to summarise")
    policies = list(next(iter(per_seed.values())))
    out: dict[str, dict] = {}
    for name in policies:
        entry: dict = {}
        for metric in METRICS:
            values = [results[name][metric] for results in per_seed.values()]
            entry[metric] = {
                "mean": round(sum(values) / len(values), 4 if metric == "hit_rate" else 2),
                "min": min(values),
                "max": max(values),
            }
        entry["lowest_p50_seeds"] = entry["lowest_p99_seeds"] = 0
        out[name] = entry
    routers = [name for name in policies if name not in NOT_A_ROUTER_POLICY]
    for results in per_seed.values():
        for metric, counter in (("ttft_p50_ms", "lowest_p50_seeds"), ("ttft_p99_ms", "lowest_p99_seeds")):
            if not routers:
                continue
            best = min(results[name][metric] for name in routers)
            for name in routers:  # a tie counts for every policy in it
                if results[name][metric] == best:
                    out[name][counter] += 1
    return out


def markdown(per_seed: Mapping[int, Mapping[str, Mapping[str, float]]], summary: Mapping[str, dict]) -> list[str]:
    """Per-seed p50 / p99 by policy, then the summary; one Markdown table each."""
    seeds = list(per_seed)
    lines = ["| policy | " + " | ".join(f"seed {s} p50 / p99 ms" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name in summary:
        cells = [f"{per_seed[s][name]['ttft_p50_ms']:.2f} / {per_seed[s][name]['ttft_p99_ms']:.2f}" for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    n = len(seeds)
    lines += [
        "",
        "| policy | hit rate | TTFT p50 ms mean [min, max] | TTFT p99 ms mean [min, max] | lowest p50 | lowest p99 |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        p50, p99 = s["ttft_p50_ms"], s["ttft_p99_ms"]
        reference = name in NOT_A_ROUTER_POLICY
        lines.append(
            f"| {name} | {s['hit_rate']['mean']:.1%} | {p50['mean']:.2f} [{p50['min']:.2f}, {p50['max']:.2f}] | "
            f"{p99['mean']:.2f} [{p99['min']:.2f}, {p99['max']:.2f}] | "
            + (
                "(reference) | (reference) |"
                if reference
                else f"{s['lowest_p50_seeds']} of {n} | {s['lowest_p99_seeds']} of {n} |"
            )
        )
    return lines
