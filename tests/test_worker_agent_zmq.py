"""The agent's ZMQ source against real sockets: malformed frames, gaps + replay, sequence resets."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from worker_agent.zmq_source import VllmZmqSource

END = b"\xff" * 8


def payload(*hashes: int) -> bytes:
    return msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}], 0])


def frames(seq: int, body: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), body]


class Harness:
    def __init__(self, framing: str = "new", with_replay: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self.framing = framing
        replay_endpoint = None
        if with_replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
            self.replay_task = asyncio.create_task(self._serve_replay())
        self.applied: list[int] = []
        self.resets: list[str] = []
        self.source = VllmZmqSource(f"tcp://127.0.0.1:{port}", self._on_batch, self._on_reset, replay_endpoint,
                                    replay_timeout_s=0.5)
        self.task = asyncio.create_task(self.source.run())

    async def _on_batch(self, batch) -> None:
        self.applied.append(batch.seq)

    async def _on_reset(self, reason: str) -> None:
        self.resets.append(reason)

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                seq8 = seq.to_bytes(8, "big")
                body = [b"", b"", seq8, self.buffer[seq]] if self.framing == "new" else [b"", seq8, self.buffer[seq]]
                await self.router.send_multipart([identity, *body])
            end = [b"", b"", END, b""] if self.framing == "new" else [b"", END, b""]
            await self.router.send_multipart([identity, *end])

    async def publish(self, seq: int, *, live: bool = True) -> None:
        self.buffer[seq] = payload(seq)
        if live:
            await self.pub.send_multipart(frames(seq, self.buffer[seq]))

    async def settle(self, until=lambda: False, timeout: float = 3.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not until() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.task.cancel()
        if hasattr(self, "replay_task"):
            self.replay_task.cancel()
        await asyncio.sleep(0)
        self.source.close()
        self.ctx.destroy(linger=0)


async def test_malformed_and_truncated_frames_are_counted_and_neighbours_applied(caplog) -> None:
    h = Harness(with_replay=False)
    await asyncio.sleep(0.3)  # let the subscription reach the PUB (ZMQ slow joiner)
    try:
        await h.publish(0)
        await h.pub.send_multipart([b"", (1).to_bytes(8, "big")])             # truncated: 2 frames
        await h.pub.send_multipart([b"", b"\x00\x01\x02", payload(1)])        # 3-byte sequence
        await h.pub.send_multipart(frames(1, b"\xc1\xc1\xc1"))                # garbage payload
        await h.pub.send_multipart(frames(1, payload(1)[:-4]))                # truncated payload
        await h.publish(1)
        await h.publish(2)
        await h.settle(lambda: h.applied == [0, 1, 2])
        assert h.applied == [0, 1, 2]
        assert h.source.counters.malformed_frames == 4
        assert h.source.counters.gaps == 0 and h.resets == []
        assert "malformed KV event frame dropped" in caplog.text
    finally:
        await h.close()


@pytest.mark.parametrize("framing", ["new", "old"])
async def test_gap_is_filled_by_replay(framing: str) -> None:
    h = Harness(framing)
    await asyncio.sleep(0.3)
    try:
        await h.publish(0)
        await h.settle(lambda: h.applied == [0])
        await h.publish(1, live=False)  # dropped on the live path, still in the replay buffer
        await h.publish(2, live=False)
        await h.publish(3)
        await h.settle(lambda: h.applied == [0, 1, 2, 3])
        assert h.applied == [0, 1, 2, 3]
        assert h.source.counters.gaps == 1 and h.resets == []
    finally:
        await h.close()


async def test_start_catches_up_from_replay_and_dedupes_live_copies() -> None:
    h = Harness()
    try:
        # Published before the agent connected (slow joiner): only the replay has them.
        for seq in range(3):
            await h.publish(seq, live=False)
        await h.settle(lambda: h.applied == [0, 1, 2])
        await asyncio.sleep(0.3)
        await h.pub.send_multipart(frames(2, h.buffer[2]))  # a live copy of an already replayed batch
        await h.publish(3)
        await h.settle(lambda: h.applied[-1:] == [3])
        assert h.applied == [0, 1, 2, 3]
        assert h.source.counters.duplicate_batches == 1
    finally:
        await h.close()


async def test_sequence_reset_means_engine_restart() -> None:
    h = Harness()
    await asyncio.sleep(0.3)
    try:
        for seq in range(3):
            await h.publish(seq)
        await h.settle(lambda: h.applied == [0, 1, 2])
        h.buffer.clear()  # the restarted engine has a fresh replay buffer
        await h.publish(0)
        await h.settle(lambda: h.resets)
        await h.settle(lambda: h.applied == [0, 1, 2, 0])
        assert h.resets == ["sequence reset"]
        assert h.source.counters.sequence_resets == 1
        assert h.applied == [0, 1, 2, 0]
    finally:
        await h.close()


async def test_unrecoverable_gap_resets_worker_state() -> None:
    h = Harness(with_replay=False)
    await asyncio.sleep(0.3)
    try:
        await h.publish(0)
        await h.publish(5)
        await h.settle(lambda: h.applied == [0, 5])
        assert h.resets == ["gap not recoverable"]
        assert h.source.counters.unrecoverable_gaps == 1
    finally:
        await h.close()
