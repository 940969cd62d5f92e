"""The audit: does the control plane believe what the engines really cache? The logic behind
`kvroute audit` (`audit_cli.py`, arguments and printing) and the control plane's own periodic
audit (`auditor.py`).

For each worker, the control plane's keys (`GetWorkerKeys`: confirmed index entries per tier,
never speculative claims) are compared with the engine's own truth, `GET <endpoint>/kvroute/blocks`
(sim engines serve it: `{"model", "block_size", "tiers": {"gpu": [...], "cpu": [...]}}`, keys as
decimal integers). An engine without that endpoint (real vLLM answers 404) is "not auditable",
not an error. Per worker and tier the audit reports `missing` (the engine has it, the control
plane does not: routers under-estimate that worker) and `extra` (the control plane has it, the
engine does not: routers send prompts there for a cache hit that will not happen).

A control plane with a bound (`--max-index-entries`) drops entries on purpose. GetWorkerKeys then
says, in its initial metadata (`kvroute-evicted-entries-<medium>`, see `eviction_metadata`), how many
entries of the worker it dropped per tier since the worker's last snapshot: up to that many
`missing` keys on a tier are explained by the bound (`TierDivergence.evicted`) and are not
divergence; missing keys beyond it, and every `extra` key (the bound never adds one), are.

Events are in flight between engine, agent and control plane, so one comparison can show
divergence that resolves itself a few milliseconds later. With `settle_s` > 0 a worker that
diverges is compared again after that pause, and only keys divergent both times (in the same
direction, on the same tier) are reported.

Engines that do not publish their block set (real vLLM, SGLang) can be audited by a probe
(`--probe`; `--force-probe` probes every worker, also sim engines, which is how the probe itself
is tested): a fresh random prompt of PROBE_BLOCKS full blocks is sent to the engine directly,
the control plane is polled until it holds the prompt's blocks for that worker, the prompt is
sent again, and the hit the engine's own prefix-cache counters (`/metrics`) count for that second
send is compared with the hit the control plane predicts. See `Prober`.

The comparison (`compare`, `settle`, `audit_worker`, `Prober`) is shared with the control plane's
own periodic audit (`control_plane/auditor.py`, `--audit-interval-s`, `--audit-probe`);
`audit_fleet` asks a control plane over gRPC, as `kvroute audit` and the local-fleet harness do.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvroute.block_keys import prompt_block_keys
from kvroute.prom_text import sample_sums

if TYPE_CHECKING:
    from kvroute.tls import ClientTls

TierKeys = dict[str, set[int]]  # tier label ("gpu", "cpu", "disk") -> keys
EVICTED_METADATA_PREFIX = "kvroute-evicted-entries-"  # + tier label: GetWorkerKeys' initial metadata
SAMPLE_KEYS = 5  # divergent keys shown per tier and kind (for grepping logs and events)
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


@dataclass
class ControlPlaneView:
    """What the control plane believes a worker holds, and how many of its entries per tier it dropped
    for its bound since the worker's last snapshot (keys it may hold that the control plane forgot)."""

    keys: TierKeys
    evicted: dict[str, int] = field(default_factory=dict)  # medium -> entries


def eviction_metadata(evicted: Mapping[str, int]) -> tuple[tuple[str, str], ...]:
    """GetWorkerKeys' initial metadata for a worker's evicted entries per medium (none when none)."""
    return tuple((EVICTED_METADATA_PREFIX + medium, str(count)) for medium, count in evicted.items() if count)


def evictions_from_metadata(metadata) -> dict[str, int]:
    """The inverse of `eviction_metadata` (gRPC metadata: (key, value) pairs; other keys ignored)."""
    out: dict[str, int] = {}
    for key, value in metadata or ():
        if key.startswith(EVICTED_METADATA_PREFIX):
            try:
                out[key.removeprefix(EVICTED_METADATA_PREFIX)] = int(value)
            except ValueError:
                raise AuditError(f"GetWorkerKeys: malformed metadata {key}: {value!r}") from None
    return out


@dataclass(slots=True)
class TierDivergence:
    missing: set[int] = field(default_factory=set)  # engine has it, the control plane does not
    extra: set[int] = field(default_factory=set)  # the control plane has it, the engine does not
    control_plane_blocks: int = 0
    engine_blocks: int = 0
    evicted: int = 0  # entries the control plane dropped for its bound: explain up to that many missing keys

    @property
    def unexplained_missing(self) -> int:
        """Missing keys the control plane's evictions cannot account for."""
        return max(0, len(self.missing) - self.evicted)

    def to_json(self) -> dict:
        return {
            "control_plane": self.control_plane_blocks,
            "engine": self.engine_blocks,
            "missing": len(self.missing),
            "extra": len(self.extra),
            "evicted": self.evicted,
            "missing_beyond_evicted": self.unexplained_missing,
            "missing_sample": sorted(self.missing)[:SAMPLE_KEYS],
            "extra_sample": sorted(self.extra)[:SAMPLE_KEYS],
        }


@dataclass(slots=True)
class ProbeOutcome:
    """One probe of one worker: what the control plane predicted for the second send, what the engine hit."""

    prompt_tokens: int
    probe_blocks: int  # full blocks of the probe prompt
    control_plane_blocks: int  # of those, the leading ones the control plane held for the worker at the second send
    events_blocks: int  # ... when polling for the first send's events ended
    events_s: float  # polling time: until it held all probe_blocks, else the deadline
    events_arrived: bool
    predicted_hit_tokens: int  # control_plane_blocks x block size, capped as the engine caps a hit
    engine_hit_tokens: int  # the engine's prefix-cache hit for the second send
    block_size: int
    source: str = "metrics"  # "metrics" (counter deltas) or "usage" (the response's cached_tokens)
    seconds: float = 0.0  # the whole probe

    @property
    def missing(self) -> int:
        """Blocks the engine hit beyond the prediction (the control plane under-estimates this worker)."""
        return -(-max(0, self.engine_hit_tokens - self.predicted_hit_tokens) // self.block_size)

    @property
    def extra(self) -> int:
        """Predicted blocks the engine did not hit (routers would expect a hit that does not happen)."""
        return -(-max(0, self.predicted_hit_tokens - self.engine_hit_tokens) // self.block_size)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "probe_blocks": self.probe_blocks,
            "control_plane_blocks": self.control_plane_blocks,
            "events_blocks": self.events_blocks,
            "events_s": round(self.events_s, 4),
            "events_arrived": self.events_arrived,
            "predicted_hit_tokens": self.predicted_hit_tokens,
            "engine_hit_tokens": self.engine_hit_tokens,
            "missing": self.missing,
            "extra": self.extra,
            "source": self.source,
            "seconds": round(self.seconds, 4),
        }


@dataclass(slots=True)
class WorkerAudit:
    worker_id: str
    status: str  # "ok" (compared), "not_auditable", "error"
    tiers: dict[str, TierDivergence] = field(default_factory=dict)
    detail: str = ""
    kind: str = "block_set"  # "block_set" (GET /kvroute/blocks) or "probe"
    probe: ProbeOutcome | None = None

    @property
    def divergence(self) -> int:
        """Blocks where the control plane is wrong: missing ones its bound does not explain, and extra ones."""
        if self.probe is not None:
            return self.probe.missing + self.probe.extra
        return sum(t.unexplained_missing + len(t.extra) for t in self.tiers.values())

    def to_json(self) -> dict:
        out = {
            "worker_id": self.worker_id,
            "status": self.status,
            "kind": self.kind,
            "divergence": self.divergence,
            "tiers": {medium: t.to_json() for medium, t in sorted(self.tiers.items())},
            "detail": self.detail,
        }
        if self.probe is not None:
            out["probe"] = self.probe.to_json()
        return out


def compare(
    control_plane: Mapping[str, set[int]], engine: Mapping[str, set[int]], evicted: Mapping[str, int] | None = None
) -> dict[str, TierDivergence]:
    """Per tier (either side's): what the control plane lacks and what it holds in excess (`evicted`:
    per medium, entries its bound dropped, see ControlPlaneView)."""
    result = {}
    evicted = evicted or {}
    for medium in sorted(set(control_plane) | set(engine)):
        cp_keys, engine_keys = control_plane.get(medium, set()), engine.get(medium, set())
        result[medium] = TierDivergence(
            engine_keys - cp_keys, cp_keys - engine_keys, len(cp_keys), len(engine_keys), evicted.get(medium, 0)
        )
    return result


def settle(first: Mapping[str, TierDivergence], second: Mapping[str, TierDivergence]) -> dict[str, TierDivergence]:
    """Only what diverged both times, the same way; block counts are the second comparison's."""
    result = {}
    for medium, later in second.items():
        earlier = first.get(medium, TierDivergence())
        result[medium] = TierDivergence(
            earlier.missing & later.missing,
            earlier.extra & later.extra,
            later.control_plane_blocks,
            later.engine_blocks,
            later.evicted,
        )
    return result


async def engine_request(http, method: str, url: str, timeout_s: float, not_auditable: str = "", **kwargs) -> bytes:
    """The body of an engine's 200 answer (`http`: an aiohttp.ClientSession; `kwargs` go to its
    `request`). 404/405 raise NotAuditable with the reason `not_auditable` when one is given; any
    other failure raises AuditError."""
    import aiohttp

    try:
        async with http.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as response:
            body = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AuditError(f"{method} {url}: {type(exc).__name__} {exc}") from exc
    if not_auditable and response.status in NOT_AUDITABLE_STATUSES:
        raise NotAuditable(f"{method} {url}: {response.status} ({not_auditable})")
    if response.status != 200:
        raise AuditError(f"{method} {url}: {response.status} {body[:200]!r}")
    return body


async def fetch_engine_blocks(http, endpoint: str, timeout_s: float = 10.0) -> tuple[EngineBlocks, TierKeys]:
    """The engine's true cached keys per tier. `http` is an aiohttp.ClientSession."""
    url = endpoint.rstrip("/") + "/kvroute/blocks"
    body = await engine_request(http, "GET", url, timeout_s, "the engine does not publish its block set")
    try:
        blocks = msgspec.json.decode(body, type=EngineBlocks)
    except msgspec.ValidationError as exc:
        raise AuditError(f"GET {url}: unexpected answer: {exc}") from exc
    return blocks, {medium: set(keys) for medium, keys in blocks.tiers.items()}


async def audit_worker(
    worker_id: str,
    endpoint: str,
    block_size: int,
    control_plane_keys: Callable[[], Awaitable[ControlPlaneView]],
    http,
    settle_s: float = 0.0,
    timeout_s: float = 10.0,
    prober: Prober | None = None,
    probe_target: ProbeTarget | None = None,
) -> WorkerAudit:
    """Compare one worker (twice, `settle_s` apart, if the first comparison diverges). With a `prober`
    (and the worker as its `probe_target`), a worker whose engine does not serve its block set is
    probed instead, and every worker is when the prober is forced."""
    if prober is not None and probe_target is not None and prober.force:
        return await prober.audit(probe_target)

    async def once() -> dict[str, TierDivergence]:
        (engine, truth), believed = await asyncio.gather(fetch_engine_blocks(http, endpoint, timeout_s), control_plane_keys())
        if engine.block_size != block_size:
            raise AuditError(
                f"engine block size {engine.block_size} != the control plane's {block_size}: keys are not comparable"
            )
        return compare(believed.keys, truth, believed.evicted)

    try:
        tiers = await once()
        if settle_s > 0 and any(t.missing or t.extra for t in tiers.values()):
            await asyncio.sleep(settle_s)
            tiers = settle(tiers, await once())
    except NotAuditable as exc:
        if prober is not None and probe_target is not None:
            return await prober.audit(probe_target)
        return WorkerAudit(worker_id, "not_auditable", detail=str(exc))
    except AuditError as exc:
        return WorkerAudit(worker_id, "error", detail=str(exc))
    return WorkerAudit(worker_id, "ok", tiers)


# ---------------------------------------------------------------- the probe

PROBE_BLOCKS = 8  # full blocks in a probe prompt
PROBE_EXTRA_TOKENS = 3  # plus a partial block, so the engine's hit cap keeps all PROBE_BLOCKS
PROBE_TOKEN_IDS = (100, 1000)  # ids drawn from [lo, hi): ordinary tokens in any real vocabulary
PROBE_SENDS = 3  # second sends tried before a busy engine makes the probe an error
COUNTER_POLL_S = 0.025
COUNTER_SETTLE_S = 1.0  # how long counters that have counted the probe may keep moving
CP_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    """An engine family's cumulative prefix-cache counters (Prometheus sample names, summed over labels)."""

    family: str
    queries: str  # prompt tokens looked up: grows by exactly the probe's length for the probe alone
    hits: tuple[str, ...]  # tokens found cached (summed)


# vLLM: GPU prefix cache plus a KV connector's (vLLM's CPU offload; the sim engine's CPU tier).
# SGLang: prompt and cached tokens of finished requests.
PREFIX_COUNTERS = (
    PrefixCounters(
        "vllm", "vllm:prefix_cache_queries_total", ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
    ),
    PrefixCounters("sglang", "sglang:prompt_tokens_total", ("sglang:cached_tokens_total",)),
)
NO_PROBE_ENGINES = {
    "trtllm": "TensorRT-LLM serves per-iteration stats that each GET /metrics drains (its agent reads them), "
    "not prefix-cache counters: not auditable by probe",
}


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """A worker as the probe needs it, and how to ask the control plane what it holds there."""

    worker_id: str
    endpoint: str
    block_size: int
    model: str
    engine: str = ""
    data_parallel_rank: int | None = None
    # keys (the probe's chain at the worker's block size, namespace = model) -> how many leading
    # ones the control plane holds for this worker (confirmed, not speculative)
    held: Callable[[list[int]], Awaitable[int]] | None = None


@dataclass(slots=True)
class _Window:
    queries: float
    hits: float


class Prober:
    """Probe audits: for one worker, (a) a fresh random prompt of PROBE_BLOCKS full blocks (+ a few
    tokens), (b) the engine's prefix-cache counters read from its /metrics, (c) the prompt sent to the
    engine directly (`POST /v1/completions`, token ids, max_tokens 1), (d) the control plane polled
    until it holds all the prompt's blocks for the worker, or `deadline_s`, (e) the prompt sent again
    and the engine's hit for that send (counter deltas) compared with the control plane's prediction:
    held blocks x block size, at most floor((len - 1) / block size) blocks since an engine always
    computes the last prompt token. The second send's window counts only when the queries counter grew
    by exactly the prompt's length (no other request in it); otherwise it is sent again (PROBE_SENDS
    tries), or the response's `usage.prompt_tokens_details.cached_tokens` is used when the engine
    reports it. Divergence = the difference in blocks. One probe per endpoint at a time (data-parallel
    ranks share an endpoint and its counters). A diverging probe is not repeated: a second, fresh probe
    would not see what went wrong with the first one's blocks (an engine that dropped them silently);
    the probe's own blocks are the most recently used in the engine's cache, so an eviction racing
    the probe needs a flood of other prompts within milliseconds."""

    def __init__(
        self, http, *, deadline_s: float = 5.0, timeout_s: float = 10.0, force: bool = False, rng: random.Random | None = None
    ) -> None:
        self.http = http  # an aiohttp.ClientSession
        self.deadline_s = deadline_s
        self.timeout_s = timeout_s
        self.force = force
        self.rng = rng or random.Random()
        self._locks: dict[str, asyncio.Lock] = {}

    async def audit(self, target: ProbeTarget) -> WorkerAudit:
        """The worker's probe audit (kind "probe"); never raises for the engine's or control plane's faults."""
        if target.engine in NO_PROBE_ENGINES:
            return WorkerAudit(target.worker_id, "not_auditable", detail=NO_PROBE_ENGINES[target.engine], kind="probe")
        lock = self._locks.setdefault(target.endpoint, asyncio.Lock())
        try:
            async with lock:
                outcome = await self.probe(target)
        except NotAuditable as exc:
            return WorkerAudit(target.worker_id, "not_auditable", detail=str(exc), kind="probe")
        except AuditError as exc:
            return WorkerAudit(target.worker_id, "error", detail=f"probe: {exc}", kind="probe")
        detail = (
            ""
            if outcome.events_arrived
            else (
                f"events did not arrive: {outcome.events_blocks} of {outcome.probe_blocks} blocks after {outcome.events_s:.1f} s"
            )
        )
        return WorkerAudit(target.worker_id, "ok", detail=detail, kind="probe", probe=outcome)

    async def probe(self, target: ProbeTarget) -> ProbeOutcome:
        """One probe (steps a-e). NotAuditable: the engine has no prefix-cache counters; AuditError: it or
        the control plane failed, or the engine was never idle enough to measure."""
        started = time.monotonic()
        bs = target.block_size
        if bs <= 0 or target.held is None:
            raise AuditError(f"cannot probe a worker without a block size and a control plane ({bs})")
        prompt = [self.rng.randrange(*PROBE_TOKEN_IDS) for _ in range(PROBE_BLOCKS * bs + PROBE_EXTRA_TOKENS)]
        keys = prompt_block_keys(prompt, bs, target.model)
        hit_cap = (len(prompt) - 1) // bs
        counters, before = await self._counters(target)  # (b)
        await self._send(target, prompt)  # (c)
        await self._counted(target, counters, before, len(prompt))  # the first send is behind us
        waited = time.monotonic()  # (d)
        while (events_blocks := await target.held(keys)) < len(keys) and time.monotonic() - waited < self.deadline_s:
            await asyncio.sleep(CP_POLL_S)
        events_s = time.monotonic() - waited
        for _ in range(PROBE_SENDS):  # (e)
            held = await target.held(keys)
            _, before = await self._counters(target, counters)
            cached = await self._send(target, prompt)
            window = await self._counted(target, counters, before, len(prompt))
            if window.queries == len(prompt):
                engine_hit, source = int(window.hits), "metrics"
                break
            if cached is not None:
                engine_hit, source = cached, "usage"
                break
        else:
            raise AuditError(
                f"the engine was busy: other requests were counted with each of {PROBE_SENDS} sends "
                f"of the probe (its counters cannot isolate the probe's hit)"
            )
        return ProbeOutcome(
            prompt_tokens=len(prompt),
            probe_blocks=len(keys),
            control_plane_blocks=held,
            events_blocks=events_blocks,
            events_s=events_s,
            events_arrived=events_blocks >= len(keys),
            predicted_hit_tokens=min(held, hit_cap) * bs,
            engine_hit_tokens=engine_hit,
            block_size=bs,
            source=source,
            seconds=time.monotonic() - started,
        )

    async def _counters(self, target: ProbeTarget, counters: PrefixCounters | None = None) -> tuple[PrefixCounters, _Window]:
        """The engine's counter family (found by name unless given) and its current totals."""
        text = (
            await engine_request(
                self.http,
                "GET",
                target.endpoint.rstrip("/") + "/metrics",
                self.timeout_s,
                "no metrics, so no prefix-cache counters",
            )
        ).decode(errors="replace")
        names = {c.queries for c in PREFIX_COUNTERS} | {h for c in PREFIX_COUNTERS for h in c.hits}
        try:
            sums = sample_sums(text, names)
        except ValueError as exc:
            raise AuditError(f"GET {target.endpoint.rstrip('/')}/metrics is not a Prometheus text exposition: {exc}") from None
        if counters is None:
            counters = next((c for c in PREFIX_COUNTERS if c.queries in sums), None)
            if counters is None:
                raise NotAuditable(
                    f"GET {target.endpoint.rstrip('/')}/metrics has no prefix-cache counters "
                    f"(looked for {', '.join(c.queries for c in PREFIX_COUNTERS)})"
                )
        elif counters.queries not in sums:
            raise AuditError(f"{counters.queries} vanished from the engine's /metrics")
        return counters, _Window(sums[counters.queries], sum(sums.get(h, 0.0) for h in counters.hits))

    async def _counted(self, target: ProbeTarget, counters: PrefixCounters, before: _Window, tokens: int) -> _Window:
        """Counter growth since `before`, once the queries counter has grown by at least `tokens` and two
        reads in a row agree (engines publish their stats a little after the response). On a busy engine
        they may never agree: then the growth after COUNTER_SETTLE_S, other requests' tokens included."""
        deadline = time.monotonic() + self.timeout_s
        last: _Window | None = None
        while True:
            _, now = await self._counters(target, counters)
            grown = _Window(now.queries - before.queries, now.hits - before.hits)
            if grown.queries >= tokens:
                if grown == last or time.monotonic() >= deadline:
                    return grown
                deadline = min(deadline, time.monotonic() + COUNTER_SETTLE_S)
            elif time.monotonic() >= deadline:
                raise AuditError(
                    f"the engine's {counters.queries} grew by {grown.queries:g} of the probe's "
                    f"{tokens} tokens within {self.timeout_s:g} s"
                )
            last = grown
            await asyncio.sleep(COUNTER_POLL_S)

    async def _send(self, target: ProbeTarget, prompt: list[int]) -> int | None:
        """POST the probe to the engine; the response's cached_tokens when it reports them."""
        url = target.endpoint.rstrip("/") + "/v1/completions"
        headers = {} if target.data_parallel_rank is None else {"X-data-parallel-rank": str(target.data_parallel_rank)}
        body = {"model": target.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        raw = await engine_request(self.http, "POST", url, self.timeout_s, json=body, headers=headers)
        try:
            details = (json.loads(raw).get("usage") or {}).get("prompt_tokens_details") or {}
        except (ValueError, AttributeError):
            raise AuditError(f"POST {url}: unexpected answer {raw[:200]!r}") from None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


# ---------------------------------------------------------------- a fleet, over gRPC


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


async def audit_fleet(
    control_plane: str,
    workers: Sequence[str] = (),
    *,
    settle_s: float = 0.5,
    timeout_s: float = 10.0,
    concurrency: int = 8,
    probe: bool = False,
    force_probe: bool = False,
    probe_deadline_s: float = 5.0,
    tls: ClientTls | None = None,
) -> FleetAudit:
    """`kvroute audit` without the printing: compare `workers` (default: every registered worker), probing
    those without a block set when `probe` (every one when `force_probe`). A worker that could not be
    compared is an error in its WorkerAudit (status "error") and in `errors`. `tls`: to a control plane
    serving TLS (any certificate its CA signed may read)."""
    import aiohttp
    import grpc

    from kvroute.prefix_index import Tier
    from kvroute.tls import describe_rpc_error, open_channel
    from kvroute.v1 import kvroute_pb2 as pb
    from kvroute.v1 import kvroute_pb2_grpc as pb_grpc

    channel = open_channel(control_plane, tls, [("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.ControlPlaneStub(channel)
    try:
        try:
            listed = (await stub.ListWorkers(pb.ListWorkersRequest(), timeout=timeout_s)).workers
        except grpc.aio.AioRpcError as exc:
            return FleetAudit([], [f"control plane {control_plane}: ListWorkers {describe_rpc_error(exc, tls)}"])
        by_id = {w.worker_id: w for w in listed}
        wanted = list(workers) or sorted(by_id)
        errors = [f"worker {w!r} is not registered with the control plane" for w in wanted if w not in by_id]
        limit = asyncio.Semaphore(max(1, concurrency))

        async def one(info) -> WorkerAudit:
            async def believed() -> ControlPlaneView:
                call = stub.GetWorkerKeys(pb.GetWorkerKeysRequest(worker_id=info.worker_id), timeout=timeout_s)
                try:
                    keys = await call
                    metadata = await call.initial_metadata()
                except grpc.aio.AioRpcError as exc:
                    raise AuditError(f"GetWorkerKeys: {exc.code().name}: {exc.details()}") from exc
                return ControlPlaneView(
                    {Tier(tier.tier).label: set(tier.block_keys) for tier in keys.tiers}, evictions_from_metadata(metadata)
                )

            async with limit:
                return await audit_worker(
                    info.worker_id,
                    info.endpoint,
                    info.block_size,
                    believed,
                    http,
                    settle_s=settle_s,
                    timeout_s=timeout_s,
                    prober=prober,
                    probe_target=probe_target(stub, info, timeout_s),
                )

        async with aiohttp.ClientSession() as http:
            prober = (
                Prober(http, deadline_s=probe_deadline_s, timeout_s=timeout_s, force=force_probe)
                if probe or force_probe
                else None
            )
            audits = list(await asyncio.gather(*(one(by_id[w]) for w in wanted if w in by_id)))
        errors += [f"{a.worker_id}: {a.detail}" for a in audits if a.status == "error"]
        return FleetAudit(audits, errors)
    finally:
        await channel.close()


def probe_target(stub, info, timeout_s: float = 10.0) -> ProbeTarget:
    """The worker `info` (a ListWorkers WorkerInfo) as a probe target whose `held` asks the control
    plane's `Query` (`stub`: a grpc.aio ControlPlaneStub) for the probe's chain, namespace = model."""
    import grpc

    from kvroute.v1 import kvroute_pb2 as pb

    async def held(keys: list[int]) -> int:
        query = pb.QueryRequest(model=info.model, chains=[pb.KeyChain(block_size=info.block_size, block_keys=keys)])
        try:
            answer = await stub.Query(query, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise AuditError(f"Query: {exc.code().name}: {exc.details()}") from exc
        match = next((w for w in answer.workers if w.worker_id == info.worker_id), None)
        if match is None:
            raise AuditError("the worker left the control plane during the probe")
        return match.matched_blocks - match.speculative_blocks  # no router reserved the probe: no claims

    rank = info.data_parallel_rank if info.HasField("data_parallel_rank") else None
    return ProbeTarget(info.worker_id, info.endpoint, info.block_size, info.model, info.engine, rank, held)
