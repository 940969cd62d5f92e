"""This router's own view of the fleet: the control plane's state, replicated through
`ControlPlane.Follow`, so that a decision reads it in this process and no query is on a request's path.

    view = FleetView(router_id, models={"llama"}, max_stale_s=60.0)
    follower = FleetFollower(view, client)              # client: ControlPlaneClient (replicas, TLS, failover)
    task = asyncio.create_task(follower.run())
    columns, why_not = view.answer("llama", {16: keys})  # why_not "" = the columns hold the answer
    known = view.workers_for("llama")

Contract:
- The view is `kvroute.fleet.FleetState`, changed only by `kvroute.fleet.changes.apply_change`: the
  control plane's own apply path, so after the change numbered N it equals the control plane's state
  after N (tests/data_plane/test_fleet_view.py compares them after every batch).
- A snapshot arrives as a run of messages; it is applied to a fresh state while decisions keep
  reading the old one, and replaces it at its last message (a failover to another replica, a
  restarted control plane, or a view that fell behind the control plane's window).
- Fresh or not: the control plane sends something at least every `FollowFeed.keepalive_s` (0.5 s);
  `silence_s()` is the time since the last message. Past `lag_bound_s` the router says degraded
  (`/ready`); past `max_stale_s` (every control plane unreachable for that long) decisions stop
  reading the index (`view_stale`: load alone, counted as fail-open) until the link is back.
  `lag_s` is how old the newest change was when it arrived (the control plane's clock against this
  process's: meaningful on one host or with synchronised clocks).
- Nothing here outlives the process: a router starts with a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kvroute.backoff import Backoff
from kvroute.fleet.answer import IndexColumns, answer_columns
from kvroute.fleet.changes import MalformedChange, apply_change
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import PrefixIndex, Tier, make_index
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.tls import rpc_failure_reason
from kvroute.v1 import kvroute_pb2 as pb

if TYPE_CHECKING:
    from kvroute.data_plane.cp_link.control_plane_client import ControlPlaneClient, KnownWorker

log = logging.getLogger("kvroute.router.view")

# How long a long message is applied before other work runs (FleetFollower): what a decision waits
# at most behind a view catching up or building a new snapshot (plus one change: a snapshot chunk
# of kvroute.fleet.changes.SNAPSHOT_CHUNK_KEYS keys, a few ms).
APPLY_SLICE_S = 0.002

VIEW_NOT_SYNCED = "the view of the fleet has not synced yet"
VIEW_STALE = "the view of the fleet is stale (no control plane heard from)"


@dataclass(slots=True)
class ViewCounters:
    messages: int = 0  # FollowUpdates applied (keepalives included)
    changes: int = 0  # changes applied
    snapshots: int = 0  # snapshots completed
    resumed: int = 0  # streams that resumed from the view's position without a snapshot
    malformed: int = 0  # changes refused (the view resynchronises)
    streams: int = 0  # Follow streams opened
    stream_failures: int = 0


class FleetView:
    def __init__(
        self,
        router_id: str,
        models: Collection[str] = (),
        max_stale_s: float = 120.0,
        lag_bound_s: float = 2.0,
        index_factory: Callable[[], PrefixIndex] = make_index,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = router_id
        self.knows_own = False  # the router's own session's changes are left out of the stream (set by its client)
        self.models = frozenset(models)
        self.max_stale_s, self.lag_bound_s = max_stale_s, lag_bound_s
        self.index_factory = index_factory
        self.clock = clock
        self.state: FleetState | None = None  # None until the first snapshot completed
        self._pending: FleetState | None = None  # a snapshot being applied
        self.position: pb.FollowPosition | None = None
        self.last_heard = 0.0  # clock() of the last message (0 = never)
        self.lag_s = 0.0
        self.counters = ViewCounters()
        self._known: dict[tuple[str, str], tuple[int, list[KnownWorker]]] = {}
        # The last non-empty fleet per (model, adapter): a restarted control plane lists no worker until
        # the agents are back, and requests still go somewhere meanwhile (on load alone).
        self._last_known: dict[tuple[str, str], list[KnownWorker]] = {}
        self._served: tuple[object, frozenset[str]] = (None, frozenset())  # (roster version, models_served())

    # ------------------------------------------------------------ reading it

    @property
    def synced(self) -> bool:
        return self.state is not None

    def silence_s(self) -> float:
        """Seconds since the control plane was last heard from (inf: never)."""
        return self.clock() - self.last_heard if self.last_heard else float("inf")

    def unusable_reason(self) -> str:
        """Why a decision must not read the view now ("" = it may)."""
        if self.state is None:
            return VIEW_NOT_SYNCED
        if self.silence_s() > self.max_stale_s:
            return VIEW_STALE
        return ""

    def answer(self, model: str, chains: Mapping[int, Sequence[int]], lora_name: str = "") -> tuple[IndexColumns | None, str]:
        """The index's answer from the view, or None and why the index cannot be used."""
        why = self.unusable_reason()
        if why:
            return None, why
        state = self.state
        assert state is not None
        columns = answer_columns(state, model, chains, lora_name, state.inflight.routers.get(self.router_id))
        if not columns.worker_id:
            return None, "index has no workers for the model"
        return columns, ""

    def workers_for(self, model: str, lora_name: str = "") -> list[KnownWorker]:
        """The view's workers of `model` (serving `lora_name`), as the router's fleet; when the view
        lists none now, the last ones it listed (`fleet_source`); [] before a snapshot."""
        return self._fleet(model, lora_name)[1]

    def fleet_source(self, model: str, lora_name: str = "") -> str:
        """ "view", "last_known" (the view lists no worker of the model now) or "none"."""
        return self._fleet(model, lora_name)[0]

    def _fleet(self, model: str, lora_name: str) -> tuple[str, list[KnownWorker]]:
        from kvroute.data_plane.cp_link.control_plane_client import KnownWorker

        state = self.state
        if state is None:
            return "none", []
        registry = state.registry
        key = (model, lora_name)
        cached = self._known.get(key)
        if cached is None or cached[0] != registry.roster_version:
            count = state.index.worker_block_count
            known = [
                KnownWorker(
                    r.worker_id,
                    r.model,
                    r.endpoint.rstrip("/"),
                    r.block_size,
                    r.load,  # type: ignore[arg-type]
                    count(r.slot, Tier.GPU),
                    frozenset(r.lora_adapters),
                    r.data_parallel_rank,
                    r.role,
                )
                for r in registry.workers(model, lora_name)
            ]
            cached = self._known[key] = (registry.roster_version, known)
            if known:
                self._last_known[key] = known
        if cached[1]:
            return "view", cached[1]
        last = self._last_known.get(key)
        return ("last_known", last) if last else ("none", [])

    def models_served(self) -> frozenset[str]:
        """Models the view lists a worker of, or listed one of before (rebuilt when the roster changes)."""
        state = self.state
        if state is None:
            return frozenset(model for model, _ in self._last_known)
        version = (id(state), state.registry.roster_version, len(self._last_known))
        if self._served[0] != version:
            listed = {r.model for r in state.registry.workers()}
            self._served = (version, frozenset(listed | {model for model, _ in self._last_known}))
        return self._served[1]

    # ------------------------------------------------------------ applying the stream

    def apply_update(self, update: pb.FollowUpdate) -> None:
        """One message of the stream. MalformedChange: the view must resynchronise (a new stream
        without a position); what was applied before the bad change stays until the new snapshot."""
        for _ in self.applying(update):
            pass

    def applying(self, update: pb.FollowUpdate, slice_s: float | None = None) -> Iterator[int]:
        """`apply_update` in slices of about `slice_s` seconds (default APPLY_SLICE_S), yielding (changes
        applied so far) between them, so that a caller can let decisions run in between: a message holds
        up to `FollowFeed.max_update_bytes` of changes (a snapshot, or a follower that fell behind).
        Between slices the view is the control plane's state after one of the message's changes (a
        snapshot is built apart and read only once whole); the position, freshness and counters move
        when the last slice has applied."""
        budget = APPLY_SLICE_S if slice_s is None else slice_s
        if update.snapshot_begin:
            self._pending = FleetState.build(self.index_factory())
        target = self._pending if self._pending is not None else self.state
        if target is None:
            raise MalformedChange("changes before any snapshot")
        changes = update.changes
        newest = 0
        total = len(changes)
        clock = time.perf_counter
        slice_ends = clock() + budget
        for done, change in enumerate(changes, 1):
            apply_change(target, change)
            newest = change.applied_unix_us
            if done < total and clock() >= slice_ends:
                yield done
                slice_ends = clock() + budget
        now = self.clock()
        if update.snapshot_end:
            self.state, self._pending = self._pending, None
            self._known.clear()
            self.counters.snapshots += 1
        self.position = update.position
        self.last_heard = now
        if newest and not update.snapshot_begin:
            self.lag_s = max(0.0, time.time() - newest / 1e6)
        counters = self.counters
        counters.messages += 1
        counters.changes += len(changes)

    def resume_point(self) -> pb.FollowPosition | None:
        """Where a new stream should resume from (None: ask for a snapshot)."""
        return self.position if self.state is not None and self._pending is None else None

    def forget_position(self) -> None:
        """The next stream starts with a snapshot (after a malformed change)."""
        self.position = None
        self._pending = None


class FleetFollower:
    """Keeps `view` following the control plane through `client`'s channels: reconnects with backoff,
    moves to the next replica when one fails, resumes from the view's position."""

    def __init__(
        self, view: FleetView, client: ControlPlaneClient, initial_backoff_s: float = 0.05, max_backoff_s: float = 0.5
    ) -> None:
        """A dead control plane is retried every `max_backoff_s` at most: an attempt is one refused TCP
        connect, and a router should follow a returning control plane within a second."""
        self.view = view
        self.client = client
        self._backoff = Backoff(initial_backoff_s, max_backoff_s, jitter=0.2)
        self._problems = RateLimitedLog(log, period_s=30.0)

    async def run(self) -> None:
        view, client = self.view, self.client
        while True:
            address = client.address
            # Its own sessions are known here exactly: their echo is left out (`leave_out_own`).
            request = pb.FollowRequest(router_id=view.router_id, models=sorted(view.models), leave_out_own=view.knows_own)
            resume = view.resume_point()
            if resume is not None:
                request.resume_after.CopyFrom(resume)
            try:
                call = client.stub_for(address).Follow(request)
                view.counters.streams += 1
                first = True
                async for update in call:
                    if first:
                        first = False
                        if resume is not None and not update.snapshot_begin:
                            view.counters.resumed += 1
                    for _ in view.applying(update):
                        await asyncio.sleep(0)  # decisions run between slices of a long message
                    client.heard_from_control_plane()
                    self._backoff.reset()
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the follow stream ended")
            except asyncio.CancelledError:
                raise
            except MalformedChange as exc:
                view.counters.malformed += 1
                view.forget_position()
                self._problems.warning(
                    "malformed", "refused a change from control plane %s (%s): resynchronising with a snapshot", address, exc
                )
            except grpc.aio.AioRpcError as exc:
                view.counters.stream_failures += 1
                reason = rpc_failure_reason(exc, client.tls)
                client.lost_control_plane(address, reason)
                self._problems.warning(
                    "lost",
                    "control plane %s unreachable (%s): the follow stream is down, "
                    "deciding on the last view of the fleet meanwhile",
                    address,
                    reason,
                )
            await self._backoff.sleep()
