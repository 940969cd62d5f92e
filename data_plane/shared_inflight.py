"""This router's in-flight requests, known exactly here and shared with every other router.

    ticket = inflight.start(worker_id, uncached_tokens, block_keys, block_size)  # request sent
    inflight.first_token(ticket)                                                 # prefill done
    inflight.finish(ticket)                                                      # done or failed

Each call updates the local `LoadTracker` (exact and immediate: what this router's own next
decision sees) and, when a router session is open, the control plane's reservation for the same
request (what other routers' decisions see, one message later: `kvroute bench inflight` measures
that delay). Decisions read the local part through `inflight()` / `speculative_match()`; the
control plane reports only the other routers' part, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.data_plane.load_tracker import InflightTicket, LoadTracker
from kvroute.data_plane.router_session import RouterSessionLink


@dataclass(slots=True)
class SharedTicket:
    local: InflightTicket
    reservation_id: int = 0  # 0 = not announced (no session)


class SharedInflight:
    def __init__(self, tracker: LoadTracker | None = None, session: RouterSessionLink | None = None) -> None:
        self.tracker = tracker or LoadTracker()
        self.session = session

    def start(self, worker_id: str, uncached_tokens: int, block_keys: Sequence[int] = (),
              block_size: int = 0, prompt_tokens: int = 0) -> SharedTicket:
        local = self.tracker.start(worker_id, uncached_tokens, block_keys)
        reservation_id = 0
        if self.session is not None:
            reservation_id = self.session.reserve(worker_id, block_size, block_keys, local.prefill_tokens, prompt_tokens)
        return SharedTicket(local, reservation_id)

    def first_token(self, ticket: SharedTicket) -> None:
        self.tracker.first_token(ticket.local)
        if ticket.reservation_id and self.session is not None:
            self.session.prefill_done(ticket.reservation_id)

    def finish(self, ticket: SharedTicket) -> None:
        self.tracker.finish(ticket.local)
        if ticket.reservation_id and self.session is not None:
            self.session.release(ticket.reservation_id)
            ticket.reservation_id = 0

    def inflight(self, worker_id: str) -> tuple[int, int]:
        return self.tracker.inflight(worker_id)

    def speculative_match(self, block_keys: Sequence[int]) -> dict[str, int]:
        return self.tracker.speculative_match(block_keys)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return self.tracker.snapshot()
