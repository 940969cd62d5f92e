"""Live vLLM KV events over ZMQ SUB, with sequence tracking and replay over a DEALER socket.

- first contact (and agent start): replay from seq 0 to catch up what a slow joiner missed;
- seq == last + 1: apply;  seq > last + 1: gap -> replay the missing range;
- seq <= last: the publisher restarted (its counter reset) -> the worker's state is unknown:
  reset, then replay from 0;
- a gap the replay buffer cannot fill (or no replay socket) -> reset: under-claim, never over-claim.
Malformed frames are counted and logged; the batches around them still apply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from worker_agent.vllm_wire import DecodedBatch, WireFormatError, decode_frames, decode_payload

log = logging.getLogger("kvroute.agent.zmq")
END_SEQ = b"\xff" * 8


@dataclass(slots=True)
class SourceCounters:
    batches: int = 0
    malformed_frames: int = 0
    malformed_events: int = 0
    unknown_events: int = 0
    gaps: int = 0
    unrecoverable_gaps: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    sequence_resets: int = 0
    duplicate_batches: int = 0


class _RateLimitedLog:
    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s, self._last, self._suppressed = period_s, 0.0, 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.period_s:
            extra = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
            log.warning(msg + extra, *args)
            self._last, self._suppressed = now, 0
        else:
            self._suppressed += 1


class VllmZmqSource:
    def __init__(self, endpoint: str, on_batch: Callable[[DecodedBatch], Awaitable[None]],
                 on_reset: Callable[[str], Awaitable[None]], replay_endpoint: str | None = None,
                 bind: bool = False, topic: str = "", replay_timeout_s: float = 1.0) -> None:
        self.endpoint, self.replay_endpoint, self.bind, self.topic = endpoint, replay_endpoint, bind, topic
        self.on_batch, self.on_reset = on_batch, on_reset
        self.replay_timeout_s = replay_timeout_s
        self.counters = SourceCounters()
        self.last_seq: int | None = None
        self._dedupe_until = -1
        self._ctx = zmq.asyncio.Context()
        self._bad_log = _RateLimitedLog()

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # ZMQ's default 1000 drops bursts of a busy engine
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        (sub.bind if self.bind else sub.connect)(self.endpoint)
        try:
            if self.replay_endpoint:
                await self._catch_up(0, stop_before=None)
            while True:
                frames = await sub.recv_multipart()
                await self.handle_frames(frames)
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    async def handle_frames(self, frames: list[bytes]) -> None:
        try:
            batch = decode_frames(frames)
        except WireFormatError as exc:
            self.counters.malformed_frames += 1
            self._bad_log.warning("malformed KV event frame dropped: %s", exc)
            return
        await self._handle(batch)

    async def _handle(self, batch: DecodedBatch) -> None:
        last = self.last_seq
        if last is not None and batch.seq <= self._dedupe_until:
            self.counters.duplicate_batches += 1  # live copy of a batch the replay already applied
            return
        self._dedupe_until = -1
        if last is None:
            if self.replay_endpoint and batch.seq > 0:
                await self._catch_up(0, stop_before=batch.seq)
        elif batch.seq == last + 1:
            pass
        elif batch.seq > last + 1:
            self.counters.gaps += 1
            log.warning("KV event gap: expected seq %d, got %d; replaying", last + 1, batch.seq)
            await self._catch_up(last + 1, stop_before=batch.seq)
        else:
            self.counters.sequence_resets += 1
            log.warning("KV event sequence went back from %d to %d: engine restarted, resetting worker state",
                        last, batch.seq)
            await self.on_reset("sequence reset")
            self.last_seq = None
            if self.replay_endpoint and batch.seq > 0:
                await self._catch_up(0, stop_before=batch.seq)
        await self._apply(batch)

    async def _apply(self, batch: DecodedBatch) -> None:
        self.counters.batches += 1
        if batch.bad_events:
            self.counters.malformed_events += len(batch.bad_events)
            self._bad_log.warning("batch %d: %d malformed events skipped (first: %s)", batch.seq,
                                  len(batch.bad_events), batch.bad_events[0])
        if batch.unknown_events:
            self.counters.unknown_events += len(batch.unknown_events)
            self._bad_log.warning("batch %d: unknown event types %s ignored", batch.seq, sorted(set(batch.unknown_events)))
        self.last_seq = batch.seq
        await self.on_batch(batch)

    async def _catch_up(self, start: int, stop_before: int | None) -> None:
        """Replay [start, stop_before); reset the worker if the range cannot be recovered."""
        replayed = await self._replay(start) if self.replay_endpoint else None
        if replayed is None:
            if stop_before is not None and start > 0:
                self.counters.unrecoverable_gaps += 1
                await self.on_reset("gap not recoverable")
            return
        wanted = [b for b in replayed if b.seq >= start and (stop_before is None or b.seq < stop_before)]
        if start > 0 and (not wanted or wanted[0].seq != start):
            self.counters.unrecoverable_gaps += 1
            log.warning("replay buffer no longer holds seq %d: resetting worker state", start)
            await self.on_reset("gap not recoverable")
        for batch in wanted:
            await self._apply(batch)
        if stop_before is None and wanted:
            self._dedupe_until = wanted[-1].seq

    async def _replay(self, start: int) -> list[DecodedBatch] | None:
        self.counters.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        batches: list[DecodedBatch] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    self.counters.replay_timeouts += 1
                    log.warning("replay from seq %d: no answer within %.1fs", start, self.replay_timeout_s)
                    return batches or None
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:      # vLLM >= 0.26: [topic, seq, payload]
                    seq8, payload = frames[1], frames[2]
                elif len(frames) == 2:    # older: [seq, payload]
                    seq8, payload = frames
                else:
                    self.counters.malformed_frames += 1
                    continue
                if seq8 == END_SEQ:
                    return batches
                if len(seq8) != 8:
                    self.counters.malformed_frames += 1
                    continue
                try:
                    batches.append(decode_payload(int.from_bytes(seq8, "big"), payload))
                except WireFormatError as exc:
                    self.counters.malformed_frames += 1
                    self._bad_log.warning("malformed replayed batch dropped: %s", exc)
        finally:
            dealer.close(linger=0)
