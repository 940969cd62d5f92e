"""This router's own in-flight work per worker: what heartbeats and KV events cannot show yet.

    ticket = tracker.start(worker_id, uncached_prompt_tokens, block_keys)  # request sent to the worker
    tracker.first_token(ticket)                                            # first streamed byte: prefill done
    tracker.finish(ticket)                                                 # completed or failed (idempotent)

`inflight(worker_id) -> (requests, pending_prefill_tokens)` is what a policy's Candidate gets.

Speculative holders: from `start` until `finish`, the worker counts as holding the request's
prompt blocks (`block_keys`, the chain for the worker's block size), and `speculative_match`
reports them. Until the engine's KV events reach the index, only this tells a decision that the
previous request with the same new prefix just went to that worker; without it, a burst of one
new prefix scatters over every idle worker. The belief is accurate for exactly that lifetime: the
engine computes the blocks during the prefill and keeps them pinned while the request runs, and
by the time it finishes the index has the engine's own events.

Pure bookkeeping, no I/O or clock (the fleet simulator drives it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


class LoadTracker:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerInflight] = {}
        # block key -> {worker_id: in-flight requests whose prompt holds it}
        self._speculative: dict[int, dict[str, int]] = {}

    def start(self, worker_id: str, uncached_tokens: int, block_keys: Sequence[int] = ()) -> InflightTicket:
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
        return InflightTicket(worker_id, uncached_tokens, block_keys)

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
