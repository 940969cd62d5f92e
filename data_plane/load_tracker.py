"""This router's own in-flight work per worker (what heartbeats cannot show yet)."""

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
        if ticket.released:
            return
        self.first_token(ticket)
        ticket.released = True
        self._workers[ticket.worker_id].requests -= 1

    def inflight(self, worker_id: str) -> tuple[int, int]:
        w = self._workers.get(worker_id)
        return (w.requests, w.pending_prefill_tokens) if w else (0, 0)
