"""Synthetic agents for benches: workers registered over real Connect streams, a snapshot each, then
block events at a set rate, every batch's send time stamped; a process of its own, so that what it
costs lands neither on the control plane nor on the router being measured.

    python -m kvroute.tools.bench.synthetic_agents --control-plane 127.0.0.1:50051 --workers 8 \\
        --snapshot-keys 4096 --rate 20000 --batch-keys 16 --ready-file R --report-file P [--wait-signal]

Contract:
- Worker i is `<prefix>i` of `--model`, endpoint `--endpoints[i % n]` (default http://127.0.0.1:<20000+i>).
  Its first batch is a snapshot: `--snapshot-keys` random keys, after a prefix, of a length drawn per
  worker, of chain i mod n of `--prefix-file` (a JSON list of key chains: the prompts a bench asks about).
- Once every worker's snapshot is acknowledged, `--ready-file` gets {"workers": n, "entries": n}.
- Then (at once, or on SIGUSR1 with `--wait-signal`) `--rate` block events per second over all workers
  in round robin: each batch stores `--batch-keys` new keys and, once a worker holds more than its
  snapshot (or `--hold-keys`), removes as many of its oldest ones, so the index keeps its size.
  Heartbeats every `--heartbeat-s`. A write the control plane does not take yet holds the pacing up:
  the report says the rate achieved.
- On SIGTERM/SIGINT: `--report-file` gets {"sent_ns": {"worker/seq": wall-clock ns before the write},
  "batches", "events", "seconds", "events_per_s"} and the process exits (the streams close).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from collections import deque
from pathlib import Path

import grpc

from kvroute import aio
from kvroute.process import on_stop_signal, write_port_file
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

_MASK = (1 << 64) - 1


class Worker:
    def __init__(
        self,
        stub: pb_grpc.ControlPlaneStub,
        worker_id: str,
        register: pb.RegisterWorker,
        snapshot: list[int],
        hold: int,
        rng: random.Random,
    ) -> None:
        self.worker_id, self.register, self.snapshot = worker_id, register, snapshot
        self.call = stub.Connect()
        self.seq = 0
        self.acked = 0
        self.rng = rng
        self.hold = hold
        self.fifo: deque[int] = deque()
        self.reader: asyncio.Task | None = None

    async def start(self, own_keys: int) -> None:
        await self.call.write(pb.AgentMessage(register=self.register))
        first = await self.call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
            raise RuntimeError(f"{self.worker_id}: not registered: {first}")
        self.fifo.extend(self.snapshot[-own_keys:] if own_keys else ())
        self.seq = 1
        await self.call.write(
            pb.AgentMessage(
                batch=pb.EventBatch(
                    seq=1, snapshot=True, events=[pb.BlockEvent(stored=pb.BlocksStored(block_keys=self.snapshot))]
                )
            )
        )
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF:
                return
            if message.WhichOneof("body") == "ack":
                self.acked = message.ack.seq

    async def send_batch(self, keys_per_batch: int, sent_ns: dict[str, int]) -> int:
        """Store `keys_per_batch` new keys (removing as many old ones past the hold); events sent."""
        new = [self.rng.getrandbits(64) for _ in range(keys_per_batch)]
        self.fifo.extend(new)
        events = [pb.BlockEvent(stored=pb.BlocksStored(block_keys=new))]
        excess = len(self.fifo) - self.hold
        if excess > 0:
            old = [self.fifo.popleft() for _ in range(excess)]
            events.append(pb.BlockEvent(removed=pb.BlocksRemoved(block_keys=old)))
        self.seq += 1
        message = pb.AgentMessage(batch=pb.EventBatch(seq=self.seq, events=events))
        sent_ns[f"{self.worker_id}/{self.seq}"] = time.time_ns()
        await self.call.write(message)
        return keys_per_batch + max(0, excess)

    async def heartbeat(self) -> None:
        await self.call.write(
            pb.AgentMessage(
                heartbeat=pb.Heartbeat(
                    load=pb.WorkerLoad(
                        running_requests=0, waiting_requests=0, kv_usage=0.1, observed_unix_ms=int(time.time() * 1000)
                    )
                )
            )
        )

    async def close(self) -> None:
        self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    go = asyncio.Event()
    on_stop_signal(stop.set)
    if args.wait_signal:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
    else:
        go.set()
    endpoints = [e for e in args.endpoints.split(",") if e]
    chains = json.loads(Path(args.prefix_file).read_text()) if args.prefix_file else []
    rng = random.Random(args.seed)
    channel = grpc.aio.insecure_channel(args.control_plane, options=[("grpc.max_send_message_length", 256 << 20)])
    stub = pb_grpc.ControlPlaneStub(channel)
    workers = []
    for i in range(args.workers):
        worker_id = f"{args.worker_prefix}{i}"
        endpoint = endpoints[i % len(endpoints)] if endpoints else f"http://127.0.0.1:{20000 + i}"
        chain = chains[i % len(chains)] if chains else []
        held = chain[: rng.randrange(len(chain) + 1)]
        own = [rng.getrandbits(64) for _ in range(args.snapshot_keys)]
        register = pb.RegisterWorker(
            worker_id=worker_id,
            model=args.model,
            engine="sim",
            block_size=args.block_size,
            endpoint=endpoint,
            agent_instance=f"synthetic-{i}",
        )
        workers.append(
            Worker(stub, worker_id, register, held + own, max(args.hold_keys, len(own)), random.Random(rng.getrandbits(64)))
        )
    sent_ns: dict[str, int] = {}
    events = batches = 0
    started = time.monotonic()
    try:
        for worker in workers:
            await worker.start(args.snapshot_keys)
        while not all(w.acked >= 1 for w in workers):
            await asyncio.sleep(0.01)
        write_port_file(args.ready_file, {"workers": len(workers), "entries": sum(len(w.snapshot) for w in workers)})
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(go.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        batches_per_s = args.rate / max(1, args.batch_keys * 2) if args.rate > 0 else 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        next_heartbeat = started
        turn = 0
        while not stop.is_set():
            now = loop.time()
            if now >= next_heartbeat:
                for worker in workers:
                    await worker.heartbeat()
                next_heartbeat = now + args.heartbeat_s
            due = int((now - started) * batches_per_s) - batches if batches_per_s else 0
            for _ in range(min(due, 256)):
                events += await workers[turn % len(workers)].send_batch(args.batch_keys, sent_ns)
                turn += 1
                batches += 1
            await asyncio.sleep(0.001 if batches_per_s else min(args.heartbeat_s, 0.1))
        elapsed = loop.time() - started
    finally:
        for worker in workers:
            await worker.close()
        await channel.close()
    write_port_file(
        args.report_file,
        {
            "sent_ns": sent_ns,
            "batches": batches,
            "events": events,
            "seconds": round(elapsed, 3),
            "events_per_s": round(events / max(elapsed, 1e-9)),
        },
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--control-plane", required=True)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--worker-prefix", default="synthetic-")
    p.add_argument("--model", default="bench-model")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--endpoints", default="", help="comma-separated engine URLs, worker i gets the (i mod n)th")
    p.add_argument(
        "--prefix-file",
        default="",
        help="JSON list of key chains: worker i holds a prefix of chain i mod n (its length drawn per worker)",
    )
    p.add_argument("--snapshot-keys", type=int, default=0, help="random keys per worker in its snapshot")
    p.add_argument("--hold-keys", type=int, default=4096, help="a worker removes its oldest keys past this many")
    p.add_argument("--rate", type=float, default=0.0, help="block events per second (stored + removed), 0 = none")
    p.add_argument("--batch-keys", type=int, default=16, help="keys stored per batch")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--wait-signal", action="store_true", help="start the events on SIGUSR1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-file", default="")
    p.add_argument("--report-file", default="")
    return aio.run(run(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
