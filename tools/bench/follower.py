"""A router's view of the fleet as a process of its own, for benches: a `FleetView` following a
control plane through a `ControlPlaneClient`, stamping when each change became visible in it.

    python -m kvroute.tools.bench.follower --control-plane 127.0.0.1:50051 --ready-file R --report-file P \\
        [--index-backend auto]

Contract:
- Once the first snapshot is applied, `--ready-file` gets {"entries", "stream_to_synced_s" (from the
  Follow call to the snapshot applied), "sync_cpu_s" (this process's CPU time meanwhile), "snapshot_s" (first snapshot message to the last applied),
  "process_to_synced_s" (from this process's start, imports included), "rss_before_bytes",
  "rss_synced_bytes"}.
- After that, every message applied outside a snapshot is stamped (wall-clock ns, after it applied)
  per change: agent batches as "worker/seq", reservations as "router_id/reservation_id".
- On SIGTERM/SIGINT `--report-file` gets {"batches": {...}, "reserved": {...}, "changes", "messages",
  "snapshots", "lag_s"} and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from functools import partial

from kvroute import aio
from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient
from kvroute.data_plane.cp_link.fleet_view import FleetView
from kvroute.prefix_index.backends import BACKENDS, make_index
from kvroute.process import on_stop_signal, write_port_file
from kvroute.tools.procfs import rss_bytes
from kvroute.v1 import kvroute_pb2 as pb

STARTED = time.monotonic()


class StampingView(FleetView):
    """A FleetView that notes when each agent batch and reservation became visible in it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.snapshot_started = 0.0
        self.snapshot_done = 0.0

    def applying(self, update: pb.FollowUpdate, slice_s: float | None = None) -> Iterator[int]:
        if update.snapshot_begin and not self.snapshot_started:
            self.snapshot_started = time.monotonic()
        in_snapshot = self._pending is not None or update.snapshot_begin
        yield from super().applying(update, slice_s)
        if update.snapshot_end and not self.snapshot_done:
            self.snapshot_done = time.monotonic()
        if in_snapshot or not update.changes:
            return
        now = time.time_ns()
        for change in update.changes:
            kind = change.WhichOneof("change")
            if kind == "blocks":
                self.batches[f"{change.blocks.worker_id}/{change.blocks.seq}"] = now
            elif kind == "router" and change.router.kind == pb.ROUTER_RESERVED:
                self.reserved[f"{change.router.router_id}/{change.router.reservation_id}"] = now


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    on_stop_signal(stop.set)
    view = StampingView(args.router_id, index_factory=partial(make_index, args.index_backend))
    client = ControlPlaneClient(args.control_plane, use_session=False, view=view, max_message_bytes=256 * 1024 * 1024)
    rss_before = rss_bytes()
    opened, cpu_opened = time.monotonic(), time.process_time()
    client.start()
    try:
        while not view.synced and not stop.is_set():
            await asyncio.sleep(0.001)
        if view.synced:
            synced = time.monotonic()
            write_port_file(
                args.ready_file,
                {
                    "entries": view.state.index.entry_count() if view.state is not None else 0,
                    "stream_to_synced_s": round(synced - opened, 4),
                    "sync_cpu_s": round(time.process_time() - cpu_opened, 4),
                    "snapshot_s": round(view.snapshot_done - view.snapshot_started, 4),
                    "process_to_synced_s": round(synced - STARTED, 4),
                    "rss_before_bytes": rss_before,
                    "rss_synced_bytes": rss_bytes(),
                },
            )
        await stop.wait()
    finally:
        await client.close()
    counters = view.counters
    write_port_file(
        args.report_file,
        {
            "batches": view.batches,
            "reserved": view.reserved,
            "changes": counters.changes,
            "messages": counters.messages,
            "snapshots": counters.snapshots,
            "lag_s": view.lag_s,
        },
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--control-plane", required=True)
    p.add_argument("--router-id", default="bench-follower")
    p.add_argument("--index-backend", default="auto", choices=BACKENDS)
    p.add_argument("--ready-file", default="")
    p.add_argument("--report-file", default="")
    return aio.run(run(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
