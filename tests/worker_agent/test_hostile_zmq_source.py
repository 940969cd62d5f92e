"""Property-based and socket-level tests of the agent's ZMQ transport against hostile input
(docs/wire-formats.md#zmq-transport): frame splitting, the replay reply framings, the sequence rules
when garbage is interleaved with an engine's batches, and the frame-size limit.

- Garbage (wrong frame counts, short sequence frames, payloads that do not decode, whatever their seq
  frame says) is counted and never moves the sequence: the valid batches around it apply in order,
  once each, with no gap and no reset.
- A batch replaced on the live stream by a corrupted copy is a real gap: the replay fills it from the
  engine's buffer, whatever junk the replay peer sends along and in either reply framing.
- A frame over the size limit makes ZMQ drop the connection for good; the source connects again.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import example, given
from hypothesis import strategies as st

from kvroute.block_keys import prompt_block_keys
from kvroute.worker_agent import vllm_wire
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.events import DecodedBatch
from kvroute.worker_agent.msgpack_wire import FrameCountError, SequenceFrameError, WireFormatError, split_frames
from kvroute.worker_agent.zmq_source import END_SEQ, ZmqEventSource, _missing_range, read_replay_reply

MODEL, BS = "tiny", 2
FRAMES = st.lists(st.binary(max_size=12), max_size=6)


def store(h: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": [h, h + 1],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def batch(h: int) -> bytes:
    return msgspec.msgpack.encode([1.0, [store(h)], 0])


def key(h: int) -> int:
    return prompt_block_keys([h, h + 1], BS, MODEL)[0]


def undecodable(frames: list[bytes]) -> bool:
    try:
        vllm_wire.decode_frames(frames)
    except WireFormatError:
        return True
    return False


# ---------------------------------------------------------------- pure pieces


@given(FRAMES)
def test_split_frames_takes_exactly_three_frames_with_an_8_byte_seq(frames: list[bytes]) -> None:
    try:
        topic, seq, payload = split_frames(frames)
    except FrameCountError:
        assert len(frames) != 3
    except SequenceFrameError:
        assert len(frames) == 3 and len(frames[1]) != 8
    else:
        assert (topic, seq.to_bytes(8, "big"), payload) == tuple(frames)


@given(FRAMES)
def test_any_replay_message_is_read_or_refused_with_a_reason(frames: list[bytes]) -> None:
    out = read_replay_reply(frames)
    body = frames[1:] if frames[:1] == [b""] else frames
    if isinstance(out, str):
        assert len(body) not in (2, 3) or len(body[-2]) != 8
    else:
        assert len(body) in (2, 3) and out == (body[-2], body[-1]) and len(out[0]) == 8


@given(st.binary(max_size=8), st.integers(0, 2**64 - 2), st.binary(max_size=16), st.booleans())
def test_both_replay_framings_give_seq_and_payload(topic: bytes, seq: int, payload: bytes, new: bool) -> None:
    """docs/wire-formats.md#replay-reply-framings: new `[b"", topic, seq8, payload]`, old `[b"", seq8, payload]`;
    the end marker's seq is eight 0xff bytes in both."""
    seq8 = seq.to_bytes(8, "big")
    assert read_replay_reply([b"", topic, seq8, payload] if new else [b"", seq8, payload]) == (seq8, payload)
    assert read_replay_reply([b"", b"", END_SEQ, b""] if new else [b"", END_SEQ, b""]) == (END_SEQ, b"")


@given(st.integers(0, 2**64), st.integers(0, 2**64), st.sets(st.integers(0, 40), max_size=20))
@example(0, 2**63, set())  # a peer's seq frame can put the end of a gap anywhere
def test_missing_range_is_bounded_and_exact(start: int, width: int, have: set[int]) -> None:
    stop = start + width
    t = time.thread_time()
    got = _missing_range(start, stop, dict.fromkeys(have))
    assert time.thread_time() - t < 0.1  # CPU time: steps bounded by the 20 held seqs, whatever the width
    if width <= 100:
        missing = [s for s in range(start, stop) if s not in have]
        assert got == ((missing[0], missing[-1]) if missing else None)
    else:
        assert got is not None and got[0] >= start and got[1] < stop


# ---------------------------------------------------------------- sequence rules, live path only


class Recorder:
    """A source with no sockets opened (handle_frames only), feeding a real resolver."""

    def __init__(self, replay_endpoint: str | None = None, ctx: zmq.asyncio.Context | None = None) -> None:
        self.resolver = BlockResolver(MODEL)
        self.applied: list[int] = []
        self.resets: list[str] = []
        self.source = ZmqEventSource(
            "tcp://127.0.0.1:1", self._on_batch, self._on_reset, replay_endpoint, replay_timeout_s=0.5, context=ctx
        )

    def _on_batch(self, b: DecodedBatch) -> None:
        self.applied.append(b.seq)
        self.resolver.apply(b.events)

    def _on_reset(self, reason: str) -> None:
        self.resets.append(reason)
        self.resolver.clear()


GARBAGE = st.one_of(
    FRAMES,  # any frames at all
    st.tuples(st.binary(max_size=4), st.integers(0, 2**64 - 1), st.binary(max_size=24)).map(  # 3 frames, any seq
        lambda t: [t[0], t[1].to_bytes(8, "big"), t[2]]
    ),
    st.tuples(st.integers(0, 2**64 - 1), st.integers(1, 20), st.integers(0, 255)).map(  # a batch, corrupted
        lambda t: [b"", t[0].to_bytes(8, "big"), batch(t[1])[: -t[2] % 9 - 1]]
    ),
).filter(undecodable)


@given(st.lists(st.booleans(), max_size=40), st.data())
def test_garbage_between_batches_never_moves_the_sequence(valid_first: list[bool], data) -> None:
    async def scenario() -> None:
        rec, seq, garbage = Recorder(), 0, 0
        for is_valid in valid_first + [True]:
            if is_valid:
                await rec.source.handle_frames([b"", seq.to_bytes(8, "big"), batch(seq + 100)])
                seq += 1
            else:
                await rec.source.handle_frames(data.draw(GARBAGE))
                garbage += 1
        c = rec.source.counters
        assert rec.applied == list(range(seq)) and rec.resets == []
        assert c.gaps == c.sequence_resets == c.unrecoverable_gaps == 0 and c.malformed_frames == garbage
        assert set(rec.resolver.held_keys()) == {key(s + 100) for s in range(seq)}
        rec.source.close()

    asyncio.run(scenario())


def test_regression_a_batch_whose_seq_jumps_to_2_63_is_a_bounded_gap() -> None:
    """The gap's missing seqs were listed one by one: a batch numbered 2**63 hung the agent."""

    async def scenario() -> None:
        rec = Recorder()
        await rec.source.handle_frames([b"", (0).to_bytes(8, "big"), batch(1)])
        started = time.thread_time()
        await rec.source.handle_frames([b"", (2**63).to_bytes(8, "big"), batch(2)])
        assert time.thread_time() - started < 1
        assert rec.applied == [0, 2**63] and rec.resets == ["gap not recoverable"]
        rec.source.close()

    asyncio.run(scenario())


def test_regression_an_undecodable_payload_does_not_use_up_its_seq() -> None:
    """A payload that could not be decoded still advanced the sequence: garbage with a seq frame one past the
    last batch made the engine's real batch of that number look like a restart (reset, state dropped)."""

    async def scenario() -> None:
        rec = Recorder()
        await rec.source.handle_frames([b"", (0).to_bytes(8, "big"), batch(1)])
        await rec.source.handle_frames([b"", (1).to_bytes(8, "big"), b"\xc1garbage"])
        await rec.source.handle_frames([b"", (1).to_bytes(8, "big"), batch(2)])
        assert rec.applied == [0, 1] and rec.resets == [] and rec.source.counters.malformed_frames == 1
        rec.source.close()

    asyncio.run(scenario())


# ---------------------------------------------------------------- with a replay peer


class ReplayPeer:
    """An engine's replay ROUTER holding the true buffer, answering in one framing and sending junk along."""

    def __init__(self, ctx: zmq.asyncio.Context, framing: str, junk: list[list[bytes]]) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: dict[int, bytes] = {}
        self.framing, self.junk = framing, junk
        self.task = asyncio.create_task(self._serve())

    def reply(self, seq8: bytes, payload: bytes) -> list[bytes]:
        return [b"", b"", seq8, payload] if self.framing == "new" else [b"", seq8, payload]

    async def _serve(self) -> None:
        while True:
            identity, _, start8 = await self.router.recv_multipart()
            start = int.from_bytes(start8, "big")
            for seq in sorted(s for s in self.buffer if s >= start):
                for junk in self.junk:  # junk first: a bad copy of a seq must not hide the good one after it
                    await self.router.send_multipart([identity, *junk])
                await self.router.send_multipart([identity, *self.reply(seq.to_bytes(8, "big"), b"\xc1")])
                await self.router.send_multipart([identity, *self.reply(seq.to_bytes(8, "big"), self.buffer[seq])])
            await self.router.send_multipart([identity, *self.reply(END_SEQ, b"")])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.router.close(linger=0)


async def test_regression_garbage_does_not_make_the_agent_forget_what_a_replay_applied() -> None:
    """Found by `kvroute bench fuzz`: the live copies of batches a replay had applied are recognised by digest
    until a batch past them arrives, but garbage whose seq frame pointed past them ended that, so the next
    live copy looked like a restart (reset, catch-up from 0, every batch applied again)."""
    ctx = zmq.asyncio.Context()
    peer = ReplayPeer(ctx, "new", [])
    rec = Recorder(peer.endpoint, ctx)
    try:
        peer.buffer.update({s: batch(100 + s) for s in range(3)})
        await rec.source._catch_up_from_zero(None)  # what the SUB's first handshake does: 0..2 applied
        await rec.source.handle_frames([b"", (2**40).to_bytes(8, "big"), b"\xc1garbage"])
        for s in range(3):  # their live copies, which the slow joiner may still deliver
            await rec.source.handle_frames([b"", s.to_bytes(8, "big"), peer.buffer[s]])
        assert rec.applied == [0, 1, 2] and rec.resets == [] and rec.source.counters.duplicate_batches == 3
    finally:
        await peer.close()
        ctx.destroy(linger=0)


async def test_regression_a_gap_decodes_only_the_batches_it_lacks() -> None:
    """Found by the live fuzz at 100,000 messages: a replay for a gap decoded every batch the engine's buffer
    held after it, so an agent running behind its engine decoded thousands of batches per gap and fell
    further behind with every gap."""
    ctx = zmq.asyncio.Context()
    peer = ReplayPeer(ctx, "new", [])
    rec = Recorder(peer.endpoint, ctx)
    decoded: list[int] = []

    def counting_decode(seq: int, payload: bytes):
        decoded.append(seq)
        return vllm_wire.decode_payload(seq, payload)

    rec.source.decode = counting_decode
    try:
        peer.buffer.update({s: batch(100 + s) for s in range(3000)})  # the engine is far ahead of the agent
        await rec.source.handle_frames([b"", (0).to_bytes(8, "big"), peer.buffer[0]])
        await rec.source.handle_frames([b"", (2).to_bytes(8, "big"), peer.buffer[2]])  # gap: seq 1
        assert rec.applied == [0, 1, 2] and rec.resets == []
        # live 0 and 2; then the gap's batch and the one that ends the answer (a reply ends it only if it
        # decodes: its seq frame is not trusted otherwise), each after the peer's bad copy of it
        assert len(decoded) <= 6, f"{len(decoded)} batches decoded for a one-batch gap"
    finally:
        await peer.close()
        ctx.destroy(linger=0)


LIVE_FATES = st.sampled_from(("live", "live", "live", "lost", "corrupted"))


@given(
    st.lists(LIVE_FATES, min_size=1, max_size=12),
    st.sampled_from(("old", "new")),
    st.lists(st.lists(st.binary(max_size=9), max_size=5), max_size=2),
    st.lists(GARBAGE, max_size=4),
)
def test_lost_and_corrupted_batches_are_replayed_whatever_else_the_peers_send(fates, framing, junk, garbage) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        peer = ReplayPeer(ctx, framing, [[b"", *j] for j in junk])
        rec = Recorder(peer.endpoint, ctx)
        try:
            for seq, fate in enumerate(fates + ["live"]):
                peer.buffer[seq] = batch(seq + 100)
                if fate == "corrupted":  # the engine's batch arrives broken: the next one shows the gap
                    await rec.source.handle_frames([b"", seq.to_bytes(8, "big"), peer.buffer[seq][:-1]])
                elif fate == "live":
                    await rec.source.handle_frames([b"", seq.to_bytes(8, "big"), peer.buffer[seq]])
                for frames in garbage[seq % 2 :: 2]:
                    await rec.source.handle_frames(frames)
            assert rec.applied == list(range(len(fates) + 1)) and rec.resets == []
            assert set(rec.resolver.held_keys()) == {key(s + 100) for s in range(len(fates) + 1)}
            assert rec.source.counters.unrecoverable_gaps == 0
        finally:
            await peer.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


# ---------------------------------------------------------------- the frame-size limit, over real sockets


async def settle(until, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def subscribed(pub: zmq.asyncio.Socket) -> None:
    """Until a subscriber (re)subscribes (an XPUB also reports the unsubscription of one that left)."""
    while (await asyncio.wait_for(pub.recv(), 5))[:1] != b"\x01":
        pass


@pytest.mark.parametrize("with_replay", [True, False], ids=["replay", "no-replay"])
async def test_an_oversize_frame_drops_the_connection_and_the_source_connects_again(with_replay: bool) -> None:
    """ZMQ closes a connection that carries a frame over MAXMSGSIZE and never reconnects a socket that
    connected: without help the agent stopped receiving events for good."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)  # XPUB: a PUB that says when a subscriber joins
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # even when the old connection's end has not been seen yet
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    peer = ReplayPeer(ctx, "new", []) if with_replay else None
    rec = Recorder(peer.endpoint if peer else None, ctx)
    rec.source.endpoint, rec.source.max_frame_bytes = endpoint, 4096
    task = asyncio.create_task(rec.source.run())
    try:
        if peer:
            peer.buffer[0] = batch(100)
        await subscribed(pub)
        await settle(lambda: rec.applied == [0] or not peer)
        if not peer:
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), batch(100)])
            await settle(lambda: rec.applied == [0])
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\x00" * 5000])  # over 4096 bytes
        await subscribed(pub)  # the source connected again by itself
        if peer:  # what went out while it was away is replayed
            peer.buffer[1] = batch(101)
        await pub.send_multipart([b"", (2 if peer else 1).to_bytes(8, "big"), batch(102)])
        if peer:
            peer.buffer[2] = batch(102)
        await settle(lambda: rec.applied[-1:] == [2 if peer else 1])
        c = rec.source.counters
        assert c.oversize_frames == 1 and rec.resets == []
        assert rec.applied == ([0, 1, 2] if peer else [0, 1])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if peer:
            await peer.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_an_oversize_replay_frame_is_counted_and_the_gap_is_lost() -> None:
    ctx = zmq.asyncio.Context()
    peer = ReplayPeer(ctx, "old", [])
    rec = Recorder(peer.endpoint, ctx)
    rec.source.max_frame_bytes, rec.source.replay_timeout_s = 4096, 0.3
    try:
        peer.buffer.update({0: batch(100), 1: msgspec.msgpack.encode([1.0, [store(101)] * 200, 0]), 2: batch(102)})
        await rec.source.handle_frames([b"", (0).to_bytes(8, "big"), peer.buffer[0]])
        await rec.source.handle_frames([b"", (2).to_bytes(8, "big"), peer.buffer[2]])  # gap: seq 1, over 4096 bytes
        c = rec.source.counters
        assert c.oversize_frames == 1 and c.replay_timeouts == 1 and rec.resets == ["gap not recoverable"]
        assert rec.applied == [0, 2]
    finally:
        await peer.close()
        ctx.destroy(linger=0)


async def test_a_batch_with_more_events_than_the_limit_is_dropped_undecoded_and_replayed_as_lost() -> None:
    big = msgspec.msgpack.encode([1.0, [store(5)] * 50, 0])
    rec = Recorder()
    rec.source.decode = lambda seq, payload: vllm_wire.decode_payload(seq, payload, max_events=10)
    await rec.source.handle_frames([b"", (0).to_bytes(8, "big"), batch(100)])
    await rec.source.handle_frames([b"", (1).to_bytes(8, "big"), big])
    await rec.source.handle_frames([b"", (2).to_bytes(8, "big"), batch(102)])
    c = rec.source.counters
    assert c.oversize_batches == 1 and c.malformed_frames == 0
    assert rec.applied == [0, 2] and rec.resets == ["gap not recoverable"]  # no replay endpoint: state reset
    rec.source.close()


_OPEN_AND_CLOSE = """
import asyncio, zmq, zmq.asyncio
from kvroute.worker_agent.zmq_source import ZmqEventSource

async def main():
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)  # the engine is down: ZMQ's reconnect attempts keep the monitors busy
    for i in range(150):
        source = ZmqEventSource("tcp://127.0.0.1:1", lambda b: None, lambda r: None, "tcp://127.0.0.1:1",
                                replay_timeout_s=0.001 * (i % 5 + 1), context=ctx)
        task = asyncio.create_task(source.run())
        await asyncio.sleep(0.001 * (i % 7))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await source._replay(0)
    ctx.destroy(linger=0)

asyncio.run(main())
"""


def test_regression_closing_a_monitored_socket_never_hangs() -> None:
    """The monitor's receiving socket was closed before the monitor was disabled: an event ZMQ was sending
    meanwhile (a reconnect attempt) blocked its I/O thread on a socket with no peer, holding the lock
    `disable_monitor` waits for: the agent hung on stop, and (on the replay DEALER) in the middle of a gap."""
    import subprocess
    import sys

    try:
        subprocess.run([sys.executable, "-c", _OPEN_AND_CLOSE], timeout=30, check=True)
    except subprocess.TimeoutExpired:
        pytest.fail("opening and closing the agent's sockets hung")
