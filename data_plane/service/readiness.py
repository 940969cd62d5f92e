"""The router's readiness: `GET /ready` and the gRPC health status (`grpc.health.v1`) follow it.

Ready: the router knows at least one worker of a model it serves (its default model, or any its fleet
serves: `models`) (from its view of the fleet with `--index
local` once the view has synced, else the control plane's latest ListWorkers, the last non-empty one,
or `--static-workers` while the control plane was never reached; and the engines found by DNS,
`--discover-engines`) and at least one of them is healthy:
not failing its active health checks and not sitting out the proxy's cooldown after a failed attempt
(`backend_health.py`). An unreachable control plane alone does not make the router not-ready: it
fails open (routes on load over the fleet it knows), which still serves requests, so it is
"degraded". With a view, degraded also while no control plane was heard for `--view-lag-bound-s`
(the view may be behind) and past `--view-max-stale-s` (deciding on load alone). A router that has
sent nothing to an engine since a failure becomes ready again when the cooldown ends (2 s): a load
balancer that took it out of rotation then sends it traffic again, which is how it finds out
whether the engines are back; workers under active health checks come back when their checks pass.
In P/D mode (`role_of` given) it also takes a healthy worker of each role, prefill and decode.

`no_workers_reason` says why no worker is known, for /ready and for the 503 a request gets then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, KnownWorker
from kvroute.data_plane.engines.backend_health import BackendHealth
from kvroute.roles import DECODE, PREFILL
from kvroute.status import Readiness


def served_models(cp: ControlPlaneClient, default_model: str) -> list[str]:
    """Every model some known worker serves, the default one first (/v1/models, /ready)."""
    return sorted((m for m in cp.models() | {default_model} if cp.workers_for(m)), key=lambda m: (m != default_model, m))


def no_workers_reason(cp: ControlPlaneClient, model: str, lora_name: str = "") -> str:
    """Why `cp.workers_for(model, lora_name)` is empty, in one sentence that names no engine address."""
    what = f"model {model!r}"
    if lora_name and cp.workers_for(model):
        return f"no workers known for {what} with LoRA adapter {lora_name!r}: none of its workers serves it"
    given = len(cp.static_workers)
    static = (
        f"; the {given} --static-workers are used only until the control plane is first reached"
        if given
        else ", and no --static-workers were given"
    )
    error = f" ({cp.last_error})" if cp.last_error else ""
    if cp.discovery is not None:
        static += f"; --discover-engines: {cp.discovery.describe()}"
    if cp.reachable:
        return f"no workers known for {what}: the control plane {cp.address} is reachable but lists none{static}"
    if not cp.ever_reached:  # never reached with static workers given: they would be known
        return f"no workers known for {what}: control plane {cp.address} not reached yet{error}{static}"
    return (
        f"no workers known for {what}: control plane {cp.address} unreachable{error} and no worker of it was ever known{static}"
    )


def router_readiness(
    control_plane: ControlPlaneClient,
    model: str,
    health: BackendHealth,
    models: Sequence[str] = (),
    role_of: Callable[[KnownWorker], str] | None = None,
) -> Readiness:
    """`model`: the default model; `models`: every model served (default: that one alone), whose
    workers count together. `health`: the workers failing their health checks, and those the proxy
    saw fail, sitting out their cooldown. `role_of`: P/D mode, each worker's role (a healthy one of
    each is needed)."""
    cooling_down, cooldown_s, down = health.cooling_down(), health.cooldown_s, health.down()
    served = list(models) or [model]
    by_model = {m: [w.worker_id for w in control_plane.workers_for(m)] for m in served}
    workers = list(dict.fromkeys(w for ids in by_model.values() for w in ids))
    source = control_plane.fleet_source(model if by_model.get(model) else next((m for m in served if by_model[m]), model))
    failing_checks = sorted(w for w in workers if w in down)
    sitting_out = sorted(w for w in workers if w in cooling_down)
    healthy = len(workers) - len(set(failing_checks) | set(sitting_out))
    cp = control_plane
    cp_error = f" ({cp.last_error})" if cp.last_error else ""
    fatal: list[str] = []
    warnings: list[str] = []
    if not workers:
        fatal.append(no_workers_reason(cp, model))
    elif not cp.reachable:
        fleet = {"static": "static", "discovered": "DNS-discovered"}.get(source, "last known")
        warnings.append(f"control plane {cp.address} unreachable{cp_error}: routing on load over the {fleet} fleet")
    elif source == "last_known":  # e.g. a restarted control plane whose agents have not registered yet
        warnings.append(f"the control plane lists no worker of model {model!r} now: routing on the last known fleet")
    view = cp.view
    if view is not None and workers:
        silence = view.silence_s()
        if not view.synced:  # ready only on a fleet configured to route on load: static or found by DNS
            (warnings if source in ("static", "discovered") else fatal).append(
                "the view of the fleet has not synced yet: deciding on load alone"
            )
        elif silence > view.max_stale_s:
            warnings.append(f"no control plane heard for {silence:.1f}s (over --view-max-stale-s): deciding on load alone")
        elif silence > view.lag_bound_s:
            warnings.append(f"no control plane heard for {silence:.1f}s (over --view-lag-bound-s): deciding on the last view")
    if workers and not healthy:
        if failing_checks:
            why = [f"failing their health checks: {', '.join(failing_checks)}"]
            if sitting_out:
                why.append(f"failed a request within the last {cooldown_s:g}s: {', '.join(sitting_out)}")
            fatal.append(f"no worker of model {model!r} is healthy ({'; '.join(why)})")
        else:
            fatal.append(f"every worker of model {model!r} failed within the last {cooldown_s:g}s ({', '.join(sitting_out)})")
    else:
        if failing_checks:
            warnings.append(
                f"{len(failing_checks)} of {len(workers)} workers failing their health checks ({', '.join(failing_checks)})"
            )
        if sitting_out:
            warnings.append(f"{len(sitting_out)} of {len(workers)} workers sitting out after failures ({', '.join(sitting_out)})")
    pools = {}
    if role_of is not None and workers and healthy:
        unhealthy = set(failing_checks) | set(sitting_out)
        for role in (PREFILL, DECODE):
            of_role = [w.worker_id for w in control_plane.workers_for(model) if role_of(w) == role]
            pools[f"{role}_workers"] = len(of_role)
            if not of_role:
                fatal.append(
                    f"P/D: no {role} worker of model {model!r} is known (agents register it with "
                    f"`--role {role}`; engines without one: the router's --pd-role)"
                )
            elif all(w in unhealthy for w in of_role):
                fatal.append(f"P/D: no {role} worker of model {model!r} is healthy ({', '.join(of_role)})")
    refreshed = cp.fleet_updated_at
    return Readiness(
        fatal,
        warnings,
        {
            "model": model,
            "models": {m: len(ids) for m, ids in by_model.items()},
            "workers": len(workers),
            "healthy_workers": healthy,
            "failing_health_checks": failing_checks,
            "cooling_down": sitting_out,
            "fleet": source,
            "control_plane": {
                "address": cp.address,
                "reachable": cp.reachable,
                "last_refresh_s_ago": round(time.monotonic() - refreshed, 3) if refreshed else None,
                "error": cp.last_error or None,
            },
            "view": None
            if view is None
            else {
                "synced": view.synced,
                "position": view.position.seq if view.position is not None else None,
                "silence_s": round(view.silence_s(), 3) if view.last_heard else None,
                "lag_s": round(view.lag_s, 6),
            },
        }
        | ({"pd": pools} if pools else {}),
    )
