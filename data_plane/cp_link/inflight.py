"""This router's own in-flight requests per worker, exact here and announced to every other router.

    ticket = inflight.start(worker_id, uncached_tokens, block_keys, block_size)  # request sent
    inflight.first_token(ticket)                                                 # first byte: prefill done
    inflight.finish(ticket)                                                      # completed or failed (idempotent)

`snapshot()` -> {worker_id: (requests, pending_prefill_tokens)} and `speculative_match(keys)` are
what this router's next decision reads (`candidates.build_candidates`); they change at once.

Speculative holders: from `start` until `finish`, the worker counts as holding the request's
prompt blocks (`block_keys`, the chain for the worker's block size). Until the engine's KV events
reach the index, only this tells a decision that the previous request with the same new prefix
just went to that worker; without it, a burst of one new prefix scatters over every idle worker.
The belief is accurate for exactly that lifetime: the engine computes the blocks during the
prefill and keeps them pinned while the request runs, and by the time it finishes the index has
the engine's own events.

With a router session (`router_session.py`), each call also updates the control plane's
reservation for the same request, which is what other routers' decisions see, one message later
(`kvroute bench inflight` measures that delay). The control plane keeps every router's
reservations in its own model, `kvroute.fleet.inflight.InflightTracker`: the same
requests seen from the fleet (other routers' load, speculative claims with a TTL), reported to a
router minus its own part, so nothing is counted twice. Those are the two in-flight models, one
per plane.

No I/O or clock of its own (the fleet simulator and the benches drive it without a session).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.data_plane.cp_link.router_session import RouterSessionLink


@dataclass(slots=True)
class _WorkerInflight:
    requests: int = 0
    pending_prefill_tokens: int = 0


@dataclass(slots=True)
class InflightTicket:
    worker_id: str
    prefill_tokens: int
    block_keys: Sequence[int] = ()
    prefill_done: bool = False
    released: bool = False
    reservation_id: int = 0  # the control plane's reservation; 0 = not announced (no session)


class RouterInflight:
    def __init__(self, session: RouterSessionLink | None = None) -> None:
        """`session`: the router session to announce reservations on (None: this router alone, as
        in the simulator and the benches)."""
        self.session = session
        self._workers: dict[str, _WorkerInflight] = {}
        self._by_reservation: dict[int, InflightTicket] = {}  # announced tickets, until finished
        if session is not None:
            session.on_trimmed = self.trimmed
        # block key -> {worker_id: in-flight requests whose prompt holds it}
        self._speculative: dict[int, dict[str, int]] = {}

    def start(
        self, worker_id: str, uncached_tokens: int, block_keys: Sequence[int] = (), block_size: int = 0, prompt_tokens: int = 0
    ) -> InflightTicket:
        """The request was sent to `worker_id`; `block_keys`: its prompt's chain at that worker's
        `block_size`."""
        uncached_tokens = max(0, uncached_tokens)
        w = self._workers.setdefault(worker_id, _WorkerInflight())
        w.requests += 1
        w.pending_prefill_tokens += uncached_tokens
        spec = self._speculative
        for key in block_keys:
            holders = spec.get(key)
            if holders is None:
                spec[key] = {worker_id: 1}
            else:
                holders[worker_id] = holders.get(worker_id, 0) + 1
        ticket = InflightTicket(worker_id, uncached_tokens, block_keys)
        if self.session is not None:
            ticket.reservation_id = self.session.reserve(worker_id, block_size, block_keys, uncached_tokens, prompt_tokens)
            self._by_reservation[ticket.reservation_id] = ticket
        return ticket

    def trimmed(self, reservation_id: int, prefill_tokens: int) -> None:
        """The control plane charged this reservation's prefill less than announced (part of the prompt is
        held there or being computed for a request another router sent first): count it as that."""
        ticket = self._by_reservation.get(reservation_id)
        if ticket is None or ticket.prefill_done or prefill_tokens >= ticket.prefill_tokens:
            return
        self._workers[ticket.worker_id].pending_prefill_tokens -= ticket.prefill_tokens - prefill_tokens
        ticket.prefill_tokens = prefill_tokens

    def first_token(self, ticket: InflightTicket) -> None:
        """The backend streamed its first byte: the prefill is done."""
        if self._settle_prefill(ticket) and ticket.reservation_id and self.session is not None:
            self.session.prefill_done(ticket.reservation_id)

    def _settle_prefill(self, ticket: InflightTicket) -> bool:
        """Locally: its prefill is no longer pending (True if it was until now)."""
        if ticket.prefill_done or ticket.released:
            return False
        ticket.prefill_done = True
        self._workers[ticket.worker_id].pending_prefill_tokens -= ticket.prefill_tokens
        return True

    def finish(self, ticket: InflightTicket) -> None:
        """Completed, failed or cancelled; safe to call more than once."""
        if ticket.released:
            return
        self._settle_prefill(ticket)  # the release tells the control plane that much too
        ticket.released = True
        if ticket.reservation_id and self.session is not None:
            self.session.release(ticket.reservation_id)
            self._by_reservation.pop(ticket.reservation_id, None)
        worker_id = ticket.worker_id
        w = self._workers[worker_id]
        w.requests -= 1
        if w.requests == 0:
            del self._workers[worker_id]
        spec = self._speculative
        for key in ticket.block_keys:
            holders = spec[key]
            left = holders[worker_id] - 1
            if left:
                holders[worker_id] = left
            elif len(holders) == 1:
                del spec[key]
            else:
                del holders[worker_id]

    def inflight(self, worker_id: str) -> tuple[int, int]:
        """(requests in flight, their uncached prompt tokens not yet prefilled)."""
        w = self._workers.get(worker_id)
        return (w.requests, w.pending_prefill_tokens) if w else (0, 0)

    def speculative_match(self, block_keys: Sequence[int]) -> dict[str, int]:
        """Per worker: leading keys of `block_keys` held by this router's in-flight requests there."""
        spec = self._speculative
        if not spec or not block_keys:
            return {}
        first = spec.get(block_keys[0])
        if not first:
            return {}
        depth: dict[str, int] = {}
        alive = list(first)
        for i in range(1, len(block_keys)):
            holders = spec.get(block_keys[i])
            if holders is None:
                break
            if any(w not in holders for w in alive):
                for w in alive:
                    if w not in holders:
                        depth[w] = i
                alive = [w for w in alive if w in holders]
                if not alive:
                    return depth
        else:
            i = len(block_keys)
        for w in alive:
            depth[w] = i
        return depth

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {wid: (w.requests, w.pending_prefill_tokens) for wid, w in self._workers.items()}
