"""`FleetState`: registry, prefix index and in-flight tracker wired together, as the control plane
holds them and as every router's view replicates them.

    state = FleetState.build(index=BitmaskPrefixIndex())
    state.applier.register(worker_id, body, resume=False)   # changes go through the applier...
    state.sessions.open("replica-a", 7, "router-1")         # ...and the remote sessions' map
    columns = answer_columns(state, model, chains)          # kvroute.fleet.answer

`RemoteSessions` names router sessions that live elsewhere by (origin, number): another replica's
(the in-flight log between replicas) or, in a router's view, every session of the fleet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.fleet.apply import LogApplier
from kvroute.fleet.inflight import InflightTracker, RouterSessionState
from kvroute.fleet.registry import WorkerRegistry
from kvroute.prefix_index import BitmaskPrefixIndex, PrefixIndex


class RemoteSessions:
    """Sessions opened elsewhere, applied to a tracker under their (origin, number)."""

    def __init__(self, inflight: InflightTracker) -> None:
        self.inflight = inflight
        self._open: dict[tuple[str, int], RouterSessionState] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, origin: str, number: int, router_id: str) -> RouterSessionState:
        """A router opened a session at `origin`: its sessions anywhere else end (it moved there and
        re-sends its live reservations), and so does an older session of the same name."""
        self.drop_router(router_id)
        old = self._open.pop((origin, number), None)
        if old is not None:
            self.inflight.close_session(old)
        session = self._open[(origin, number)] = self.inflight.open_session(router_id, origin, number)
        return session

    def get(self, origin: str, number: int) -> RouterSessionState | None:
        return self._open.get((origin, number))

    def close(self, origin: str, number: int) -> bool:
        session = self._open.pop((origin, number), None)
        if session is not None:
            self.inflight.close_session(session)
        return session is not None

    def drop_router(self, router_id: str) -> int:
        gone = [key for key, s in self._open.items() if s.router.router_id == router_id]
        for key in gone:
            self.inflight.close_session(self._open.pop(key))
        return len(gone)

    def drop_origin(self, origin: str) -> int:
        gone = [key for key in self._open if key[0] == origin]
        for key in gone:
            self.inflight.close_session(self._open.pop(key))
        return len(gone)

    def origins(self) -> set[str]:
        return {origin for origin, _ in self._open}


@dataclass(slots=True, eq=False)
class FleetState:
    index: PrefixIndex
    registry: WorkerRegistry
    inflight: InflightTracker
    applier: LogApplier
    sessions: RemoteSessions

    @classmethod
    def build(
        cls,
        index: PrefixIndex | None = None,
        heartbeat_timeout_s: float = 5.0,
        speculative_ttl_s: float = 5.0,
        reservation_max_age_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> FleetState:
        index = index if index is not None else BitmaskPrefixIndex()
        inflight = InflightTracker(index, default_ttl_s=speculative_ttl_s, max_age_s=reservation_max_age_s, clock=clock)
        registry = WorkerRegistry(index, heartbeat_timeout_s=heartbeat_timeout_s, clock=clock, watcher=inflight)
        return cls(index, registry, inflight, LogApplier(registry, inflight), RemoteSessions(inflight))
