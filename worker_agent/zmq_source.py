"""Live KV events over ZMQ SUB, with sequence tracking and replay over a DEALER socket: the transport
vLLM, SGLang and TensorRT-LLM's streaming publisher share (docs/wire-formats.md#zmq-transport); the
payload decoder is the engine's dialect (`vllm_wire` or `sglang_wire`).

Sequence rules (one publisher = one counter starting at 0, +1 per batch, docs/wire-formats.md#sequence-numbers-and-loss):
- the SUB's first connection to the publisher (its ZMTP handshake, seen on a socket monitor),
  and the first batch ever: if a replay endpoint is configured, replay from seq 0 to catch up
  what the ZMQ slow joiner missed. Asking at the handshake, not when the socket is created,
  matters when the agent starts before the engine: a catch-up sent to a publisher that is not
  up yet answers before the engine's first events, and the ones published until the
  subscription takes effect would be lost with nothing left to reveal the gap;
- a later handshake is a reconnect: the publisher went away (an engine restart, or the network).
  The replay must still hold our last batch, byte for byte: then only what was published while
  disconnected is applied; otherwise this is another publisher's history (a restarted engine,
  whose counter may well be past ours already, so the sequence rules alone would not see it):
  `on_reset`, counted as `reconnect_resets`, then a catch-up from 0. With no replay answer
  the state is unknown and reset too;
- seq == last + 1: apply;
- seq > last + 1: gap -> replay [last + 1, seq) from the engine's ROUTER; if the replay
  cannot deliver that range (no replay socket, no answer, or the buffer no longer holds it) the
  worker's state is unknown: `on_reset` (the agent clears the resolver and resyncs the control
  plane), counted as `unrecoverable_gaps`; later batches apply on the cleared state;
- seq <= last: the publisher restarted (its counter reset): `on_reset`, then replay from 0;
- a live copy of a batch that a start-up replay already applied is dropped (same seq, same
  payload digest).
Replies to a replay request come in either framing (docs/wire-formats.md#replay-reply-framings:
`[seq, payload]` from vLLM < 0.26 and SGLang < 0.5.22, `[topic, seq, payload]` after), told apart by
frame count.
For one rank of a data-parallel engine, a batch naming another rank is counted (`rank_mismatches`)
and not applied: its events describe another rank's cache.
Frames that cannot be decoded are counted and logged (rate-limited) and never stop the loop.
A message whose payload cannot be decoded carries no sequence number the agent trusts: it is
dropped as if it never arrived, so garbage never looks like a gap or a restart, and if it was the
engine's batch the next one reveals the gap, which the replay fills (or, when it cannot deliver a
readable copy either, a reset). A replayed batch that cannot be decoded is missing in the same way.

Limits (`worker_agent/limits.py`): the SUB and every replay DEALER accept frames up to
`max_frame_bytes` (ZMQ_MAXMSGSIZE). ZMQ cannot skip an oversize frame: it closes the connection
that carried it and, on a socket that connected, never reconnects it. The source sees that on its
socket monitor (a disconnect not followed by ZMQ's reconnect attempt), counts it in
`oversize_frames` and connects again, and the reconnect rules above replay what was lost. A bound
SUB (`--kv-events-bind`) needs no help, the publisher reconnects; there ZMQ's monitor cannot tell
an oversize frame from a publisher going away, so only the replay's own drop is counted. A batch
claiming more than `max_batch_events` events is dropped before it is decoded (`oversize_batches`),
and a replay answer stops after `MAX_REPLAY_BATCHES` batches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.listeners import open_zmq
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.worker_agent import vllm_wire
from kvroute.worker_agent.events import DecodedBatch
from kvroute.worker_agent.limits import DEFAULT_MAX_FRAME_BYTES, MAX_REPLAY_BATCHES
from kvroute.worker_agent.msgpack_wire import OversizeBatchError, WireFormatError, split_frames

log = logging.getLogger("kvroute.agent.zmq")
END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True)
_digest = xxhash.xxh3_64_intdigest
# After ZMQ reports a lost connection it schedules its reconnect at once (CONNECT_RETRIED follows within
# microseconds); a connection it closed itself for a protocol error (an oversize frame) gets none.
RECONNECT_GRACE_S = 0.25

PayloadDecoder = Callable[[int, bytes], DecodedBatch]  # (seq, payload) -> batch; raises WireFormatError
BatchCallback = Callable[[DecodedBatch], Awaitable[None] | None]
ResetCallback = Callable[[str], Awaitable[None] | None]


@dataclass(slots=True)
class SourceCounters:
    batches: int = 0  # batches applied (live or replayed)
    malformed_frames: int = 0  # ZMQ messages (live or replayed) that could not be decoded
    malformed_events: int = 0  # single events rejected inside otherwise good batches
    unknown_events: int = 0  # events with an unknown tag (skipped)
    unknown_fields: int = 0  # events carrying fields we do not know (dropped; the event applies)
    gaps: int = 0  # seq jumped forward
    unrecoverable_gaps: int = 0  # gaps the replay could not fill -> worker state reset
    replays: int = 0  # replay requests sent
    replayed_batches: int = 0  # batches applied from a replay
    replay_timeouts: int = 0  # replay requests that got no (complete) answer in time
    sequence_resets: int = 0  # seq went backwards: engine restarted
    duplicate_batches: int = 0  # live copies of batches a replay already applied
    incomplete_catch_ups: int = 0  # catch-up from seq 0 found the start no longer buffered
    callback_errors: int = 0  # exceptions raised by on_batch / on_reset
    rank_mismatches: int = 0  # batches naming another data-parallel rank than the socket's (not applied)
    reconnects: int = 0  # the SUB's connection to the publisher re-established
    reconnect_resets: int = 0  # reconnects to another history (engine restarted) or an unverifiable one
    oversize_frames: int = 0  # connections ZMQ closed for a frame over max_frame_bytes (SUB or replay)
    oversize_batches: int = 0  # batches claiming more events than max_batch_events (dropped undecoded)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Replay:
    batches: dict[int, DecodedBatch]  # seq -> batch (a payload that cannot be decoded is missing)
    digests: dict[int, int]  # seq -> payload digest
    complete: bool  # end marker seen


class ZmqEventSource:
    """Reads one engine publisher (one rank of a data-parallel engine). `on_batch(batch)` per batch in
    sequence order, `on_reset(reason)` when the worker's state became unknown; both may be plain
    functions or coroutines. `decode`: the engine's payload decoder. `expected_rank`: the rank the
    batches must name (None: not checked)."""

    def __init__(
        self,
        endpoint: str,
        on_batch: BatchCallback,
        on_reset: ResetCallback,
        replay_endpoint: str | None = None,
        *,
        decode: PayloadDecoder = vllm_wire.decode_payload,
        expected_rank: int | None = None,
        bind: bool = False,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        replay_max_s: float = 30.0,
        rcvhwm: int = 100_000,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.bind, self.topic = endpoint, replay_endpoint, bind, topic
        self.on_batch, self.on_reset = on_batch, on_reset
        self.decode, self.expected_rank = decode, expected_rank
        self.replay_timeout_s, self.replay_max_s, self.rcvhwm = replay_timeout_s, replay_max_s, rcvhwm
        self.max_frame_bytes = max_frame_bytes
        self.counters = SourceCounters()
        self.last_seq: int | None = None
        self.bound_endpoint: str | None = None  # the SUB's resolved address when bind=True (e.g. port 0)
        self.ready = asyncio.Event()  # set once the SUB socket is bound/connected
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._replayed: dict[int, int] = {}  # seq -> digest of batches applied by a catch-up replay
        self._replayed_max = -1
        self._last_digest: int | None = None  # payload digest of batch `last_seq` (reconnect check)
        self._connections = 0  # ZMTP handshakes with the publisher so far
        self.publisher_connected = False  # a publisher handshake and no disconnect since (readiness)
        self._lost_at: float | None = None  # when a connected SUB lost its publisher, until ZMQ retries
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._log = RateLimitedLog(log)

    # ------------------------------------------------------------------ loop

    def open(self) -> None:
        """Create, subscribe and bind/connect the SUB socket (run() does it if not done yet). Raises
        ListenError, one line naming the flag and endpoint, when the endpoint cannot be bound."""
        if self._sub is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)  # ZMQ's default 1000 drops the bursts of a busy engine
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        try:
            endpoint = open_zmq(sub, "--kv-events-bind" if self.bind else "--kv-events", self.endpoint, bind=self.bind)
        except BaseException:
            _close_monitored(sub, monitor)
            raise
        self.bound_endpoint = endpoint if self.bind else None
        self._sub, self._monitor = sub, monitor
        self.ready.set()

    async def run(self) -> None:
        self.open()
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        log.info(
            "KV events: SUB %s %s (topic %r, replay %s)",
            "bound to" if self.bind else "connected to",
            self.bound_endpoint or self.endpoint,
            self.topic,
            self.replay_endpoint or "off",
        )
        try:
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                await poller.poll(self._poll_timeout_ms())
                while True:
                    # A handshake is queued before any message of that connection can arrive (the
                    # subscription goes out after it), so pending monitor events are handled first.
                    if monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        await self._guard(self._monitor_event, await monitor.recv_multipart())
                        continue
                    try:
                        frames = await sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._guard(self.handle_frames, frames)
                self._reconnect_if_dropped(sub)
        finally:
            self._sub = self._monitor = None
            self.publisher_connected = False
            _close_monitored(sub, monitor)

    async def _guard(self, handler, arg) -> None:
        try:
            await handler(arg)
        except Exception:  # noqa: BLE001 - a bug must not stop the event stream
            self.counters.callback_errors += 1
            self._log.warning("internal", "handling a KV event message failed", exc_info=True)

    async def _monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.publisher_connected = False
            if not self.bind:
                self._lost_at = time.monotonic()
            return
        self._lost_at = None  # ZMQ is reconnecting (CONNECT_RETRIED), or has (a handshake)
        if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        self._connections += 1
        self.publisher_connected = True
        if not self.replay_endpoint:
            return
        if self.last_seq is None:
            await self._catch_up_from_zero(None)
        elif self._connections > 1:
            await self._check_reconnect()

    def _poll_timeout_ms(self) -> int | None:
        if self._lost_at is None:
            return None
        return max(0, int((self._lost_at + RECONNECT_GRACE_S - time.monotonic()) * 1000))

    def _reconnect_if_dropped(self, sub: zmq.asyncio.Socket) -> None:
        """A connected SUB that lost its publisher and saw no reconnect attempt within the grace: ZMQ
        closed the connection itself (a frame over max_frame_bytes) and will never retry. Connect again."""
        if self._lost_at is None or time.monotonic() < self._lost_at + RECONNECT_GRACE_S:
            return
        self._lost_at = None
        self.counters.oversize_frames += 1
        self._log.warning(
            "oversize_frame",
            "KV events: ZMQ closed the connection to %s without reconnecting (a frame "
            "over %d bytes, or one that broke ZMTP framing): connecting again",
            self.endpoint,
            self.max_frame_bytes,
        )
        try:
            sub.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # already gone with the closed connection
        try:
            sub.connect(self.endpoint)
        except zmq.ZMQError as exc:  # it connected before: not expected, but the loop must go on
            self._log.warning("reconnect", "KV events: connecting to %s again failed: %s", self.endpoint, exc)

    def close(self) -> None:
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ per message

    async def handle_frames(self, frames: list[bytes]) -> None:
        """One live message. Never raises for bad input."""
        try:
            _, seq, payload = split_frames(frames)
        except WireFormatError as exc:
            self.counters.malformed_frames += 1
            self._log.warning(type(exc).__name__, "malformed KV event frame dropped: %s", exc)
            return
        digest = _digest(payload)
        if self._replayed and seq in self._replayed and self._replayed[seq] == digest:
            self.counters.duplicate_batches += 1  # a live copy of a batch the catch-up replay applied
            return
        try:
            batch = self.decode(seq, payload)
        except WireFormatError as exc:
            self._count_undecodable(exc)
            self._log.warning(type(exc).__name__, "malformed KV event batch (seq frame %d) dropped: %s", seq, exc)
            return  # its seq is not trusted: a gap the next batch shows, if it was the engine's, is replayed
        if self._replayed and seq > self._replayed_max:
            self._replayed.clear()  # past the replayed batches (garbage's seq frame says nothing: checked after decoding)
        await self._sequence(seq, batch, digest)

    def _count_undecodable(self, exc: WireFormatError) -> None:
        if isinstance(exc, OversizeBatchError):
            self.counters.oversize_batches += 1
        else:
            self.counters.malformed_frames += 1

    async def _sequence(self, seq: int, batch: DecodedBatch, digest: int) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            self.counters.sequence_resets += 1
            log.warning("KV event seq went back from %d to %d: engine restarted, worker state reset", last, seq)
            await self._reset("sequence reset")
            self._forget_position()
            last = None
        if last is None and seq > 0:  # first batch ever, or first after a restart
            if self.replay_endpoint:
                await self._catch_up_from_zero(seq)
                last = self.last_seq
            else:
                log.info("KV events start at seq %d and no replay endpoint is set: earlier events are unknown", seq)
        if last is not None and seq > last + 1:
            self.counters.gaps += 1
            log.warning("KV event gap: expected seq %d, got %d", last + 1, seq)
            await self._fill_gap(last + 1, seq)
        self._consume(seq, digest)
        await self._apply(batch)

    def _consume(self, seq: int, digest: int) -> None:
        if self.last_seq is None or seq > self.last_seq:
            self.last_seq, self._last_digest = seq, digest

    def _forget_position(self) -> None:
        """After a reset: the next batch starts a new history."""
        self.last_seq = self._last_digest = None
        self._replayed.clear()

    async def _apply(self, batch: DecodedBatch) -> None:
        c = self.counters
        if self.expected_rank is not None and batch.dp_rank is not None and batch.dp_rank != self.expected_rank:
            c.rank_mismatches += 1
            self._log.warning(
                "rank",
                "KV event batch seq %d names data-parallel rank %d on rank %d's socket: not applied",
                batch.seq,
                batch.dp_rank,
                self.expected_rank,
            )
            return
        c.batches += 1
        if batch.bad_events:
            c.malformed_events += len(batch.bad_events)
            self._log.warning(
                "bad_event",
                "KV event batch seq %d: %d malformed events skipped (first: %s)",
                batch.seq,
                len(batch.bad_events),
                batch.bad_events[0],
            )
        if batch.unknown_fields:
            c.unknown_fields += len(batch.unknown_fields)
            self._log.warning(
                "unknown_fields",
                "KV event batch seq %d: fields not known to this agent dropped (%s)",
                batch.seq,
                "; ".join(batch.unknown_fields[:3]),
            )
        if batch.unknown_events:
            c.unknown_events += len(batch.unknown_events)
            self._log.warning(
                "unknown_event",
                "KV event batch seq %d: unknown event types %s skipped",
                batch.seq,
                sorted(set(batch.unknown_events)),
            )
        try:
            result = self.on_batch(batch)
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - one bad batch must not stop the event stream
            c.callback_errors += 1
            self._log.warning("callback", "applying KV event batch seq %d failed", batch.seq, exc_info=True)

    async def _reset(self, reason: str) -> None:
        try:
            result = self.on_reset(reason)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.counters.callback_errors += 1
            log.exception("worker state reset (%s) failed", reason)

    # ------------------------------------------------------------------ catch-up and gaps

    async def _catch_up_from_zero(self, stop_before: int | None) -> None:
        """Start / first batch ever / after a restart: apply what the replay buffer holds before
        `stop_before`. The worker's state is empty here, so a buffer that no longer starts at 0 (or has
        holes) just means we know less than the engine: only the batches after the last hole apply."""
        replay = await self._replay(0, stop_before)
        if replay is None:
            return
        seqs = sorted(s for s in replay.batches if stop_before is None or s < stop_before)
        if not seqs:
            return
        first = 0
        for i in range(1, len(seqs)):
            if seqs[i] != seqs[i - 1] + 1:
                first = i  # a hole: what came before it lacks the lost events
        if seqs[first] > 0:
            self.counters.incomplete_catch_ups += 1
            log.info("KV event catch-up: replay buffer holds seq %d..%d; earlier events are not known", seqs[first], seqs[-1])
        for s in seqs[first:]:
            await self._apply_replayed(s, replay.batches[s], replay.digests[s])
        if stop_before is None:  # live copies of these may already be queued on the SUB socket
            self._remember_replayed(replay, seqs[first:])

    def _remember_replayed(self, replay: _Replay, seqs: list[int]) -> None:
        self._replayed = {s: replay.digests[s] for s in seqs}
        self._replayed_max = seqs[-1]

    async def _check_reconnect(self) -> None:
        """The SUB reconnected: is this still the history we applied up to `last_seq`?"""
        self.counters.reconnects += 1
        last = self.last_seq
        replay = await self._replay(last)
        if replay is not None and replay.complete and replay.digests.get(last) == self._last_digest:
            later = sorted(s for s in replay.batches if s > last)
            if later:  # published while we were disconnected
                log.info("KV events: reconnected to the same publisher; %d batches missed meanwhile replayed", len(later))
                await self._fill_gap(last + 1, later[-1] + 1, replay)
                self._remember_replayed(replay, later)
            return
        self.counters.reconnect_resets += 1
        why = (
            "no complete replay answer"
            if replay is None or not replay.complete
            else f"its replay buffer lacks our last batch (seq {last})"
            if last not in replay.digests
            else f"its batch seq {last} is not the one we applied"
        )
        log.warning("KV events: reconnected to a publisher with another history (%s): engine restarted, worker state reset", why)
        await self._reset("publisher restarted")
        self._forget_position()
        await self._catch_up_from_zero(None)

    async def _fill_gap(self, start: int, stop_before: int, replay: _Replay | None = None) -> None:
        if replay is None and self.replay_endpoint:
            replay = await self._replay(start, stop_before)
        batches = replay.batches if replay else {}
        missing = _missing_range(start, stop_before, batches)  # the gap's size is the peer's to choose: not listed
        if missing:
            first, last = missing
            self.counters.unrecoverable_gaps += 1
            why = (
                "no replay endpoint"
                if not self.replay_endpoint
                else "no replay answer"
                if replay is None
                else f"replay buffer lacks seq {first}" + (f"..{last}" if last > first else "") + " (or has no readable copy)"
            )
            log.warning("KV event gap [%d, %d) not recoverable (%s): worker state reset", start, stop_before, why)
            await self._reset("gap not recoverable")
            start = last + 1  # batches before the last lost one apply to state we just dropped
        for s in range(start, stop_before):
            await self._apply_replayed(s, batches[s], replay.digests[s])

    async def _apply_replayed(self, seq: int, batch: DecodedBatch, digest: int) -> None:
        self._consume(seq, digest)
        self.counters.replayed_batches += 1
        await self._apply(batch)

    async def _replay(self, start: int, stop_before: int | None = None) -> _Replay | None:
        """Ask the engine's ROUTER for every buffered batch with seq >= start; with `stop_before`, the answer
        is complete at the first batch at or past it (the engine answers in order, and an agent running
        behind would otherwise decode the engine's whole buffer for every gap). None = no usable answer."""
        assert self.replay_endpoint
        self.counters.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)  # not REQ: a REQ socket only delivers the first reply message
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # the reply can be the whole buffer (10000 batches by default)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        out = _Replay({}, {}, False)
        deadline = time.monotonic() + self.replay_max_s
        try:
            dealer.connect(self.replay_endpoint)
            await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), self.replay_timeout_s)
            while True:
                timeout = min(self.replay_timeout_s, deadline - time.monotonic())
                if timeout <= 0 or not await dealer.poll(int(timeout * 1000)):
                    self.counters.replay_timeouts += 1
                    dropped = await self._dropped_for_a_protocol_error(monitor)
                    log.warning(
                        "replay from seq %d (%s): no %s within %.1fs%s",
                        start,
                        self.replay_endpoint,
                        "end marker" if out.batches else "answer",
                        self.replay_timeout_s,
                        f" (ZMQ closed the connection: a frame over {self.max_frame_bytes} bytes)" if dropped else "",
                    )
                    return out if out.batches else None
                message = read_replay_reply(await dealer.recv_multipart())
                if isinstance(message, str):
                    self.counters.malformed_frames += 1
                    self._log.warning("replay_frames", "malformed replay message dropped: %s", message)
                    continue
                seq8, payload = message
                if seq8 == END_SEQ:
                    out.complete = True
                    return out
                seq = int.from_bytes(seq8, "big")
                if seq < start or seq in out.batches:
                    continue  # dedupe by seq
                try:
                    decoded = self.decode(seq, payload)
                except WireFormatError as exc:
                    # Its seq frame is not trusted either: a reply that does not decode neither ends the
                    # answer (past stop_before) nor fills a place in it.
                    self._count_undecodable(exc)
                    self._log.warning("replay_payload", "malformed replayed batch seq %d dropped: %s", seq, exc)
                    continue  # missing: a later readable copy of it may still come
                if stop_before is not None and seq >= stop_before:
                    out.complete = True  # the engine answers in order: everything before it has come
                    return out
                out.batches[seq] = decoded
                out.digests[seq] = _digest(payload)
                if len(out.batches) >= MAX_REPLAY_BATCHES:
                    self._log.warning(
                        "replay_size",
                        "replay from seq %d (%s): stopped after %d batches",
                        start,
                        self.replay_endpoint,
                        len(out.batches),
                    )
                    return out
        except TimeoutError:
            self.counters.replay_timeouts += 1
            log.warning("replay from seq %d (%s): request could not be sent", start, self.replay_endpoint)
            return None
        except zmq.ZMQError as exc:
            log.warning("replay from seq %d (%s) failed: %s", start, self.replay_endpoint, exc)
            return None
        finally:
            _close_monitored(dealer, monitor)

    async def _dropped_for_a_protocol_error(self, monitor: zmq.asyncio.Socket) -> bool:
        """Whether the replay DEALER's connection was closed by ZMQ with no reconnect after it (an oversize
        frame): counted in oversize_frames."""
        dropped = False
        while await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            dropped = event == zmq.EVENT_DISCONNECTED
        if dropped:
            self.counters.oversize_frames += 1
        return dropped


def _close_monitored(socket: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a socket and its monitor, the monitor disabled first: ZMQ's I/O thread sends each event while
    holding the lock `disable_monitor` takes, and a send to a monitor whose reading end is already closed
    blocks for good (the agent hung on stop, or in the middle of a replay)."""
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=0)


def read_replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | str:
    """(seq8, payload) of one message a DEALER received from the replay ROUTER, in either framing
    (docs/wire-formats.md#replay-reply-framings), or why it is not one. The end marker's seq8 is END_SEQ."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the DEALER-side empty delimiter
    if len(frames) == 3:  # new framing (vLLM >= 0.26, SGLang >= 0.5.22): [topic, seq8, payload]
        seq8, payload = frames[1], frames[2]
    elif len(frames) == 2:  # old framing: [seq8, payload]
        seq8, payload = frames
    else:
        return f"{len(frames)} frames"
    if len(seq8) != 8:
        return f"{len(seq8)}-byte seq"
    return seq8, payload


def _missing_range(start: int, stop: int, have: dict[int, object]) -> tuple[int, int] | None:
    """(first, last) seq in [start, stop) that `have` lacks, or None: in steps bounded by len(have), however
    wide the range."""
    first = start
    while first < stop and first in have:
        first += 1
    if first >= stop:
        return None
    last = stop - 1
    while last in have:
        last -= 1
    return first, last
