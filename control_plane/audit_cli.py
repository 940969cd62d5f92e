"""`kvroute audit`: compare, per worker, the control plane's view with what the engine caches (the
logic is `audit.py`'s; this is its arguments and printing).

Exit status: 0 no divergence, 1 divergence, 2 errors (control plane or an engine unreachable,
unknown --worker, an engine answering garbage) or nothing audited (no worker listed, or none whose
engine could be compared; --allow-empty accepts that). The last stdout line is one JSON object.
Missing blocks that a control plane with --max-index-entries dropped on purpose (its `evicted`
count for that worker and tier) are shown but are not divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvroute.addresses import connect_address
from kvroute.control_plane.audit import WorkerAudit, audit_fleet
from kvroute.tls import add_tls_arguments, client_tls, tls_files_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control-plane",
        type=connect_address,
        required=True,
        metavar="HOST:PORT",
        help="the control plane's gRPC address (one replica)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ID",
        help="audit this worker (repeatable; default: every worker ListWorkers returns)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=500.0,
        metavar="MS",
        help="compare a diverging worker again after this pause and report only divergence seen both "
        "times (events in flight cause transient divergence); 0 = one comparison",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="audit workers whose engine does not serve its block set (real vLLM, SGLang) by a probe: a "
        "random prompt sent to the engine twice, the engine's prefix-cache hit for the second send "
        "(its /metrics counters) against the hit the control plane predicts",
    )
    p.add_argument(
        "--force-probe",
        action="store_true",
        help="probe every audited worker, even one whose engine serves its block set (implies --probe)",
    )
    p.add_argument(
        "--probe-deadline-s",
        type=float,
        default=5.0,
        metavar="S",
        help="how long a probe waits for the control plane to hold the probe's blocks (the engine's "
        "events) before comparing what it holds by then",
    )
    p.add_argument("--timeout-s", type=float, default=10.0, help="per request to the control plane or an engine")
    p.add_argument("--concurrency", type=int, default=8, help="workers audited at once")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="exit 0 when there is nothing to audit (the control plane lists no worker, or no worker's "
        "engine can be compared), e.g. a fleet that is still starting; by default that is an error",
    )
    add_tls_arguments(p)


def run(args: argparse.Namespace) -> int:
    from kvroute import aio

    # gRPC's own INFO lines (one per failed handshake) would precede the one-line error that says what
    # failed and what to check; GRPC_VERBOSITY set by the caller still wins. Read when grpc loads.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return aio.run(run_audit(args))


async def run_audit(args: argparse.Namespace) -> int:
    result = await audit_fleet(
        args.control_plane,
        args.worker,
        settle_s=args.settle_ms / 1000,
        timeout_s=args.timeout_s,
        concurrency=args.concurrency,
        probe=args.probe or args.force_probe,
        force_probe=args.force_probe,
        probe_deadline_s=args.probe_deadline_s,
        tls=client_tls(tls_files_from_args(args, server=False)),
    )
    return report(result.audits, result.errors, args)


def nothing_audited(audits: list[WorkerAudit]) -> str:
    """Why an audit compared no worker ("" when it compared one)."""
    if any(a.status == "ok" for a in audits):
        return ""
    if not audits:
        return "nothing audited: the control plane lists no worker"
    if all(a.status == "not_auditable" for a in audits):
        return f"nothing audited: none of the {len(audits)} workers' engines serves its block set (--probe audits those)"
    return ""  # some failed: their errors say why


def report(audits: list[WorkerAudit], errors: list[str], args: argparse.Namespace) -> int:
    empty = "" if errors or args.allow_empty else nothing_audited(audits)
    if empty:
        errors = [*errors, f"{empty} (--allow-empty accepts that)"]
    divergence = sum(a.divergence for a in audits)
    explained = sum(len(t.missing) - t.unexplained_missing for a in audits for t in a.tiers.values())
    result = {
        "divergence": divergence,
        "missing_explained_by_eviction": explained,
        "workers": [a.to_json() for a in audits],
        "audited": sum(a.status == "ok" for a in audits),
        "probed": sum(a.status == "ok" and a.kind == "probe" for a in audits),
        "not_auditable": sum(a.status == "not_auditable" for a in audits),
        "errors": errors,
        "settle_ms": args.settle_ms,
    }
    if not args.json:
        if any(audit.tiers for audit in audits):
            print(f"{'worker':<24} {'tier':<5} {'control plane':>13} {'engine':>9} {'missing':>8} {'extra':>8} {'evicted':>8}")
        for audit in audits:
            if audit.status != "ok":
                print(f"{audit.worker_id:<24} {audit.status.replace('_', ' ')}: {audit.detail}")
            elif audit.probe is not None:
                probe = audit.probe
                print(
                    f"{audit.worker_id:<24} probe: the control plane predicts a {probe.predicted_hit_tokens}-token hit, "
                    f"the engine hit {probe.engine_hit_tokens}: {probe.missing} missing, {probe.extra} extra blocks "
                    f"(events {probe.events_s:.2f} s, probe {probe.seconds:.2f} s){'; ' if audit.detail else ''}"
                    f"{audit.detail}"
                )
            for medium, tier in sorted(audit.tiers.items()):
                print(
                    f"{audit.worker_id:<24} {medium:<5} {tier.control_plane_blocks:>13} {tier.engine_blocks:>9} "
                    f"{len(tier.missing):>8} {len(tier.extra):>8} {tier.evicted:>8}"
                )
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        print(
            f"divergence: {divergence} blocks over {result['audited']} audited workers "
            f"({result['probed']} by probe, {result['not_auditable']} not auditable, {len(errors)} errors)"
        )
        if explained:
            print(
                f"{explained} missing blocks not counted: the control plane dropped at least as many entries of "
                "those workers and tiers for its --max-index-entries since their last snapshot (column evicted)"
            )
    print(json.dumps(result))
    return 2 if errors else 1 if divergence else 0
