"""Which engines failed just now: built once at start-up, written by the proxy, read by decisions.

    health = BackendHealth(cooldown_s=2.0)
    health.failed(worker_id)        # BackendProxy: an attempt failed before its first byte
    health.cooling_down()           # Router (candidates) and readiness: workers to leave out

A worker that failed sits out `cooldown_s`, so one dead engine does not cost every request a
connect attempt; decisions still use it when no other worker is known (`build_candidates`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BackendHealth:
    def __init__(self, cooldown_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failed_at: dict[str, float] = {}  # worker_id -> time of its last failure

    def failed(self, worker_id: str) -> bool:
        """Start (or restart) the worker's sit-out; True if it was not sitting out already."""
        now = self._clock()
        last = self._failed_at.get(worker_id)
        self._failed_at[worker_id] = now
        return last is None or now - last > self.cooldown_s

    def cooling_down(self) -> frozenset[str]:
        """Workers that failed within the last `cooldown_s`."""
        if not self._failed_at:
            return frozenset()
        now = self._clock()
        for wid in [w for w, t in self._failed_at.items() if now - t > self.cooldown_s]:
            del self._failed_at[wid]
        return frozenset(self._failed_at)
