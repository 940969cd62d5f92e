"""`kvroute control-plane`."""

from __future__ import annotations

import argparse
import sys

from kvroute.addresses import listen_address, listen_host, port_or_off, redis_url
from kvroute.listeners import run_service
from kvroute.prefix_index.backends import BACKENDS, IndexBackendError, resolve_backend
from kvroute.process import add_log_level_argument, add_port_file_argument, non_negative, positive, process_setup
from kvroute.tls import TlsConfigError, add_grpc_message_argument, add_tls_arguments, tls_files_from_args

# Snapshots of large caches exceed gRPC's 4 MB default (a million keys is ~9 MB).
DEFAULT_GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="gRPC address agents and routers connect to",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="drop a worker (and its blocks) after this long without a message from its agent",
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        help="serve Prometheus /metrics, /health and /ready on this port (0 = any free port; default off)",
    )
    p.add_argument("--metrics-host", type=listen_host, default="127.0.0.1", help="address of the /metrics listener")
    p.add_argument(
        "--speculative-ttl-ms",
        type=positive(int),
        default=5000,
        metavar="MS",
        help="how long a RouterSession reservation's blocks count as cached on its worker when the "
        "router sends ttl_ms 0 (until the worker's own events confirm them)",
    )
    p.add_argument(
        "--reservation-max-age-s",
        type=positive(float),
        default=600.0,
        metavar="SECONDS",
        help="drop a RouterSession reservation never released after this long",
    )
    p.add_argument(
        "--max-index-entries",
        type=non_negative(int),
        default=0,
        metavar="N",
        help="hold at most N (block key, worker, tier) entries in the prefix index: past it, keys no query "
        "matched recently are dropped (routers then under-estimate those workers' caches, never "
        "over-estimate). An entry costs ~40-45 bytes with the native index, ~150 with the bitmask one "
        "(kvroute_cp_index_bytes_per_entry), so N = memory budget / that; 0 = unbounded",
    )
    p.add_argument(
        "--index-backend",
        choices=BACKENDS,
        default="auto",
        help="the prefix index's implementation: native (C, built by pip install: ~40 bytes per entry, "
        "millions of block events/s), bitmask (pure Python, ~150 bytes per entry) or auto (native "
        "when its extension is built, else bitmask). Both answer every query the same way",
    )
    p.add_argument(
        "--audit-interval-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="every this many seconds compare each worker's keys with its engine's GET /kvroute/blocks "
        "(engines without it are skipped) and export kvroute_cp_audit_* gauges; 0 = off",
    )
    p.add_argument(
        "--audit-settle-ms",
        type=float,
        default=500.0,
        metavar="MS",
        help="a diverging worker is compared again after this pause; only divergence seen both times "
        "is exported (events in flight)",
    )
    p.add_argument(
        "--audit-probe",
        action="store_true",
        help="with --audit-interval-s: audit workers whose engine does not serve its block set (real vLLM, "
        "SGLang) by a probe prompt each interval (kvroute audit --probe), exported with kind=probe",
    )
    p.add_argument(
        "--audit-probe-deadline-s",
        type=positive(float),
        default=5.0,
        metavar="SECONDS",
        help="how long a probe waits for the engine's events to reach the index",
    )
    p.add_argument(
        "--redis",
        default="",
        metavar="URL",
        type=redis_url,
        help="run as one of several active replicas sharing this Redis (event log, snapshots, epochs, "
        "in-flight state): redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS), "
        "redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB], "
        "redis+cluster://HOST[:PORT][,HOST[:PORT]...]; empty = one in-memory process (no Redis)",
    )
    p.add_argument(
        "--redis-shards",
        type=positive(int),
        default=16,
        metavar="N",
        help="with --redis: streams the event log is split over (every replica must use the same N)",
    )
    p.add_argument(
        "--snapshot-interval-s",
        type=positive(float),
        default=10.0,
        metavar="SECONDS",
        help="with --redis: how often the replica holding the snapshot lease writes snapshots and trims the log behind them",
    )
    p.add_argument(
        "--replica-id",
        default="",
        metavar="NAME",
        help="with --redis: this replica's name in logs, errors and the snapshot lease (default HOST-PID)",
    )
    p.add_argument(
        "--follow-window-changes",
        type=positive(int),
        default=200_000,
        metavar="N",
        help="changes the follow feed keeps for routers that reconnect (ControlPlane.Follow): a router "
        "whose position is older gets a snapshot instead",
    )
    p.add_argument(
        "--follow-window-mb",
        type=positive(int),
        default=256,
        metavar="MB",
        help="the follow feed's window in memory at most (the oldest changes go first)",
    )
    add_tls_arguments(p)
    add_grpc_message_argument(p, DEFAULT_GRPC_MAX_MESSAGE_BYTES)
    add_log_level_argument(p)
    add_port_file_argument(p)


def run(args: argparse.Namespace) -> int:
    from kvroute.control_plane.server import ControlPlaneConfig, serve

    try:
        tls = tls_files_from_args(args, server=True)
        resolve_backend(args.index_backend)
    except (TlsConfigError, IndexBackendError) as exc:
        print(f"kvroute control-plane: error: {exc}", file=sys.stderr)
        return 2
    with process_setup("kvroute-control-plane", args.log_level):
        return run_service(
            "control-plane",
            serve(
                ControlPlaneConfig(
                    listen=args.listen,
                    heartbeat_timeout_s=args.heartbeat_timeout,
                    metrics_host=args.metrics_host,
                    metrics_port=args.metrics_port,
                    speculative_ttl_s=args.speculative_ttl_ms / 1000,
                    reservation_max_age_s=args.reservation_max_age_s,
                    audit_interval_s=args.audit_interval_s,
                    audit_settle_s=args.audit_settle_ms / 1000,
                    audit_probe=args.audit_probe,
                    audit_probe_deadline_s=args.audit_probe_deadline_s,
                    redis_url=args.redis,
                    redis_shards=args.redis_shards,
                    snapshot_interval_s=args.snapshot_interval_s,
                    replica_id=args.replica_id,
                    max_index_entries=args.max_index_entries,
                    index_backend=args.index_backend,
                    tls=tls,
                    grpc_max_message_bytes=args.grpc_max_message_bytes,
                    follow_window_changes=args.follow_window_changes,
                    follow_window_bytes=args.follow_window_mb * 1024 * 1024,
                ),
                args.port_file,
            ),
        )
