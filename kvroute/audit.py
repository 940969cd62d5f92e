"""`kvroute audit`: does the control plane believe what the engines really cache?

For each worker, the control plane's keys (`GetWorkerKeys`: confirmed index entries per tier,
never speculative claims) are compared with the engine's own truth, `GET <endpoint>/kvroute/blocks`
(sim engines serve it: `{"model", "block_size", "tiers": {"gpu": [...], "cpu": [...]}}`, keys as
decimal integers). An engine without that endpoint (real vLLM answers 404) is "not auditable",
not an error. Per worker and tier the audit reports `missing` (the engine has it, the control
plane does not: routers under-estimate that worker) and `extra` (the control plane has it, the
engine does not: routers send prompts there for a cache hit that will not happen).

Events are in flight between engine, agent and control plane, so one comparison can show
divergence that resolves itself a few milliseconds later. With `settle_s` > 0 a worker that
diverges is compared again after that pause, and only keys divergent both times (in the same
direction, on the same tier) are reported.

The comparison (`compare`, `settle`, `audit_worker`) is shared with the control plane's own
periodic audit (`control_plane/auditor.py`, `--audit-interval-s`).

Exit status: 0 no divergence, 1 divergence, 2 errors (control plane or an engine unreachable,
unknown --worker, an engine answering garbage). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

TierKeys = dict[str, set[int]]  # medium -> keys
SAMPLE_KEYS = 5                 # divergent keys shown per tier and kind (for grepping logs and events)
NOT_AUDITABLE_STATUSES = (404, 405)


class NotAuditable(Exception):
    """The engine does not serve its true block set."""


class AuditError(Exception):
    """The comparison could not be made (unreachable, malformed, incomparable)."""


class EngineBlocks(msgspec.Struct):
    """The part of `GET /kvroute/blocks` the audit reads."""

    block_size: int
    tiers: dict[str, list[int]]
    model: str = ""


@dataclass(slots=True)
class TierDivergence:
    missing: set[int] = field(default_factory=set)  # engine has it, the control plane does not
    extra: set[int] = field(default_factory=set)    # the control plane has it, the engine does not
    control_plane_blocks: int = 0
    engine_blocks: int = 0

    def to_json(self) -> dict:
        return {"control_plane": self.control_plane_blocks, "engine": self.engine_blocks,
                "missing": len(self.missing), "extra": len(self.extra),
                "missing_sample": sorted(self.missing)[:SAMPLE_KEYS], "extra_sample": sorted(self.extra)[:SAMPLE_KEYS]}


@dataclass(slots=True)
class WorkerAudit:
    worker_id: str
    status: str  # "ok" (compared), "not_auditable", "error"
    tiers: dict[str, TierDivergence] = field(default_factory=dict)
    detail: str = ""

    @property
    def divergence(self) -> int:
        return sum(len(t.missing) + len(t.extra) for t in self.tiers.values())

    def to_json(self) -> dict:
        return {"worker_id": self.worker_id, "status": self.status, "divergence": self.divergence,
                "tiers": {medium: t.to_json() for medium, t in sorted(self.tiers.items())}, "detail": self.detail}


def compare(control_plane: Mapping[str, set[int]], engine: Mapping[str, set[int]]) -> dict[str, TierDivergence]:
    """Per tier (either side's): what the control plane lacks and what it holds in excess."""
    result = {}
    for medium in sorted(set(control_plane) | set(engine)):
        cp_keys, engine_keys = control_plane.get(medium, set()), engine.get(medium, set())
        result[medium] = TierDivergence(engine_keys - cp_keys, cp_keys - engine_keys, len(cp_keys), len(engine_keys))
    return result


def settle(first: Mapping[str, TierDivergence], second: Mapping[str, TierDivergence]) -> dict[str, TierDivergence]:
    """Only what diverged both times, the same way; block counts are the second comparison's."""
    result = {}
    for medium, later in second.items():
        earlier = first.get(medium, TierDivergence())
        result[medium] = TierDivergence(earlier.missing & later.missing, earlier.extra & later.extra,
                                        later.control_plane_blocks, later.engine_blocks)
    return result


async def fetch_engine_blocks(http, endpoint: str, timeout_s: float = 10.0) -> tuple[EngineBlocks, TierKeys]:
    """The engine's true cached keys per tier. `http` is an aiohttp.ClientSession."""
    import aiohttp

    url = endpoint.rstrip("/") + "/kvroute/blocks"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status in NOT_AUDITABLE_STATUSES:
                raise NotAuditable(f"GET {url}: {response.status} (the engine does not publish its block set)")
            body = await response.read()
            if response.status != 200:
                raise AuditError(f"GET {url}: {response.status} {body[:200]!r}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise AuditError(f"GET {url}: {type(exc).__name__} {exc}") from exc
    try:
        blocks = msgspec.json.decode(body, type=EngineBlocks)
    except msgspec.ValidationError as exc:
        raise AuditError(f"GET {url}: unexpected answer: {exc}") from exc
    return blocks, {medium: set(keys) for medium, keys in blocks.tiers.items()}


async def audit_worker(worker_id: str, endpoint: str, block_size: int, control_plane_keys: Callable[[], Awaitable[TierKeys]],
                       http, settle_s: float = 0.0, timeout_s: float = 10.0) -> WorkerAudit:
    """Compare one worker (twice, `settle_s` apart, if the first comparison diverges)."""

    async def once() -> dict[str, TierDivergence]:
        (engine, truth), believed = await asyncio.gather(fetch_engine_blocks(http, endpoint, timeout_s),
                                                         control_plane_keys())
        if engine.block_size != block_size:
            raise AuditError(f"engine block size {engine.block_size} != the control plane's {block_size}: "
                             "keys are not comparable")
        return compare(believed, truth)

    try:
        tiers = await once()
        if settle_s > 0 and any(t.missing or t.extra for t in tiers.values()):
            await asyncio.sleep(settle_s)
            tiers = settle(tiers, await once())
    except NotAuditable as exc:
        return WorkerAudit(worker_id, "not_auditable", detail=str(exc))
    except AuditError as exc:
        return WorkerAudit(worker_id, "error", detail=str(exc))
    return WorkerAudit(worker_id, "ok", tiers)


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-plane", required=True, metavar="HOST:PORT", help="the control plane's gRPC address")
    p.add_argument("--worker", action="append", default=[], metavar="ID",
                   help="audit this worker (repeatable; default: every worker ListWorkers returns)")
    p.add_argument("--settle-ms", type=float, default=500.0, metavar="MS",
                   help="compare a diverging worker again after this pause and report only divergence seen both "
                        "times (events in flight cause transient divergence); 0 = one comparison")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per request to the control plane or an engine")
    p.add_argument("--concurrency", type=int, default=8, help="workers audited at once")
    p.add_argument("--json", action="store_true", help="print only the JSON result")


def run(args: argparse.Namespace) -> int:
    from kvroute import aio

    return aio.run(run_audit(args))


async def run_audit(args: argparse.Namespace) -> int:
    result = await audit_fleet(args.control_plane, args.worker, settle_s=args.settle_ms / 1000,
                               timeout_s=args.timeout_s, concurrency=args.concurrency)
    return report(result.audits, result.errors, args)


@dataclass(slots=True)
class FleetAudit:
    """Every audited worker, and what kept the comparison from being made (unreachable, unknown worker)."""

    audits: list[WorkerAudit]
    errors: list[str]

    @property
    def divergence(self) -> int:
        return sum(a.divergence for a in self.audits)

    def by_worker(self) -> dict[str, WorkerAudit]:
        return {a.worker_id: a for a in self.audits}

    def to_json(self) -> dict:
        return {"divergence": self.divergence, "workers": [a.to_json() for a in self.audits], "errors": self.errors}


async def audit_fleet(control_plane: str, workers: Sequence[str] = (), *, settle_s: float = 0.5,
                      timeout_s: float = 10.0, concurrency: int = 8) -> FleetAudit:
    """`kvroute audit` without the printing: compare `workers` (default: every registered worker).
    A worker that could not be compared is an error in its WorkerAudit (status "error") and in `errors`."""
    import aiohttp
    import grpc

    from kvroute.v1 import kvroute_pb2 as pb
    from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(control_plane, options=[("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.ControlPlaneStub(channel)
    try:
        try:
            listed = (await stub.ListWorkers(pb.ListWorkersRequest(), timeout=timeout_s)).workers
        except grpc.aio.AioRpcError as exc:
            return FleetAudit([], [f"control plane {control_plane}: ListWorkers {exc.code().name}: {exc.details()}"])
        by_id = {w.worker_id: w for w in listed}
        wanted = list(workers) or sorted(by_id)
        errors = [f"worker {w!r} is not registered with the control plane" for w in wanted if w not in by_id]
        limit = asyncio.Semaphore(max(1, concurrency))

        async def one(info) -> WorkerAudit:
            async def believed() -> TierKeys:
                try:
                    keys = await stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id=info.worker_id), timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    raise AuditError(f"GetWorkerKeys: {exc.code().name}: {exc.details()}") from exc
                return {tier.medium: set(tier.block_keys) for tier in keys.tiers}

            async with limit:
                return await audit_worker(info.worker_id, info.endpoint, info.block_size, believed, http,
                                          settle_s=settle_s, timeout_s=timeout_s)

        async with aiohttp.ClientSession() as http:
            audits = list(await asyncio.gather(*(one(by_id[w]) for w in wanted if w in by_id)))
        errors += [f"{a.worker_id}: {a.detail}" for a in audits if a.status == "error"]
        return FleetAudit(audits, errors)
    finally:
        await channel.close()


def report(audits: list[WorkerAudit], errors: list[str], args: argparse.Namespace) -> int:
    divergence = sum(a.divergence for a in audits)
    result = {"divergence": divergence, "workers": [a.to_json() for a in audits],
              "audited": sum(a.status == "ok" for a in audits),
              "not_auditable": sum(a.status == "not_auditable" for a in audits),
              "errors": errors, "settle_ms": args.settle_ms}
    if not args.json:
        print(f"{'worker':<24} {'tier':<5} {'control plane':>13} {'engine':>9} {'missing':>8} {'extra':>8}")
        for audit in audits:
            if audit.status != "ok":
                print(f"{audit.worker_id:<24} {audit.status.replace('_', ' ')}: {audit.detail}")
            for medium, tier in sorted(audit.tiers.items()):
                print(f"{audit.worker_id:<24} {medium:<5} {tier.control_plane_blocks:>13} {tier.engine_blocks:>9} "
                      f"{len(tier.missing):>8} {len(tier.extra):>8}")
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        print(f"divergence: {divergence} blocks over {result['audited']} audited workers "
              f"({result['not_auditable']} not auditable, {len(errors)} errors)")
    print(json.dumps(result))
    return 2 if errors else 1 if divergence else 0
