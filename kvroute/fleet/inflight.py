"""In-flight state routers share over RouterSession: reservations and speculative holders.

A router that sends a request to a worker reserves it: until released (or the router's session
closes, or `max_age_s` passes) it counts on that worker as one reserved request, and its prefill
tokens as reserved prefill until the first token (`prefill_done`). Its prompt's block keys make
the worker a speculative holder of them (index claims, see kvroute.prefix_index) for a TTL, so
other routers' queries see the prefix where it is about to be cached, before the engine's own
events confirm it.

Costs: reserve/release are O(keys of that reservation), prefill_done is O(1), and a query reads
per-worker sums (`requests` / `prefill_tokens`, minus the asking router's own) without looking at
reservations. Expiry is lazy: every operation first pops what is due (the max-age queue is in
creation order, the TTL heap holds only reservations with claims).

Claims: a (worker, key) claim is counted by the live reservations vouching for it and is dropped
when that count reaches 0, when the worker's events store the key (the index holds it now), or
when the worker clears its cache or is dropped. So that a release never takes a vouch from a
claim made after the one it vouched for (the key was confirmed, then claimed again), each claim
remembers the creation order of the reservation that made it: a reservation only decrements
claims at least as old as itself.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.prefix_index import PrefixIndex

# A claim is one int: (order of the reservation that created it) << _ORDER_SHIFT | vouchers.
_ORDER_SHIFT = 32
_VOUCHERS = (1 << _ORDER_SHIFT) - 1


class DuplicateReservation(ValueError):
    """A reservation_id still live in the same session."""


@dataclass(slots=True, eq=False)
class RouterTally:
    """One router's live reservations summed per worker slot, over all its sessions."""

    router_id: str
    requests: dict[int, int] = field(default_factory=dict)
    prefill_tokens: dict[int, int] = field(default_factory=dict)
    sessions: int = 0


@dataclass(slots=True, eq=False)
class RouterSessionState:
    session_id: int
    router: RouterTally
    reservations: dict[int, Reservation] = field(default_factory=dict)  # by reservation_id
    # Where the router's stream is (a replica's or control plane's id; "" = here) and the session's
    # number there: the session's name in the replicated in-flight log and the follow stream.
    origin: str = ""
    number: int = 0


@dataclass(slots=True, eq=False)
class Reservation:
    session: RouterSessionState
    reservation_id: int
    slot: int
    prefill_tokens: int  # still pending: 0 after prefill_done
    order: int  # creation order, unique across the tracker
    expires_at: float  # max age
    claimed_keys: list[int] | None = None  # keys it vouches for, until its TTL passes
    claims_expire_at: float = 0.0


@dataclass(slots=True)
class InflightCounters:
    reserved: int = 0
    released: int = 0
    prefill_done: int = 0
    unknown_worker: int = 0  # reserve naming a worker the control plane does not know
    block_size_mismatch: int = 0  # reserve whose chain is not at the worker's block size (keys ignored)
    unknown_reservation: int = 0  # prefill_done/release of an id not live (expired, dropped, never made)
    expired: int = 0  # dropped at max age, never released
    closed_with_session: int = 0  # dropped because their router's stream closed
    dropped_with_worker: int = 0  # dropped because their worker was
    claims_made: int = 0  # new (worker, key) speculative claims
    claims_confirmed: int = 0  # claims the worker's own events replaced
    claims_expired: int = 0  # reservations whose claims reached their TTL


class InflightListener(Protocol):
    """Told of every explicit session operation once it applied (not of what expiry, a worker's drop
    or its events do: whoever replicates the tracker derives those itself). The control plane's
    follow feed is one."""

    def session_opened(self, session: RouterSessionState) -> None: ...

    def reserved(self, reservation: Reservation, worker_keys: Sequence[int], block_size: int, ttl_ms: int) -> None: ...

    def prefill_done(self, reservation: Reservation) -> None: ...

    def released(self, session: RouterSessionState, reservation_id: int) -> None: ...

    def session_closed(self, session: RouterSessionState) -> None: ...


class InflightTracker:
    def __init__(
        self,
        index: PrefixIndex,
        default_ttl_s: float = 5.0,
        max_age_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_ttl_s <= 0 or max_age_s <= 0:
            raise ValueError("speculative TTL and reservation max age must be positive")
        self.index = index
        self.default_ttl_s = default_ttl_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.counters = InflightCounters()
        # Sums over every live reservation, per worker slot (what the unary Query reports).
        self.requests: dict[int, int] = {}
        self.prefill_tokens: dict[int, int] = {}
        self.routers: dict[str, RouterTally] = {}
        self._sessions = 0
        self._orders = 0
        self._live: OrderedDict[int, Reservation] = OrderedDict()  # by order = by expiry (one max age)
        self._by_slot: dict[int, dict[int, Reservation]] = {}  # slot -> order -> reservation
        self._claims: dict[int, dict[int, int]] = {}  # slot -> key -> claim (see _ORDER_SHIFT)
        self._claim_deadlines: list[tuple[float, int]] = []  # heap of (claims_expire_at, order)
        self.open_sessions = 0
        self.sessions: dict[int, RouterSessionState] = {}  # open ones, by session_id
        self.listener: InflightListener | None = None

    # ------------------------------------------------------------ sessions

    def open_session(self, router_id: str, origin: str = "", number: int = 0) -> RouterSessionState:
        """A router's session: here (`origin` "", numbered by this tracker) or elsewhere (`origin`, and
        its `number` there)."""
        router = self.routers.get(router_id)
        if router is None:
            router = self.routers[router_id] = RouterTally(router_id)
        router.sessions += 1
        self._sessions += 1
        self.open_sessions += 1
        session = RouterSessionState(self._sessions, router, origin=origin, number=number or self._sessions)
        self.sessions[session.session_id] = session
        if self.listener is not None:
            self.listener.session_opened(session)
        return session

    def close_session(self, session: RouterSessionState) -> None:
        """The router's stream ended: its reservations go (it re-reserves after reconnecting)."""
        for reservation in list(session.reservations.values()):
            self._drop(reservation)
            self.counters.closed_with_session += 1
        router = session.router
        router.sessions -= 1
        if router.sessions == 0:
            del self.routers[router.router_id]
        self.open_sessions -= 1
        self.sessions.pop(session.session_id, None)
        if self.listener is not None:
            self.listener.session_closed(session)

    # ------------------------------------------------------------ reservations

    def reserve(
        self,
        session: RouterSessionState,
        reservation_id: int,
        slot: int,
        keys: Sequence[int],
        prefill_tokens: int,
        ttl_ms: int = 0,
        prompt_tokens: int = 0,
        block_size: int = 0,
        max_age_s: float | None = None,
    ) -> Reservation:
        """`prompt_tokens` and `block_size` (both known): the prefill charged is at most what the
        worker has to compute past the blocks it holds or that live claims there already cover.
        `max_age_s`: what is left of the max age of a reservation made elsewhere earlier (a replica
        restoring another's); expiry goes in creation order, so such a one may outlive it until the
        reservations made before it expire."""
        if reservation_id in session.reservations:
            raise DuplicateReservation(
                f"reservation_id {reservation_id} is already live in this session (ids must be unique within a router session)"
            )
        self.expire()
        if prompt_tokens and block_size and keys and prefill_tokens:
            prefill_tokens = min(prefill_tokens, max(0, prompt_tokens - self.covered_blocks(slot, keys) * block_size))
        now = self.clock()
        self._orders += 1
        max_age_s = self.max_age_s if max_age_s is None else min(max_age_s, self.max_age_s)
        reservation = Reservation(session, reservation_id, slot, prefill_tokens, self._orders, now + max_age_s)
        session.reservations[reservation_id] = reservation
        self._live[reservation.order] = reservation
        self._by_slot.setdefault(slot, {})[reservation.order] = reservation
        _add(self.requests, slot, 1)
        _add(session.router.requests, slot, 1)
        if prefill_tokens:
            _add(self.prefill_tokens, slot, prefill_tokens)
            _add(session.router.prefill_tokens, slot, prefill_tokens)
        if keys:
            self._claim(reservation, keys, now + min(ttl_ms / 1000 if ttl_ms else self.default_ttl_s, max_age_s))
        self.counters.reserved += 1
        if self.listener is not None:
            self.listener.reserved(reservation, keys, block_size, ttl_ms)
        return reservation

    def prefill_done(self, session: RouterSessionState, reservation_id: int) -> bool:
        reservation = self._find(session, reservation_id)
        if reservation is not None:
            self._settle_prefill(reservation)
            self.counters.prefill_done += 1
            if self.listener is not None:
                self.listener.prefill_done(reservation)
        return reservation is not None

    def release(self, session: RouterSessionState, reservation_id: int) -> bool:
        reservation = self._find(session, reservation_id)
        if reservation is not None:
            self._drop(reservation)
            self.counters.released += 1
            if self.listener is not None:
                self.listener.released(session, reservation_id)
        return reservation is not None

    def _find(self, session: RouterSessionState, reservation_id: int) -> Reservation | None:
        reservation = session.reservations.get(reservation_id)
        if reservation is None:
            self.counters.unknown_reservation += 1  # expired, dropped with its worker, or never made
        return reservation

    def covered_blocks(self, slot: int, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` the worker holds (index) or live claims there vouch for."""
        depth = self.index.held_prefix(slot, keys)
        claims = self._claims.get(slot)
        if claims:
            while depth < len(keys) and keys[depth] in claims:
                depth += 1
        return depth

    def reserved_by_others(self, slot: int, asking: RouterTally | None) -> tuple[int, int]:
        """(requests, prefill tokens) reserved on `slot` by every router but `asking`."""
        requests, prefill = self.requests.get(slot, 0), self.prefill_tokens.get(slot, 0)
        if asking is not None:
            requests -= asking.requests.get(slot, 0)
            prefill -= asking.prefill_tokens.get(slot, 0)
        return requests, prefill

    def reservation_count(self) -> int:
        return len(self._live)

    def claim_count(self) -> int:
        return sum(len(claims) for claims in self._claims.values())

    # ------------------------------------------------------------ what the workers say

    def confirm(self, slot: int, keys: Iterable[int]) -> None:
        """The worker's events stored `keys`: the index holds them, claims on them are not needed."""
        claims = self._claims.get(slot)
        if not claims:
            return
        confirmed = [key for key in keys if claims.pop(key, None) is not None]
        if confirmed:
            self.index.unspeculate(slot, confirmed)
            self.counters.claims_confirmed += len(confirmed)

    def slot_cleared(self, slot: int) -> None:
        """The worker cleared its cache: claims on it go (its reservations stay)."""
        claims = self._claims.pop(slot, None)
        if claims:
            self.index.unspeculate(slot, claims)

    def slot_dropped(self, slot: int) -> None:
        """The worker is gone: its reservations and claims go."""
        for reservation in list(self._by_slot.get(slot, {}).values()):
            self._drop(reservation)
            self.counters.dropped_with_worker += 1
        self.slot_cleared(slot)

    # ------------------------------------------------------------ expiry

    def expire(self) -> None:
        """Drop what is due: claims past their TTL, reservations past the max age."""
        now = self.clock()
        deadlines = self._claim_deadlines
        while deadlines and deadlines[0][0] <= now:
            _, order = heapq.heappop(deadlines)
            reservation = self._live.get(order)
            if reservation is not None and reservation.claimed_keys is not None:
                self._unclaim(reservation)
                self.counters.claims_expired += 1
        live = self._live
        while live:
            reservation = next(iter(live.values()))
            if reservation.expires_at > now:
                break
            self._drop(reservation)
            self.counters.expired += 1

    # ------------------------------------------------------------ internals

    def _claim(self, reservation: Reservation, keys: Sequence[int], expires_at: float) -> None:
        slot = reservation.slot
        # The worker already holds a prefix of the chain: only the rest is speculative.
        start = self.index.held_prefix(slot, keys)
        if start == len(keys):
            return
        claimed = list(keys[start:])
        claims = self._claims.setdefault(slot, {})
        made = reservation.order << _ORDER_SHIFT | 1
        new_keys = []
        for key in claimed:
            claim = claims.get(key)
            if claim is None:
                claims[key] = made
                new_keys.append(key)
            else:
                claims[key] = claim + 1
        if new_keys:
            self.index.speculate(slot, new_keys)
            self.counters.claims_made += len(new_keys)
        reservation.claimed_keys = claimed
        reservation.claims_expire_at = expires_at
        heapq.heappush(self._claim_deadlines, (expires_at, reservation.order))

    def _unclaim(self, reservation: Reservation) -> None:
        keys, reservation.claimed_keys = reservation.claimed_keys, None
        claims = self._claims.get(reservation.slot)
        if not keys or not claims:
            return
        order = reservation.order
        gone = []
        for key in keys:
            claim = claims.get(key)
            if claim is None or claim >> _ORDER_SHIFT > order:
                continue  # confirmed or cleared since; maybe claimed again by a later reservation
            if claim & _VOUCHERS == 1:
                del claims[key]
                gone.append(key)
            else:
                claims[key] = claim - 1
        if gone:
            self.index.unspeculate(reservation.slot, gone)

    def _settle_prefill(self, reservation: Reservation) -> None:
        if reservation.prefill_tokens:
            slot, tokens = reservation.slot, reservation.prefill_tokens
            _add(self.prefill_tokens, slot, -tokens)
            _add(reservation.session.router.prefill_tokens, slot, -tokens)
            reservation.prefill_tokens = 0

    def _drop(self, reservation: Reservation) -> None:
        slot = reservation.slot
        self._settle_prefill(reservation)
        _add(self.requests, slot, -1)
        _add(reservation.session.router.requests, slot, -1)
        if reservation.claimed_keys is not None:
            self._unclaim(reservation)
        del reservation.session.reservations[reservation.reservation_id]
        del self._live[reservation.order]
        on_slot = self._by_slot[slot]
        del on_slot[reservation.order]
        if not on_slot:
            del self._by_slot[slot]


def _add(sums: dict[int, int], slot: int, delta: int) -> None:
    value = sums.get(slot, 0) + delta
    if value:
        sums[slot] = value
    else:
        del sums[slot]
