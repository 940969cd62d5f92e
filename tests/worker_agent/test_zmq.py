"""The agent's ZMQ source against real sockets: a PUB (the engine) and a ROUTER replay server written
here; malformed frames, gaps + replay (both framings, every ZMQ dialect), slow-joiner catch-up,
sequence resets."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.block_keys import prompt_block_keys
from kvroute.worker_agent import sglang_wire, vllm_wire
from kvroute.worker_agent.block_resolver import BlockResolver
from kvroute.worker_agent.vllm_wire import DecodedBatch
from kvroute.worker_agent.zmq_source import ZmqEventSource

END = b"\xff" * 8
MODEL = "tiny"
BS = 4


def root_store(h: int) -> dict:
    """A one-block prompt whose tokens derive from h, so every batch has its own key."""
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": tokens(h),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@dataclass(frozen=True)
class Dialect:
    """An engine release as the source sees it: its payload decoder, its store event, its replay framing."""

    decode: Callable[[int, bytes], DecodedBatch]
    store: Callable[[int], object]
    framing: str


DIALECTS = {
    "vllm-0.33": Dialect(vllm_wire.decode_payload, root_store, "new"),
    "vllm-0.23": Dialect(
        vllm_wire.decode_payload,
        lambda h: ["BlockStored", [h], None, tokens(h), BS, None, "GPU", None, None, 0, "full_attention", None],
        "old",
    ),
    "sglang-0.5.22": Dialect(
        sglang_wire.decode_payload,
        lambda h: {
            "type": "BlockStored",
            "block_hashes": [-h],
            "parent_block_hash": None,
            "token_ids": tokens(h),
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
        },
        "new",
    ),
    "sglang-0.5.13": Dialect(
        sglang_wire.decode_payload, lambda h: ["BlockStored", [-h], None, tokens(h), BS, None, "GPU"], "old"
    ),
    "trtllm-stream": Dialect(vllm_wire.decode_payload, lambda h: {**root_store(h), "mm_keys": [[]]}, "new"),
}


def tokens(h: int) -> list[int]:
    return [h, h + 1, h + 2, h + 3]


def key(h: int) -> int:
    return prompt_block_keys(tokens(h), BS, MODEL)[0]


def payload(*events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def frames(seq: int, body: bytes, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), body]


class Engine:
    """A PUB socket plus a replay ROUTER with a buffer, as vLLM's ZmqEventPublisher. (XPUB is a PUB that
    also reports subscriptions: the tests use that to know the SUB has joined, instead of sleeping.)"""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        framing: str = "new",
        replay: bool = True,
        answer: bool = True,
        pub_connect: str | None = None,
        pub_bind: str | None = None,
        replay_bind: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if pub_connect:
            self.pub.connect(pub_connect)
            self.endpoint = pub_connect
        elif pub_bind:
            bind_when_free(self.pub, pub_bind)
            self.endpoint = pub_bind
        else:
            self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.framing, self.answer = framing, answer
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_bind:
                bind_when_free(self.router, replay_bind)
                self.replay_endpoint = replay_bind
            else:
                self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
            self._task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start8 = await self.router.recv_multipart()
            start = int.from_bytes(start8, "big")
            self.replay_requests.append(start)
            if not self.answer:
                continue
            for seq in sorted(s for s in self.buffer if s >= start):
                seq8 = seq.to_bytes(8, "big")
                body = [b"", b"", seq8, self.buffer[seq]] if self.framing == "new" else [b"", seq8, self.buffer[seq]]
                await self.router.send_multipart([identity, *body])
            end = [b"", b"", END, b""] if self.framing == "new" else [b"", END, b""]
            await self.router.send_multipart([identity, *end])

    async def wait_subscribed(self) -> bytes:
        message = await asyncio.wait_for(self.pub.recv(), 5)
        assert message[:1] == b"\x01"
        return message[1:]  # the topic prefix

    async def publish(self, seq: int, body: bytes, *, live: bool = True) -> None:
        self.buffer[seq] = body
        if live:
            await self.pub.send_multipart(frames(seq, body))

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        if self.replay_endpoint:
            self.router.close(linger=0)

    async def rebind_pub(self) -> None:
        """Drop every subscriber and listen again on the same port (a network blip: same history)."""
        self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        bind_when_free(self.pub, self.endpoint)


def bind_when_free(socket: zmq.Socket, endpoint: str) -> None:
    """Bind a port that a just-closed socket held (ZMQ releases it in its I/O thread, a moment later)."""
    deadline = time.monotonic() + 2
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Agent:
    """The source feeding a real BlockResolver, as the agent wires it."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        bind: bool = False,
        replay_timeout_s: float = 0.5,
        topic: str = "",
        decode=vllm_wire.decode_payload,
    ) -> None:
        self.resolver = BlockResolver(MODEL)
        self.applied: list[int] = []
        self.resets: list[str] = []
        self.source = ZmqEventSource(
            endpoint,
            self._on_batch,
            self._on_reset,
            replay_endpoint,
            bind=bind,
            topic=topic,
            replay_timeout_s=replay_timeout_s,
            context=ctx,
            decode=decode,
        )
        self.task = asyncio.create_task(self.source.run())

    def _on_batch(self, batch: DecodedBatch) -> None:
        self.applied.append(batch.seq)
        self.resolver.apply(batch.events)

    async def _on_reset(self, reason: str) -> None:  # coroutine callbacks work too
        self.resets.append(reason)
        self.resolver.clear()

    def keys(self) -> set[int]:
        return set(self.resolver.held_keys())

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def settle(until, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not until() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def joined(engine: Engine, agent: Agent, seq: int = 0, store=root_store) -> None:
    """Wait for the SUB's subscription, then publish `seq` live (a one-block store of key(1000))."""
    await engine.wait_subscribed()
    await engine.publish(seq, payload(store(1000)))
    await settle(lambda: agent.applied == [seq])
    assert agent.applied == [seq]


async def test_malformed_and_truncated_frames_between_valid_batches(ctx, caplog) -> None:
    """Done-when criterion: bad frames are counted and logged; the valid events around them apply. A payload
    that cannot be decoded carries no sequence number the agent trusts, wherever its seq frame points."""
    caplog.set_level(logging.WARNING, "kvroute.agent.zmq")
    engine = Engine(ctx, replay=False)
    agent = Agent(ctx, engine.endpoint, None)
    try:
        await joined(engine, agent)  # seq 0: key(1000)
        await engine.pub.send_multipart([b"", (1).to_bytes(8, "big")])  # truncated: 2 frames
        await engine.pub.send_multipart([b"", b"\x00\x00\x01", payload(root_store(1))])  # 3-byte sequence frame
        await engine.pub.send_multipart(frames(1, b"\xc1\xc1garbage\xc1"))  # garbage payload (seq 1 not used up)
        await engine.pub.send_multipart(frames(7, payload(root_store(2))[:-7]))  # truncated payload: no gap to 7
        await engine.publish(
            1, payload(root_store(30), ["BlockStored", "broken"], {"type": "NewEvent"}, {**root_store(31), "new_field": [1]})
        )
        await engine.publish(2, payload(root_store(40)))
        await settle(lambda: agent.applied == [0, 1, 2])
        assert agent.applied == [0, 1, 2]
        assert agent.keys() == {key(1000), key(30), key(31), key(40)}  # neighbours of the bad event applied too
        c = agent.source.counters
        assert (c.malformed_frames, c.malformed_events, c.unknown_events, c.unknown_fields) == (4, 1, 1, 1)
        assert c.gaps == 0 and c.sequence_resets == 0 and agent.resets == [] and agent.source.last_seq == 2
        log = caplog.text
        assert "malformed KV event frame dropped: expected 3 frames (topic, seq, payload), got 2" in log
        assert "malformed KV event frame dropped: sequence frame must be 8 bytes, got 3" in log
        assert "malformed KV event batch (seq frame 1) dropped: payload is not msgpack" in log
        assert "(seq frame 7) dropped" not in log  # a second payload error within 5 s: rate-limited (still counted)
        assert "KV event batch seq 1: 1 malformed events skipped" in log
        assert "unknown event types ['NewEvent'] skipped" in log
        assert "KV event batch seq 1: fields not known to this agent dropped (event 3: $.new_field)" in log
    finally:
        await agent.close()
        await engine.close()


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_gap_is_filled_by_replay(ctx, dialect: str) -> None:
    d = DIALECTS[dialect]
    engine = Engine(ctx, d.framing)
    engine.answer = False  # no replay answers until the subscription is up
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint, replay_timeout_s=0.2, decode=d.decode)
    try:
        await joined(engine, agent, store=d.store)
        engine.answer = True
        await engine.publish(1, payload(d.store(10)), live=False)  # dropped on the live path (HWM), still buffered
        await engine.publish(2, payload(d.store(20)), live=False)
        await engine.publish(3, payload(d.store(30)))
        await settle(lambda: agent.applied[-1:] == [3])
        assert agent.applied == [0, 1, 2, 3]
        assert engine.replay_requests[-1] == 1  # asked from last + 1
        assert agent.keys() == {key(1000), key(10), key(20), key(30)}
        c = agent.source.counters
        assert c.gaps == 1 and c.unrecoverable_gaps == 0 and c.replayed_batches == 2 and agent.resets == []
        assert c.malformed_frames == 0 and c.malformed_events == 0
    finally:
        await agent.close()
        await engine.close()


async def test_replay_that_no_longer_holds_the_gap_resets_state(ctx) -> None:
    engine = Engine(ctx)
    engine.answer = False
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint, replay_timeout_s=0.2)
    try:
        await joined(engine, agent)
        engine.answer = True
        engine.buffer.clear()
        await engine.publish(2, payload(root_store(20)), live=False)  # seq 1 fell out of the replay buffer
        await engine.publish(3, payload(root_store(30)))
        await settle(lambda: agent.applied[-1:] == [3])
        assert agent.resets == ["gap not recoverable"] and agent.source.counters.unrecoverable_gaps == 1
        assert agent.applied == [0, 2, 3]  # what is left still applies, on a cleared state
        assert agent.keys() == {key(20), key(30)}
    finally:
        await agent.close()
        await engine.close()


async def test_gap_without_replay_endpoint_resets_state(ctx) -> None:
    engine = Engine(ctx, replay=False)
    agent = Agent(ctx, engine.endpoint, None)
    try:
        await joined(engine, agent)
        await engine.publish(5, payload(root_store(50)))
        await settle(lambda: agent.applied[-1:] == [5])
        assert agent.resets == ["gap not recoverable"] and agent.keys() == {key(50)}
        assert agent.source.counters.gaps == 1 and agent.source.counters.unrecoverable_gaps == 1
    finally:
        await agent.close()
        await engine.close()


async def test_replay_timeout_gives_up_and_keeps_reading(ctx) -> None:
    engine = Engine(ctx, answer=False)  # a ROUTER that never answers
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint, replay_timeout_s=0.2)
    try:
        await joined(engine, agent)
        await engine.publish(3, payload(root_store(30)))
        await engine.publish(4, payload(root_store(40)))
        await settle(lambda: agent.applied[-1:] == [4])
        assert agent.applied == [0, 3, 4] and agent.resets == ["gap not recoverable"]
        assert agent.source.counters.replay_timeouts >= 2  # start-up catch-up + the gap
        assert agent.keys() == {key(30), key(40)}
    finally:
        await agent.close()
        await engine.close()


async def test_start_catches_up_from_replay_and_drops_live_copies(ctx) -> None:
    engine = Engine(ctx)
    for seq in range(3):  # published before the agent started (slow joiner): only the replay has them
        await engine.publish(seq, payload(root_store(seq * 10 + 5)), live=False)
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint)
    try:
        await settle(lambda: agent.applied == [0, 1, 2])
        assert engine.replay_requests == [0]
        await engine.wait_subscribed()
        await engine.pub.send_multipart(frames(2, engine.buffer[2]))  # live copy of a replayed batch
        await engine.publish(3, payload(root_store(35)))
        await settle(lambda: agent.applied[-1:] == [3])
        assert agent.applied == [0, 1, 2, 3]
        assert agent.source.counters.duplicate_batches == 1 and agent.resets == []
        assert agent.keys() == {key(5), key(15), key(25), key(35)}
    finally:
        await agent.close()
        await engine.close()


async def test_first_live_batch_after_missed_ones_catches_up_from_zero(ctx) -> None:
    engine = Engine(ctx)  # nothing buffered when the agent starts: the start-up replay is empty
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint)
    try:
        await settle(lambda: engine.replay_requests == [0])
        await engine.wait_subscribed()
        await engine.publish(0, payload(root_store(5)), live=False)
        await engine.publish(1, payload(root_store(15)), live=False)
        await engine.publish(2, payload(root_store(25)))
        await settle(lambda: agent.applied[-1:] == [2])
        assert engine.replay_requests == [0, 0] and agent.applied == [0, 1, 2]
        assert agent.source.counters.gaps == 0 and agent.keys() == {key(5), key(15), key(25)}
    finally:
        await agent.close()
        await engine.close()


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_sequence_reset_clears_state_and_replays_the_new_engine_from_zero(ctx, dialect: str) -> None:
    d = DIALECTS[dialect]
    engine = Engine(ctx, d.framing)
    engine.answer = False
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint, replay_timeout_s=0.2, decode=d.decode)
    try:
        await joined(engine, agent, store=d.store)
        engine.answer = True
        for seq in range(1, 5):
            await engine.publish(seq, payload(d.store(seq * 10)))
        await settle(lambda: agent.applied[-1:] == [4])
        assert agent.keys() == {key(1000), key(10), key(20), key(30), key(40)}
        engine.buffer.clear()  # the engine restarted: fresh counter, fresh replay buffer
        await engine.publish(0, payload(d.store(7)), live=False)
        await engine.publish(1, payload(d.store(8)))
        await settle(lambda: agent.applied[-1:] == [1] and len(agent.applied) > 6)
        assert agent.resets == ["sequence reset"] and agent.source.counters.sequence_resets == 1
        assert agent.applied == [0, 1, 2, 3, 4, 0, 1]
        assert agent.keys() == {key(7), key(8)}  # nothing of the old engine's state survives
    finally:
        await agent.close()
        await engine.close()


async def test_malformed_replay_messages_are_counted(ctx) -> None:
    engine = Engine(ctx, replay=False)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    good = payload(root_store(10))

    async def serve() -> None:
        while True:
            identity, _, start8 = await router.recv_multipart()
            if int.from_bytes(start8, "big") == 0:
                await router.send_multipart([identity, b"", END, b""])
                continue
            await router.send_multipart([identity, b"", b"x", b"y", b"z", b"w"])  # 4 frames after delimiter
            await router.send_multipart([identity, b"", b"\x01", good])  # short seq
            await router.send_multipart([identity, b"", (1).to_bytes(8, "big"), good])
            await router.send_multipart([identity, b"", (1).to_bytes(8, "big"), good])  # duplicate: deduped
            await router.send_multipart([identity, b"", (2).to_bytes(8, "big"), b"\xc1"])  # garbage: not seq 2
            await router.send_multipart([identity, b"", (2).to_bytes(8, "big"), payload(root_store(20))])  # seq 2
            await router.send_multipart([identity, b"", END, b""])

    task = asyncio.create_task(serve())
    agent = Agent(ctx, engine.endpoint, replay_endpoint)
    try:
        await joined(engine, agent)
        await engine.publish(3, payload(root_store(30)))
        await settle(lambda: agent.applied[-1:] == [3])
        assert agent.applied == [0, 1, 2, 3] and agent.resets == []  # the readable copy of seq 2 filled the gap
        assert agent.source.counters.malformed_frames == 3
        assert agent.keys() == {key(1000), key(10), key(20), key(30)}
    finally:
        task.cancel()
        await agent.close()
        await engine.close()


async def test_bind_mode_for_a_connecting_vllm(ctx) -> None:
    # vLLM connects its PUB when the endpoint has no '*' (docs/wire-formats.md#sockets-and-bind-rules): the agent's SUB binds.
    agent = Agent(ctx, "tcp://127.0.0.1:0", None, bind=True, topic="kv@w1")
    await agent.source.ready.wait()
    assert agent.source.bound_endpoint and agent.source.bound_endpoint != "tcp://127.0.0.1:0"
    engine = Engine(ctx, replay=False, pub_connect=agent.source.bound_endpoint)
    try:
        assert await engine.wait_subscribed() == b"kv@w1"
        await engine.pub.send_multipart(frames(0, payload(root_store(2)), topic=b"other"))  # filtered by topic prefix
        await engine.pub.send_multipart(frames(0, payload(root_store(1)), topic=b"kv@w1@tiny"))
        await settle(lambda: agent.applied)
        await asyncio.sleep(0.1)
        assert agent.applied == [0] and agent.keys() == {key(1)}
    finally:
        await agent.close()
        await engine.close()


async def test_holes_in_a_replay_only_the_batches_after_the_last_hole_apply(ctx) -> None:
    engine = Engine(ctx)
    for seq in (0, 1, 3, 4):  # seq 2 lost (e.g. truncated by the ROUTER's send HWM)
        await engine.publish(seq, payload(root_store(seq * 10 + 1)), live=False)
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint)
    try:
        await settle(lambda: agent.applied == [3, 4])
        assert agent.applied == [3, 4] and agent.resets == []  # state was empty: nothing to reset
        assert agent.source.counters.incomplete_catch_ups == 1 and agent.keys() == {key(31), key(41)}
        await engine.wait_subscribed()
        for seq in (6, 8):  # gap [5, 9) where the replay buffer lacks 5 and 7
            await engine.publish(seq, payload(root_store(seq * 10 + 1)), live=False)
        await engine.publish(9, payload(root_store(91)))
        await settle(lambda: agent.applied[-1:] == [9])
        assert agent.applied == [3, 4, 8, 9] and agent.resets == ["gap not recoverable"]
        assert agent.source.counters.unrecoverable_gaps == 1 and agent.keys() == {key(81), key(91)}
    finally:
        await agent.close()
        await engine.close()


# ---------------------------------------------------------------- (re)connections


async def test_agent_started_before_the_engine_catches_up_when_the_publisher_comes_up(ctx) -> None:
    """The catch-up is asked when the SUB's connection is made, not when the socket is created: a
    catch-up answered before the engine's first events, followed by a subscription that takes effect
    only after them, would lose them with no later batch to reveal the gap."""
    engine = Engine(ctx)
    engine.pub.close(linger=0)  # nothing listens on the PUB port yet; the replay socket already answers
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint)
    try:
        await agent.source.ready.wait()
        await asyncio.sleep(0.3)  # the agent runs a while before the engine publishes
        for seq in range(3):  # before any subscriber is connected: only the replay buffer has them
            await engine.publish(seq, payload(root_store(seq * 10 + 3)), live=False)
        await engine.rebind_pub()
        await settle(lambda: agent.applied == [0, 1, 2])
        # (The closing PUB may still take one connection, whose catch-up finds the buffer empty.)
        assert agent.applied == [0, 1, 2] and set(engine.replay_requests) == {0}
        assert agent.keys() == {key(3), key(13), key(23)} and agent.resets == []
    finally:
        await agent.close()
        await engine.close()


async def test_reconnect_to_the_same_publisher_replays_what_was_missed(ctx) -> None:
    engine = Engine(ctx)
    agent = Agent(ctx, engine.endpoint, engine.replay_endpoint)
    try:
        await joined(engine, agent)
        await engine.publish(1, payload(root_store(10)))
        await settle(lambda: agent.applied[-1:] == [1])
        await engine.rebind_pub()  # the connection drops; meanwhile seq 2 and 3 go out to nobody
        await engine.publish(2, payload(root_store(20)), live=False)
        await engine.publish(3, payload(root_store(30)), live=False)
        await settle(lambda: agent.applied[-1:] == [3])
        assert agent.applied == [0, 1, 2, 3] and agent.resets == []
        counters = agent.source.counters
        assert counters.reconnects == 1 and counters.reconnect_resets == 0 and engine.replay_requests[-1] == 1
        await engine.wait_subscribed()
        await engine.publish(4, payload(root_store(40)))
        await settle(lambda: agent.applied[-1:] == [4])
        assert agent.keys() == {key(1000), key(10), key(20), key(30), key(40)}
    finally:
        await agent.close()
        await engine.close()


@pytest.mark.parametrize("published", [0, 5], ids=["silent", "counter-already-ahead"])
async def test_reconnect_to_a_restarted_engine_resets_the_worker(ctx, published: int) -> None:
    """A restarted engine may publish nothing at all yet, or already be past our last seq (the SUB
    rejoined late): the sequence rules alone would keep the old blocks, the reconnect check does not."""
    first = Engine(ctx)
    agent = Agent(ctx, first.endpoint, first.replay_endpoint)
    try:
        await joined(first, agent)
        await first.publish(1, payload(root_store(10)))
        await settle(lambda: agent.applied[-1:] == [1])
        endpoints = (first.endpoint, first.replay_endpoint)
        await first.close()  # the engine process exits
        second = Engine(ctx, pub_bind=endpoints[0], replay_bind=endpoints[1])
        for seq in range(published):  # the new process's events from before the SUB rejoined
            await second.publish(seq, payload(root_store(seq * 10 + 7)), live=False)
        await settle(lambda: agent.source.counters.reconnect_resets == 1)
        await settle(lambda: len(agent.applied) == 2 + published)
        assert agent.resets == ["publisher restarted"] and agent.source.counters.reconnects == 1
        assert agent.keys() == {key(seq * 10 + 7) for seq in range(published)}
        if published:  # the next live batch continues the new history
            await second.wait_subscribed()
            await second.publish(published, payload(root_store(99)))
            await settle(lambda: agent.applied[-1:] == [published])
            assert agent.keys() == {key(seq * 10 + 7) for seq in range(published)} | {key(99)}
            assert agent.source.counters.sequence_resets == 0 and agent.source.counters.gaps == 0
        await second.close()
    finally:
        await agent.close()
