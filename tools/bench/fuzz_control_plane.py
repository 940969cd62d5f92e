"""The control-plane target of `kvroute bench fuzz`: a control plane process, one valid agent stream held
open by this process (worker `fuzz-valid`: a snapshot, then batches with consecutive seqs of stored,
removed and cleared blocks, and heartbeats), and, between its batches, hostile calls on every method
of the control plane's gRPC port, each on its own call or stream:

- bytes that are not the method's message (corrupt wire format, strings that are not UTF-8), alone or
  after a valid first message: INVALID_ARGUMENT;
- Connect: registrations without worker id, model or block size, or with an endpoint that is no http(s)
  URL (INVALID_ARGUMENT), a batch or heartbeat
  before registering, a second register, a batch out of sequence (FAILED_PRECONDITION), the valid
  worker's id from another agent (ALREADY_EXISTS), a heartbeat with a kv_usage outside 0..1 or NaN
  (INVALID_ARGUMENT);
- RouterSession: no hello first, a second hello (FAILED_PRECONDITION), an empty router id, a query
  with a block size 0 or one twice, a reservation without a worker, an empty message (INVALID_ARGUMENT);
- Query with those chains (INVALID_ARGUMENT), GetWorkerKeys of no worker (NOT_FOUND);
- random bytes on any method: any status but UNKNOWN, INTERNAL, UNAVAILABLE or DEADLINE_EXCEEDED;
- valid Query and ListWorkers calls, which must answer OK.

Every 500 bad inputs and at the end, once the valid batches are acknowledged, the valid worker must hold
exactly the keys its batches left (GetWorkerKeys, every tier) and no other worker any block; at the
end the control plane must be alive and answer its gRPC health check within 1 s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.tools.bench.fuzz import FuzzReport, Outcomes, unparseable_bytes
from kvroute.tools.local_cluster import LocalCluster
from kvroute.v1 import kvroute_pb2 as pb

MODEL, WORKER, BLOCK_SIZE = "fuzz-model", "fuzz-valid", 4
BAD_PER_VALID = 4
CHECK_EVERY = 500  # bad inputs between two comparisons of the index with what the valid agent sent
TIMEOUT_S = 10.0
SERVICE = "/kvroute.v1.ControlPlane/"
I, FP, NF, AE, OK = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OK,
)
_BAD_CODES = frozenset(
    {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
)
_TIERS = (pb.TIER_GPU, pb.TIER_GPU, pb.TIER_GPU, pb.TIER_CPU, pb.TIER_DISK)


class ValidAgent:
    """One Connect stream for `fuzz-valid`: batches with consecutive seqs, heartbeats, and the keys the
    control plane must hold for it once they are acknowledged."""

    def __init__(self, channel: grpc.aio.Channel, rng: random.Random) -> None:
        self.rng = rng
        self.outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self.held: dict[int, set[int]] = {t: set() for t in (pb.TIER_GPU, pb.TIER_CPU, pb.TIER_DISK)}
        self.seq = 0
        self.acked = 0
        self.batches_events = 0
        self.acks = asyncio.Condition()
        self.call = channel.stream_stream(
            SERVICE + "Connect",
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.ControlMessage.FromString,
        )(self._messages(), timeout=3600)
        self.reader = asyncio.create_task(self._read())
        self.heartbeats = asyncio.create_task(self._heartbeat())

    async def _messages(self):
        yield pb.AgentMessage(
            register=pb.RegisterWorker(
                worker_id=WORKER,
                model=MODEL,
                engine="sim",
                block_size=BLOCK_SIZE,
                endpoint="http://127.0.0.1:9",
                agent_instance="fuzz",
            )
        )
        while (message := await self.outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        async for reply in self.call:
            if reply.WhichOneof("body") == "ack":
                async with self.acks:
                    self.acked = reply.ack.seq
                    self.acks.notify_all()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(0.3)
            self.outbox.put_nowait(
                pb.AgentMessage(
                    heartbeat=pb.Heartbeat(
                        load=pb.WorkerLoad(running_requests=self.rng.randrange(10), kv_usage=self.rng.random())
                    )
                )
            )

    def batch(self) -> None:
        rng = self.rng
        self.seq += 1
        batch = pb.EventBatch(seq=self.seq, snapshot=self.seq == 1)
        for _ in range(rng.randint(1, 4)):
            roll, tier = rng.random(), rng.choice(_TIERS)
            if roll < 0.6 or not self.held[tier] or batch.snapshot:  # a snapshot is its stores (the state)
                keys = [rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
                batch.events.add(stored=pb.BlocksStored(block_keys=keys, tier=tier))
                self.held[tier].update(keys)
            elif roll < 0.995:
                keys = rng.sample(sorted(self.held[tier]), min(len(self.held[tier]), rng.randint(1, 4)))
                keys.append(rng.getrandbits(64))  # one it never stored: removing it is a no-op
                batch.events.add(removed=pb.BlocksRemoved(block_keys=keys, tier=tier))
                self.held[tier].difference_update(keys)
            else:
                batch.events.add(cleared=pb.AllBlocksCleared())
                for keys in self.held.values():
                    keys.clear()
        self.batches_events += len(batch.events)
        self.outbox.put_nowait(pb.AgentMessage(batch=batch))

    async def all_acked(self, timeout: float = 30.0) -> bool:
        async with self.acks:
            try:
                await asyncio.wait_for(self.acks.wait_for(lambda: self.acked == self.seq), timeout)
            except TimeoutError:
                return False
        return True

    async def close(self) -> None:
        self.heartbeats.cancel()
        self.outbox.put_nowait(None)
        self.call.cancel()
        await asyncio.gather(self.reader, self.heartbeats, return_exceptions=True)


@dataclass
class Call:
    kind: str
    method: str
    messages: list[bytes]  # one for a unary method; the stream's messages otherwise
    expect: frozenset | None  # allowed statuses; None: any but UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED

    @property
    def streaming(self) -> bool:
        return self.method in ("Connect", "RouterSession")


def _agent(**body) -> bytes:
    return pb.AgentMessage(**body).SerializeToString()


def _router(**body) -> bytes:
    return pb.RouterMessage(**body).SerializeToString()


class HostileTraffic:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.hostile_ids = 0

    def hostile_register(self, **changes) -> pb.RegisterWorker:
        self.hostile_ids += 1
        fields = {
            "worker_id": f"hostile-{self.hostile_ids}",
            "model": MODEL,
            "engine": "sim",
            "block_size": BLOCK_SIZE,
            "endpoint": "http://127.0.0.1:9",
            **changes,
        }
        return pb.RegisterWorker(**fields)

    def chain(self, block_size: int) -> pb.KeyChain:
        return pb.KeyChain(block_size=block_size, block_keys=[self.rng.getrandbits(64) for _ in range(3)])

    def batch(self, seq: int) -> pb.EventBatch:
        return pb.EventBatch(
            seq=seq,
            events=[
                pb.BlockEvent(stored=pb.BlocksStored(block_keys=[self.rng.getrandbits(64) for _ in range(4)], tier=pb.TIER_GPU))
            ],
        )

    def bad(self) -> Call:
        rng = self.rng
        kind = rng.choice(
            (
                "unparseable",
                "unparseable",
                "connect",
                "connect",
                "connect",
                "router_session",
                "router_session",
                "query",
                "unknown_worker",
                "random",
                "random",
            )
        )
        if kind == "unparseable":
            method = rng.choice(("Query", "ListWorkers", "GetWorkerKeys", "Connect", "RouterSession"))
            cls = {
                "Query": pb.QueryRequest,
                "ListWorkers": pb.ListWorkersRequest,
                "Connect": pb.AgentMessage,
                "GetWorkerKeys": pb.GetWorkerKeysRequest,
                "RouterSession": pb.RouterMessage,
            }[method]
            bad = unparseable_bytes(rng, cls)
            first = []  # a stream's bad message may come after a valid first one
            if method == "Connect" and rng.random() < 0.5:
                first = [_agent(register=self.hostile_register())]
            elif method == "RouterSession" and rng.random() < 0.5:
                first = [_router(hello=pb.RouterHello(router_id=f"fuzz-router-{rng.randrange(1000)}"))]
            return Call(f"unparseable:{method}", method, [*first, bad], frozenset({I}))
        if kind == "connect":
            return rng.choice(_CONNECT)(self)
        if kind == "router_session":
            return rng.choice(_ROUTER_SESSION)(self)
        if kind == "query":
            chains = [self.chain(0)] if rng.random() < 0.5 else [self.chain(BLOCK_SIZE), self.chain(BLOCK_SIZE)]
            return Call(
                "query:bad_chains", "Query", [pb.QueryRequest(model=MODEL, chains=chains).SerializeToString()], frozenset({I})
            )
        if kind == "unknown_worker":
            return Call(
                kind,
                "GetWorkerKeys",
                [pb.GetWorkerKeysRequest(worker_id=f"nobody-{rng.randrange(10**6)}").SerializeToString()],
                frozenset({NF}),
            )
        method = rng.choice(("Query", "ListWorkers", "GetWorkerKeys", "Connect", "RouterSession"))
        return Call(f"random:{method}", method, [rng.randbytes(rng.randrange(48))], None)

    def valid(self) -> Call:
        if self.rng.random() < 0.5:
            return Call("valid", "ListWorkers", [pb.ListWorkersRequest(model=MODEL).SerializeToString()], frozenset({OK}))
        return Call(
            "valid",
            "Query",
            [pb.QueryRequest(model=MODEL, chains=[self.chain(BLOCK_SIZE)], columnar=True).SerializeToString()],
            frozenset({OK}),
        )


def _connect_bad_register(t: HostileTraffic) -> Call:
    changes = t.rng.choice(
        (
            {"worker_id": ""},
            {"model": ""},
            {"block_size": 0},
            {
                "endpoint": t.rng.choice(
                    ("", "10.0.0.7:8000", "ftp://x", "http://[::1", "http://h:99999", "http://a b", "http://h/\x00")
                )
            },
        )
    )
    return Call(
        f"connect:bad_register:{next(iter(changes))}", "Connect", [_agent(register=t.hostile_register(**changes))], frozenset({I})
    )


def _connect_not_registered(t: HostileTraffic) -> Call:
    first = _agent(batch=t.batch(1)) if t.rng.random() < 0.5 else _agent(heartbeat=pb.Heartbeat())
    return Call("connect:not_registered", "Connect", [first], frozenset({FP}))


def _connect_double_register(t: HostileTraffic) -> Call:
    register = _agent(register=t.hostile_register())
    return Call("connect:double_register", "Connect", [register, register], frozenset({FP}))


def _connect_out_of_sequence(t: HostileTraffic) -> Call:
    return Call(
        "connect:out_of_sequence",
        "Connect",
        [_agent(register=t.hostile_register()), _agent(batch=t.batch(t.rng.choice((0, 2, 7, 2**64 - 1))))],
        frozenset({FP}),
    )


def _connect_worker_in_use(t: HostileTraffic) -> Call:
    return Call("connect:worker_in_use", "Connect", [_agent(register=t.hostile_register(worker_id=WORKER))], frozenset({AE}))


def _connect_bad_kv_usage(t: HostileTraffic) -> Call:
    usage = t.rng.choice((float("nan"), float("inf"), -1.0, 1.5, 1e30))
    return Call(
        "connect:bad_kv_usage",
        "Connect",
        [_agent(register=t.hostile_register()), _agent(heartbeat=pb.Heartbeat(load=pb.WorkerLoad(kv_usage=usage)))],
        frozenset({I}),
    )


_CONNECT: list[Callable[[HostileTraffic], Call]] = [
    _connect_bad_register,
    _connect_not_registered,
    _connect_double_register,
    _connect_out_of_sequence,
    _connect_worker_in_use,
    _connect_bad_kv_usage,
]


def _hello(t: HostileTraffic) -> bytes:
    return _router(hello=pb.RouterHello(router_id=f"fuzz-router-{t.rng.randrange(1000)}"))


def _session_no_hello(t: HostileTraffic) -> Call:
    return Call(
        "router_session:no_hello",
        "RouterSession",
        [_router(query=pb.QueryRequest(model=MODEL, chains=[t.chain(BLOCK_SIZE)]))],
        frozenset({FP}),
    )


def _session_double_hello(t: HostileTraffic) -> Call:
    return Call("router_session:double_hello", "RouterSession", [_hello(t), _hello(t)], frozenset({FP}))


def _session_empty_router_id(t: HostileTraffic) -> Call:
    return Call("router_session:empty_router_id", "RouterSession", [_router(hello=pb.RouterHello())], frozenset({I}))


def _session_bad_query(t: HostileTraffic) -> Call:
    chains = [t.chain(0)] if t.rng.random() < 0.5 else [t.chain(BLOCK_SIZE), t.chain(BLOCK_SIZE)]
    return Call(
        "router_session:bad_query",
        "RouterSession",
        [_hello(t), _router(query=pb.QueryRequest(model=MODEL, chains=chains))],
        frozenset({I}),
    )


def _session_reservation_without_worker(t: HostileTraffic) -> Call:
    return Call(
        "router_session:reservation_without_worker",
        "RouterSession",
        [_hello(t), _router(reserve=pb.Reservation(reservation_id=1, block_size=BLOCK_SIZE, block_keys=[1, 2]))],
        frozenset({I}),
    )


def _session_empty_message(t: HostileTraffic) -> Call:
    return Call("router_session:empty_message", "RouterSession", [_hello(t), b""], frozenset({I}))


_ROUTER_SESSION: list[Callable[[HostileTraffic], Call]] = [
    _session_no_hello,
    _session_double_hello,
    _session_empty_router_id,
    _session_bad_query,
    _session_reservation_without_worker,
    _session_empty_message,
]


async def send(channel: grpc.aio.Channel, call: Call, outcomes: Outcomes) -> None:
    started = time.monotonic()
    path = SERVICE + call.method
    try:
        if call.streaming:
            rpc = channel.stream_stream(path)(iter(call.messages), timeout=TIMEOUT_S)
            async for _ in rpc:
                pass
        else:
            await channel.unary_unary(path)(call.messages[0], timeout=TIMEOUT_S)
        code, detail = OK, ""
    except grpc.aio.AioRpcError as exc:
        code, detail = exc.code(), exc.details() or ""
    ok = code not in _BAD_CODES if call.expect is None else code in call.expect
    if code != OK and not detail:
        ok = False  # every refusal says why
    expect = "any" if call.expect is None else "/".join(sorted(c.name for c in call.expect))
    outcomes.add(
        call.kind,
        expect,
        code.name,
        ok,
        hang=code == grpc.StatusCode.DEADLINE_EXCEEDED,
        seconds=time.monotonic() - started,
        example=None if ok else f"{call.method} {[m[:100] for m in call.messages]!r} -> {code.name} {detail[:300]}",
    )


async def worker_keys(channel: grpc.aio.Channel, worker_id: str) -> dict[int, set[int]] | None:
    try:
        reply = await channel.unary_unary(
            SERVICE + "GetWorkerKeys",
            request_serializer=pb.GetWorkerKeysRequest.SerializeToString,
            response_deserializer=pb.GetWorkerKeysResponse.FromString,
        )(pb.GetWorkerKeysRequest(worker_id=worker_id), timeout=5)
    except grpc.aio.AioRpcError:
        return None
    return {tier.tier: set(tier.block_keys) for tier in reply.tiers}


async def hostile_blocks(channel: grpc.aio.Channel) -> int:
    reply = await channel.unary_unary(
        SERVICE + "ListWorkers",
        request_serializer=pb.ListWorkersRequest.SerializeToString,
        response_deserializer=pb.ListWorkersResponse.FromString,
    )(pb.ListWorkersRequest(), timeout=5)
    total = 0
    for worker in reply.workers:
        if worker.worker_id != WORKER:
            keys = await worker_keys(channel, worker.worker_id) or {}
            total += sum(map(len, keys.values()))
    return total


async def health_ms(address: str) -> float:
    started = time.monotonic()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return float("inf")
    return (time.monotonic() - started) * 1000 if reply.status == health_pb2.HealthCheckResponse.SERVING else float("inf")


async def drive(address: str, messages: int, seed: int) -> tuple[Outcomes, dict, bool]:
    rng = random.Random(seed)
    outcomes, traffic = Outcomes(), HostileTraffic(rng)
    checkpoints, mismatches = 0, []
    async with grpc.aio.insecure_channel(address) as channel:
        agent = ValidAgent(channel, rng)

        async def check_index() -> bool:
            """Once every batch so far is acked: the valid worker holds exactly its keys, hostile ones none."""
            nonlocal checkpoints
            checkpoints += 1
            acked = await agent.all_acked()
            held = await worker_keys(channel, WORKER)
            stray = await hostile_blocks(channel)
            if not acked or held != agent.held or stray:
                mismatches.append(
                    {
                        "after_batch": agent.seq,
                        "acked": acked,
                        "stray_blocks": stray,
                        "keys_expected": {m: len(k) for m, k in agent.held.items()},
                        "keys_held": None if held is None else {m: len(k) for m, k in held.items()},
                    }
                )
            return acked

        try:
            for i in range(messages):
                if i % BAD_PER_VALID == 0:
                    agent.batch()
                    await send(channel, traffic.valid(), outcomes)
                await send(channel, traffic.bad(), outcomes)
                if i % CHECK_EVERY == CHECK_EVERY - 1:
                    await check_index()
            agent.batch()
            acked = await check_index()
            for _ in range(agent.seq):  # the agent's batches, as valid inputs of the table
                outcomes.add("valid_batch", "acked", "acked" if acked else "not acked", acked)
        finally:
            await agent.close()
    details = {
        "valid_batches": agent.seq,
        "valid_events": agent.batches_events,
        "keys_at_the_end": {m: len(k) for m, k in agent.held.items()},
        "index_checks": checkpoints,
        "index_mismatches": mismatches,
    }
    return outcomes, details, not mismatches


def run_fuzz(messages: int, seed: int, workdir: Path) -> FuzzReport:
    started = time.monotonic()
    cluster = LocalCluster(workdir=workdir, tokenizer_dir=workdir, model=MODEL, block_size=BLOCK_SIZE)
    try:
        address = cluster.start_control_plane()
        outcomes, details, applied = asyncio.run(drive(address, messages, seed))
        health = asyncio.run(health_ms(address))
        return outcomes.report(
            "control-plane",
            applied=applied,
            crashes=int(not cluster.control_plane.alive()),
            health_ms=round(health, 1),
            seconds=round(time.monotonic() - started, 1),
            details=details,
        )
    finally:
        cluster.stop()
