"""Reservations of the gRPC application path: decisions that applications carry out themselves.

    rid, ttl_s = reservations.reserve(decision)   # Route with `reserve`: the decision is in flight
    reservations.prefill_done(rid)                # PrefillDone: its first token arrived
    reservations.release(rid, outcome)            # Release: it finished, failed or was abandoned

An application that calls `Router/Route` and then sends the request to the engine itself would
otherwise be invisible to load tracking: the decision is made, nothing counts it. A reservation
enters it into this router's `RouterInflight` exactly as a proxied request is entered (pending
prefill, speculative holder of the prompt's blocks, announced on the router session so that other
routers' decisions count it too), and leaves it on Release or when its TTL passes (an application
that crashed or forgot must not pin load forever).

Ids are this router's: sequential from a random 63-bit start, so an id this router never issued
is told apart from one that was released or expired (NOT_FOUND vs `was_held` false).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from kvroute.data_plane.cp_link.inflight import InflightTicket, RouterInflight
from kvroute.data_plane.ops.metrics import RouterMetrics
from kvroute.data_plane.service.routing import RouteDecision


class TooManyReservations(RuntimeError):
    """More reservations held than --max-reservations: the caller should release some first."""


@dataclass(slots=True)
class _Held:
    ticket: InflightTicket
    expiry: asyncio.TimerHandle


class AppReservations:
    def __init__(
        self,
        inflight: RouterInflight,
        metrics: RouterMetrics,
        default_ttl_s: float = 60.0,
        max_ttl_s: float = 3600.0,
        max_held: int = 100_000,
    ) -> None:
        self.inflight, self.metrics = inflight, metrics
        self.default_ttl_s, self.max_ttl_s, self.max_held = default_ttl_s, max_ttl_s, max_held
        self._first = random.getrandbits(62) + 1
        self._next = self._first
        self._held: dict[int, _Held] = {}
        metrics.reservations_held.set_function(lambda: len(self._held))  # read at scrape time

    def reserve(self, decision: RouteDecision, ttl_s: float = 0.0) -> tuple[int, float]:
        """Count `decision` as in flight on its worker; (reservation id, the TTL it got)."""
        if len(self._held) >= self.max_held:
            raise TooManyReservations(
                f"{len(self._held)} reservations are held (--max-reservations {self.max_held}); release finished requests first"
            )
        chosen = decision.ranked()[0]
        ttl_s = min(ttl_s or self.default_ttl_s, self.max_ttl_s)
        ticket = self.inflight.start(
            chosen.worker_id,
            decision.prompt_tokens - chosen.cached_tokens,
            decision.chains.get(chosen.block_size, ()),
            chosen.block_size,
            decision.prompt_tokens,
        )
        rid, self._next = self._next, self._next + 1
        self._held[rid] = _Held(ticket, asyncio.get_running_loop().call_later(ttl_s, self._expire, rid))
        self.metrics.reservations.labels("reserved").inc()
        return rid, ttl_s

    def issued(self, rid: int) -> bool:
        return self._first <= rid < self._next

    def prefill_done(self, rid: int) -> bool:
        """True if the reservation was held (its prefill now settled)."""
        held = self._held.get(rid)
        if held is None:
            return False
        self.inflight.first_token(held.ticket)
        return True

    def release(self, rid: int, outcome: str) -> bool:
        """True if the reservation was held (now released)."""
        held = self._held.pop(rid, None)
        if held is None:
            return False
        held.expiry.cancel()
        self.inflight.finish(held.ticket)
        self.metrics.reservations.labels(outcome).inc()
        return True

    def _expire(self, rid: int) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            self.inflight.finish(held.ticket)
            self.metrics.reservations.labels("expired").inc()

    def close(self) -> None:
        """Release everything (the router is stopping)."""
        for rid in list(self._held):
            self.release(rid, "cancelled")
