"""The router's readiness: `GET /ready` and the gRPC health status (`grpc.health.v1`) follow it.

Ready: the router knows at least one worker for its model (from its view of the fleet with `--index
local` once the view has synced, else the control plane's latest ListWorkers, the last non-empty one,
or `--static-workers` while the control plane was never reached) and at least one of them is healthy, i.e. not sitting out the proxy's cooldown after a
failed attempt. An unreachable control plane alone does not make the router not-ready: it fails
open (routes on load over the fleet it knows), which still serves requests, so it is "degraded".
With a view, degraded also while no control plane was heard for `--view-lag-bound-s` (the view
may be behind) and past `--view-max-stale-s` (deciding on load alone). A router that has sent
nothing to an engine since a failure becomes ready again when the cooldown ends (2 s): a load balancer that took it out of rotation then sends it traffic again,
which is how it finds out whether the engines are back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvroute.data_plane.backend_health import BackendHealth
from kvroute.data_plane.control_plane_client import ControlPlaneClient


@dataclass(frozen=True, slots=True)
class RouterReadiness:
    ready: bool
    status: str                   # "ready", "degraded" (ready, with problems) or "not_ready"
    problems: list[str] = field(default_factory=list)
    body: dict = field(default_factory=dict)  # the JSON of GET /ready


def router_readiness(control_plane: ControlPlaneClient, model: str, health: BackendHealth) -> RouterReadiness:
    """`health`: the workers the proxy saw fail, sitting out their cooldown."""
    cooling_down, cooldown_s = health.cooling_down(), health.cooldown_s
    workers = [w.worker_id for w in control_plane.workers_for(model)]
    source = control_plane.fleet_source(model)
    sitting_out = sorted(w for w in workers if w in cooling_down)
    healthy = len(workers) - len(sitting_out)
    cp = control_plane
    cp_error = f" ({cp.last_error})" if cp.last_error else ""
    fatal: list[str] = []
    warnings: list[str] = []
    if not workers:
        if cp.reachable:
            fatal.append(f"the control plane knows no worker serving model {model!r}")
        elif not cp.ever_reached:
            fatal.append(f"control plane {cp.address} not reached yet{cp_error} and no --static-workers")
        else:
            fatal.append(f"control plane {cp.address} unreachable{cp_error} and no worker of model {model!r} "
                         "was ever known")
    elif not cp.reachable:
        warnings.append(f"control plane {cp.address} unreachable{cp_error}: routing on load over the "
                        f"{'static' if source == 'static' else 'last known'} fleet")
    elif source == "last_known":  # e.g. a restarted control plane whose agents have not registered yet
        warnings.append(f"the control plane lists no worker of model {model!r} now: routing on the last known fleet")
    view = cp.view
    if view is not None and workers:
        silence = view.silence_s()
        if not view.synced:  # ready only on the static fallback fleet, which is configured to route on load
            (warnings if source == "static" else fatal).append(
                "the view of the fleet has not synced yet: deciding on load alone")
        elif silence > view.max_stale_s:
            warnings.append(f"no control plane heard for {silence:.1f}s (over --view-max-stale-s): deciding on load "
                            "alone")
        elif silence > view.lag_bound_s:
            warnings.append(f"no control plane heard for {silence:.1f}s (over --view-lag-bound-s): deciding on the "
                            "last view")
    if workers and not healthy:
        fatal.append(f"every worker of model {model!r} failed within the last {cooldown_s:g}s "
                     f"({', '.join(sitting_out)})")
    elif sitting_out:
        warnings.append(f"{len(sitting_out)} of {len(workers)} workers sitting out after failures "
                        f"({', '.join(sitting_out)})")
    ready = not fatal
    status = "not_ready" if fatal else "degraded" if warnings else "ready"
    problems = fatal + warnings
    refreshed = cp.fleet_updated_at
    return RouterReadiness(ready, status, problems, {
        "status": status, "model": model, "workers": len(workers), "healthy_workers": healthy,
        "cooling_down": sitting_out, "fleet": source,
        "control_plane": {"address": cp.address, "reachable": cp.reachable,
                          "last_refresh_s_ago": round(time.monotonic() - refreshed, 3) if refreshed else None,
                          "error": cp.last_error or None},
        "view": None if view is None else {
            "synced": view.synced, "position": view.position.seq if view.position is not None else None,
            "silence_s": round(view.silence_s(), 3) if view.last_heard else None, "lag_s": round(view.lag_s, 6)},
        "problems": problems})
