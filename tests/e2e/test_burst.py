"""A burst of one new prefix through two routers keeps its affinity (issue: routing that wins at the tail).

64 simultaneous requests share a new 4096-token prefix and are split over two router processes.
Before any engine event about that prefix exists, each router learns where the other sent its
requests only through the control plane's shared in-flight state (RouterSession reservations).
They must land on no more workers than the load bound requires: the number kv_aware itself picks
when one decision sees every earlier one (`burst.reference_workers`).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvroute.tools.bench.burst import BURST_REQUESTS, burst_prompts, reference_workers, send_burst
from kvroute.tools.local_cluster import LocalCluster, http_get, wait_until

WORKERS = 8


@pytest.fixture(scope="module")
def cluster(module_local_fleet):
    c = module_local_fleet("burst", block_size=16)
    # speedup 2: a 4096-token prefill takes ~130 ms, so the whole burst is in flight at once.
    c.start_sim_fleet(WORKERS, "--num-blocks", "4096", "--speedup", "2")
    c.wait_workers_registered(WORKERS)
    for name in ("a", "b"):
        url = c.start_router(name, "kv_aware")
        # Every worker in its view: a burst sent to a router still syncing would be decided on load alone.
        wait_until(
            lambda url=url: json.loads(http_get(url + "/ready")[1]).get("workers") == WORKERS,
            30,
            f"router {name} with all {WORKERS} workers",
            c.all_processes(),
        )
    return c


def test_burst_through_two_routers_lands_on_no_more_workers_than_the_bound_requires(cluster: LocalCluster) -> None:
    prompts = burst_prompts(seed=11)
    served = send_burst([cluster.router_urls["a"], cluster.router_urls["b"]], cluster.model, prompts)
    assert len(served) == BURST_REQUESTS and all(w for w in served), served
    used = Counter(served)
    required = reference_workers(WORKERS, prompts)
    assert len(used) <= required, (dict(used), required)
    assert required < WORKERS  # the bound does not simply require every worker
    # The bound spreads the work, it does not pile it: no worker took more than twice its fair share.
    assert max(used.values()) <= 2 * BURST_REQUESTS / required, dict(used)
