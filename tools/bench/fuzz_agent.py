"""The agent target of `kvroute bench fuzz`: a real control plane and a real agent process, and this
process as a hostile engine on the agent's KV-event endpoint (an XPUB the agent's SUB connects to, as
to vLLM's `tcp://*:5557`) and its replay ROUTER.

What goes out, in a seeded random order:
- valid batches with consecutive sequence numbers (vLLM 0.26 map events written by the sim engine's
  encoder): root prompts stored, earlier ones removed, now and then a malformed event, an unknown
  event type or an unknown field inside;
- bad messages: wrong frame counts, sequence frames of the wrong length, random payloads under any
  sequence number, corrupted copies of valid batches (sent before the real one, or instead of it:
  a real gap the replay must fill), batches with more events than the agent's limit, and a few
  frames over the agent's frame limit (ZMQ then drops the connection; the agent must connect again);
- on every replay request, junk replies (bad framing, an unreadable copy) before the real batches.

Then: the agent is alive and answers /health within 1 s, the control plane holds exactly the keys
of the valid events (GetWorkerKeys against keys computed here from the tokens sent), and every bad
message is in the agent's counters, with no reset, gap left unfilled or internal error.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.block_keys import prompt_block_keys
from kvroute.listeners import start_status_site
from kvroute.prom_text import samples
from kvroute.tools.bench.fuzz import FuzzReport
from kvroute.tools.local_cluster import LocalCluster, ManagedProcess, free_port, http_get, kvroute_argv, wait_until
from kvroute.tools.sim_engine.dialects import get_dialect
from kvroute.tools.sim_engine.prefix_cache import RemovedEvent, StoredEvent
from kvroute.tools.sim_engine.wire_encoding import MsgpackEventEncoder
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from kvroute.worker_agent import vllm_wire
from kvroute.worker_agent.msgpack_wire import OversizeBatchError, WireFormatError

MODEL, WORKER, BLOCK_SIZE = "fuzz-model", "fuzz-0", 4
MAX_FRAME_BYTES = 64 << 10  # the agent's --kv-events-max-frame-bytes here: small, so oversize frames are cheap
MAX_BATCH_EVENTS = 256  # its --kv-events-max-batch-events
BAD_PER_VALID = 4  # about one valid batch per this many bad messages
OVERSIZE_FRAMES = 3  # each costs the agent a reconnect (~0.5 s)
END_SEQ = b"\xff" * 8
ENCODER = MsgpackEventEncoder(get_dialect("vllm-0.26"), BLOCK_SIZE)
# Counters that must stay 0: nothing bad may cost the worker its state.
MUST_BE_ZERO = ("state_resets", "unrecoverable_gaps", "sequence_resets", "reconnect_resets", "callback_errors", "rank_mismatches")


def undecodable(payload: bytes) -> bool:
    """Whether the agent counts this payload as malformed (not as too many events: a corrupted header can claim that)."""
    try:
        vllm_wire.decode_payload(0, payload, max_events=MAX_BATCH_EVENTS)
    except OversizeBatchError:
        return False
    except WireFormatError:
        return True
    return False


class Traffic:
    """Valid batches, and the block keys the control plane must hold once they applied."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_hash = 1
        self.chains: list[tuple[list[int], list[int]]] = []  # (engine hashes, kvroute keys) of held prompts
        self.expected: set[int] = set()
        self.counts: Counter[str] = Counter()  # events sent, and the bad ones inside batches

    def _store(self) -> dict:
        n = self.rng.randint(1, 3)
        tokens = [self.rng.randrange(50_000) for _ in range(n * BLOCK_SIZE)]
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        keys = prompt_block_keys(tokens, BLOCK_SIZE, MODEL)
        self.chains.append((hashes, keys))
        self.expected.update(keys)
        return msgspec.to_builtins(ENCODER.to_wire(StoredEvent(hashes, None, tokens)))

    def batch(self) -> bytes:
        rng, events = self.rng, []
        for _ in range(rng.randint(1, 3)):
            events.append(self._store())
        if self.chains and rng.random() < 0.3:
            hashes, keys = self.chains.pop(rng.randrange(len(self.chains)))
            self.expected.difference_update(keys)
            events.append(msgspec.to_builtins(ENCODER.to_wire(RemovedEvent(hashes))))
        self.counts["events"] += len(events)
        roll = rng.random()
        if roll < 0.1:
            events.insert(rng.randrange(len(events) + 1), {"type": "BlockStored", "block_hashes": "not a list"})
            self.counts["malformed_events"] += 1
        elif roll < 0.15:
            events.insert(rng.randrange(len(events) + 1), {"type": "BlockPinned", "block_hashes": [1]})
            self.counts["unknown_events"] += 1
        elif roll < 0.2:
            events.append({**self._store(), "pinned_until": 12})  # a field of a newer release: the store applies
            self.counts["unknown_fields"] += 1
            self.counts["events"] += 1
        return msgspec.msgpack.encode([time.time(), events, 0])


class HostileEngine:
    """An XPUB the agent's SUB connects to, and a replay ROUTER that answers from the true buffer after junk."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # keep every message: the counts must be exact
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report a resubscription even before the old connection's end
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # a long answer whole (ZMQ's 1000 cut vLLM's short before 0.33)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self.junk_sent = 0
        self.replay_requests = 0
        self._task = asyncio.create_task(self._serve_replay())
        self._http: web.AppRunner | None = None

    async def serve_models(self) -> str:
        """The engine's `GET /v1/models` (an agent registers its worker only while its engine answers
        there); its other endpoints stay absent: the agent's load polls fail and are counted. Returns the URL."""

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        self._http, port = await start_status_site("--engine-url", "127.0.0.1", 0, {"/v1/models": models})
        return f"http://127.0.0.1:{port}"

    async def subscribed(self, timeout: float = 30.0) -> None:
        """Until a subscriber (re)subscribes (an XPUB also reports one that left)."""
        while (await asyncio.wait_for(self.pub.recv(), timeout))[:1] != b"\x01":
            pass

    async def send(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)
        await asyncio.sleep(0)  # a send that completes at once does not yield: let the replay server answer

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests += 1
            junk = [[b"", b"x", b"y", b"z", b"w"], [b"", b"\x01", b"x"], [b"", b"", start.to_bytes(8, "big"), b"\xc1"]]
            for message in junk:
                await self.router.send_multipart([identity, *message])
            self.junk_sent += len(junk)
            for seq in sorted(s for s in self.buffer if s >= start):
                await self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._http is not None:
            await self._http.cleanup()
        self.pub.close(linger=0)
        self.router.close(linger=0)


class Fuzzer:
    def __init__(self, engine: HostileEngine, rng: random.Random, metrics_url: str) -> None:
        self.engine, self.rng, self.metrics_url = engine, rng, metrics_url
        self.traffic = Traffic(rng)
        self.seq = 0
        self.sent: Counter[str] = Counter()  # bad messages by the agent counter that must count them

    # ------------------------------------------------------------------ valid batches

    async def valid(self, fate: str = "live") -> None:
        payload = self.traffic.batch()
        seq8 = self.seq.to_bytes(8, "big")
        self.engine.buffer[self.seq] = payload  # the engine's replay buffer holds it whatever happens live
        if fate == "doubled":  # a corrupted copy first, then the real one
            await self.engine.send([b"", seq8, self.corrupted(payload)])
            self.sent["malformed_frames"] += 1
        if fate == "replaced":  # only a corrupted copy: the next batch reveals the gap, the replay fills it
            await self.engine.send([b"", seq8, self.corrupted(payload)])
            self.sent["malformed_frames"] += 1
        else:
            await self.engine.send([b"", seq8, payload])
        self.sent["valid"] += 1
        self.seq += 1

    def corrupted(self, payload: bytes) -> bytes:
        rng = self.rng
        for _ in range(8):
            at = rng.randrange(len(payload))
            bad = payload[:at] + bytes([payload[at] ^ rng.randrange(1, 256)]) + payload[at + 1 :]
            if undecodable(bad):
                return bad
        return payload[: rng.randrange(1, len(payload))]  # a truncated batch never decodes

    # ------------------------------------------------------------------ bad messages

    async def bad(self) -> None:
        rng = self.rng
        kind = rng.choice(("frames", "seq", "random", "random", "corrupt", "big"))
        if kind == "frames":
            frames = [rng.randbytes(rng.randrange(33)) for _ in range(rng.choice((1, 2, 4, 5)))]
        elif kind == "seq":
            frames = [b"", rng.randbytes(rng.choice((0, 1, 4, 7, 9, 16))), rng.randbytes(rng.randrange(33))]
        elif kind == "random":
            payload = rng.randbytes(rng.randrange(1, 65))
            frames = [rng.randbytes(rng.randrange(5)), rng.randbytes(8), payload if undecodable(payload) else b"\xc1" + payload]
        elif kind == "corrupt":  # a corrupted copy of a batch sent earlier, under the next seq or any
            original = self.engine.buffer[rng.randrange(self.seq)] if self.seq else msgspec.msgpack.encode([1.0, [], 0])
            frames = [b"", rng.choice((self.seq, rng.getrandbits(64))).to_bytes(8, "big"), self.corrupted(original)]
        else:  # a well-formed batch with more events than the agent takes, under the next valid seq
            events = [["AllBlocksCleared"]] * (MAX_BATCH_EVENTS + 1 + rng.randrange(100))
            frames = [b"", self.seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])]
            await self.engine.send(frames)
            self.sent["oversize_batches"] += 1
            return
        await self.engine.send(frames)
        self.sent["malformed_frames"] += 1

    async def oversize_frame(self) -> None:
        """A frame over the agent's limit: ZMQ drops the connection, the agent must connect again. Everything
        sent before is first let through, so that the counts stay exact."""
        await self.valid()
        await self.caught_up()
        await self.engine.send([b"", self.seq.to_bytes(8, "big"), b"\x00" * (MAX_FRAME_BYTES + 1)])
        self.sent["oversize_frames"] += 1
        await self.engine.subscribed()
        await self.caught_up()  # its reconnect check has replayed: what follows goes out live again

    # ------------------------------------------------------------------ the agent's view

    async def counters(self) -> dict[str, float]:
        try:
            status, body = await asyncio.to_thread(http_get, self.metrics_url + "/metrics", 2.0)
        except OSError:
            return {}
        if status != 200:
            return {}
        sums: dict[str, float] = {}
        for sample in samples(body.decode()):
            if sample.name.startswith("kvroute_agent_"):
                name = sample.name[len("kvroute_agent_") :].removesuffix("_total")
                sums[name] = sums.get(name, 0.0) + sample.value
        return sums

    def expected_malformed_frames(self) -> int:
        return self.sent["malformed_frames"] + self.engine.junk_sent

    async def caught_up(self, timeout: float = 60.0) -> dict[str, float]:
        """Until the agent applied the last valid batch and counted every bad message sent so far."""
        deadline = time.monotonic() + timeout
        while True:
            c = await self.counters()
            if (
                c.get("last_seq") == self.seq - 1
                and c.get("malformed_frames") == self.expected_malformed_frames()
                and c.get("oversize_batches", 0) == self.sent["oversize_batches"]
            ):
                return c
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"agent did not catch up: last_seq {c.get('last_seq')} (want {self.seq - 1}), "
                    f"malformed_frames {c.get('malformed_frames')} (want {self.expected_malformed_frames()})"
                )
            await asyncio.sleep(0.05)


def control_plane_keys(address: str) -> set[int] | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.ControlPlaneStub(channel).GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id=WORKER), timeout=2)
        except grpc.RpcError:
            return None
    return {k for tier in reply.tiers if tier.tier == pb.TIER_GPU for k in tier.block_keys}


async def drive(
    cluster: LocalCluster, agent: ManagedProcess, engine: HostileEngine, metrics_url: str, messages: int, seed: int
) -> FuzzReport:
    started = time.monotonic()
    rng = random.Random(seed)
    fuzzer = Fuzzer(engine, rng, metrics_url)
    await engine.subscribed()
    await asyncio.to_thread(
        wait_until, lambda: any(w.worker_id == WORKER for w in cluster.list_workers()), 30, "the agent registered", [agent]
    )
    oversize_at = {messages * (k + 1) // (OVERSIZE_FRAMES + 1) for k in range(OVERSIZE_FRAMES)} if messages >= 100 else set()
    for i in range(messages):
        if i % BAD_PER_VALID == 0:
            await fuzzer.valid(rng.choices(("live", "doubled", "replaced"), (0.9, 0.05, 0.05))[0])
        if i in oversize_at:
            await fuzzer.oversize_frame()
        else:
            await fuzzer.bad()
    await fuzzer.valid()  # the last one is live: any gap before it is revealed and filled
    sent_at = time.monotonic()
    counters = await fuzzer.caught_up()
    caught_up_at = time.monotonic()
    expected = fuzzer.traffic.expected
    deadline = time.monotonic() + 30
    held = None
    while time.monotonic() < deadline:
        held = await asyncio.to_thread(control_plane_keys, cluster.control_plane_addr)
        if held == expected:
            break
        await asyncio.sleep(0.1)
    timings = {
        "send_s": round(sent_at - started, 2),
        "agent_catch_up_s": round(caught_up_at - sent_at, 2),
        "control_plane_s": round(time.monotonic() - caught_up_at, 2),
    }
    health_started = time.monotonic()
    try:
        status, _ = await asyncio.to_thread(http_get, metrics_url + "/health", 1.0)
        health_ms = (time.monotonic() - health_started) * 1000 if status == 200 else float("inf")
    except OSError:
        health_ms = float("inf")
    counters = await fuzzer.counters()
    sent, counts = fuzzer.sent, fuzzer.traffic.counts
    bad_expected = {
        "malformed_frames": fuzzer.expected_malformed_frames(),
        "oversize_frames": sent["oversize_frames"],
        "oversize_batches": sent["oversize_batches"],
        "malformed_events": counts["malformed_events"],
        "unknown_events": counts["unknown_events"],
        "unknown_fields": counts["unknown_fields"],
        **dict.fromkeys(MUST_BE_ZERO, 0),
    }
    bad = sent["malformed_frames"] + sent["oversize_frames"] + sent["oversize_batches"]
    crashes = sum(not p.alive() for p in (agent, cluster.control_plane))
    return FuzzReport(
        target="agent-zmq",
        messages=bad + sent["valid"],
        bad_messages=bad,
        valid_messages=sent["valid"],
        valid_events=counts["events"],
        applied=held == expected,
        bad_counted={name: int(counters.get(name, -1)) for name in bad_expected},
        bad_expected=bad_expected,
        crashes=crashes,
        health_ms=round(health_ms, 1),
        seconds=round(time.monotonic() - started, 1),
        details={
            "keys_expected": len(expected),
            "keys_held": None if held is None else len(held),
            "replay_requests": engine.replay_requests,
            "replay_junk_sent": engine.junk_sent,
            "gaps_filled": int(counters.get("gaps", 0)),
            "reconnects": int(counters.get("reconnects", 0)),
            "max_frame_bytes": MAX_FRAME_BYTES,
            "max_batch_events": MAX_BATCH_EVENTS,
            **timings,
        },
    )


def run_fuzz(messages: int, seed: int, workdir: Path) -> FuzzReport:
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=workdir, model=MODEL, block_size=BLOCK_SIZE)
    agent: ManagedProcess | None = None

    async def main() -> FuzzReport:
        nonlocal agent
        ctx = zmq.asyncio.Context()
        engine = HostileEngine(ctx)
        engine_url = await engine.serve_models()
        metrics_port = free_port()
        agent = ManagedProcess(
            "agent",
            kvroute_argv(
                "agent",
                "--control-plane",
                cluster.control_plane_addr,
                "--engine",
                "vllm",
                "--kv-events",
                f"tcp://127.0.0.1:{engine.port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{engine.replay_port}",
                "--engine-url",
                engine_url,
                "--worker-id",
                WORKER,
                "--model",
                MODEL,
                "--block-size",
                str(BLOCK_SIZE),
                "--metrics-port",
                str(metrics_port),
                "--kv-events-max-frame-bytes",
                str(MAX_FRAME_BYTES),
                "--kv-events-max-batch-events",
                str(MAX_BATCH_EVENTS),
            ),
            workdir / "agent.log",
        )
        agent.start()
        try:
            return await drive(cluster, agent, engine, f"http://127.0.0.1:{metrics_port}", messages, seed)
        finally:
            await engine.close()
            ctx.destroy(linger=0)

    try:
        cluster.start_control_plane()
        return asyncio.run(main())
    finally:
        if agent is not None:
            agent.stop()
        cluster.stop()
