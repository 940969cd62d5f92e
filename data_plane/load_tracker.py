"""This router's own in-flight work per worker: what heartbeats cannot show yet.

    ticket = tracker.start(worker_id, uncached_prompt_tokens)   # request sent to the worker
    tracker.first_token(ticket)                                  # first streamed byte: prefill done
    tracker.finish(ticket)                                       # completed or failed (idempotent)

`inflight(worker_id) -> (requests, pending_prefill_tokens)` is what a policy's Candidate gets.
Pure bookkeeping, no I/O or clock (the fleet simulator drives it too).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _WorkerInflight:
    requests: int = 0
    pending_prefill_tokens: int = 0


@dataclass(slots=True)
class InflightTicket:
    worker_id: str
    prefill_tokens: int
    prefill_done: bool = False
    released: bool = False


class LoadTracker:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerInflight] = {}

    def start(self, worker_id: str, uncached_tokens: int) -> InflightTicket:
        uncached_tokens = max(0, uncached_tokens)
        w = self._workers.setdefault(worker_id, _WorkerInflight())
        w.requests += 1
        w.pending_prefill_tokens += uncached_tokens
        return InflightTicket(worker_id, uncached_tokens)

    def first_token(self, ticket: InflightTicket) -> None:
        """The backend streamed its first byte: the prefill is done."""
        if not ticket.prefill_done and not ticket.released:
            ticket.prefill_done = True
            self._workers[ticket.worker_id].pending_prefill_tokens -= ticket.prefill_tokens

    def finish(self, ticket: InflightTicket) -> None:
        """Completed, failed or cancelled; safe to call more than once."""
        if ticket.released:
            return
        self.first_token(ticket)
        ticket.released = True
        w = self._workers[ticket.worker_id]
        w.requests -= 1
        if w.requests == 0:
            del self._workers[ticket.worker_id]

    def inflight(self, worker_id: str) -> tuple[int, int]:
        """(requests in flight, their uncached prompt tokens not yet prefilled)."""
        w = self._workers.get(worker_id)
        return (w.requests, w.pending_prefill_tokens) if w else (0, 0)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {wid: (w.requests, w.pending_prefill_tokens) for wid, w in self._workers.items()}
