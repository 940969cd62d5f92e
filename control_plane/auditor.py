"""The control plane auditing itself (`--audit-interval-s`): every interval, each live worker whose
engine serves `GET /kvroute/blocks` is compared with the index (kvroute.control_plane.audit's comparison, with
its settle pause), and the result is exported:

  kvroute_cp_audit_divergent_blocks{worker_id, medium, kind}   kind = missing | extra, per tier;
                                                                kind = probe, medium = any (--audit-probe);
                                                                kind = missing_evicted: missing blocks the
                                                                index's bound explains (--max-index-entries),
                                                                not counted in kind = missing
  kvroute_cp_audit_last_success_timestamp_seconds{worker_id}    unix time of the last comparison
  kvroute_cp_audit_runs_total{result}                           ok | not_auditable | error

Workers whose engine lacks the endpoint are skipped (counted as not_auditable), unless
`--audit-probe` is set: then they are audited by kvroute.control_plane.audit's probe (a random prompt sent to
the engine twice; the index's prediction for the second send against the engine's prefix-cache
counters), with the index itself answering what the worker holds. Series of workers that left
are removed. The key sets are copied from the index between awaits, so the event loop is held
only for the set differences.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvroute.control_plane.audit import AuditError, ControlPlaneView, Prober, ProbeTarget, WorkerAudit, audit_worker
from kvroute.fleet.registry import WorkerRecord, WorkerRegistry
from kvroute.prefix_index import TIERS

log = logging.getLogger("kvroute.control_plane.audit")
PROBE_MEDIUM = "any"  # the probe compares a prefix hit, whatever tier the engine found it on


class PeriodicAuditor:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics_registry: CollectorRegistry,
        interval_s: float,
        settle_s: float = 0.5,
        concurrency: int = 8,
        timeout_s: float = 10.0,
        probe: bool = False,
        probe_deadline_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.timeout_s = timeout_s
        self.probe = probe
        self.probe_deadline_s = probe_deadline_s
        self._limit = asyncio.Semaphore(concurrency)
        self.divergent = Gauge(
            "kvroute_cp_audit_divergent_blocks",
            "Blocks where the index and the engine's own block set disagree (after settling)",
            ["worker", "medium", "kind"],
            registry=metrics_registry,
        )
        self.last_success = Gauge(
            "kvroute_cp_audit_last_success_timestamp_seconds",
            "Unix time of the last completed audit of a worker",
            ["worker"],
            registry=metrics_registry,
        )
        self.runs = Counter("kvroute_cp_audit_runs_total", "Worker audits by result", ["result"], registry=metrics_registry)
        # worker_id -> (medium, kind) -> blocks last exported: series to remove, changes to log
        self._exported: dict[str, dict[tuple[str, str], int]] = {}
        self._last_error: dict[str, str] = {}  # worker_id -> last error logged (log changes, not every round)

    async def run_forever(self) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.audit_all(http)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the auditor must never take the control plane down
                    log.exception("audit round failed")

    async def audit_all(self, http: aiohttp.ClientSession) -> list[WorkerAudit]:
        records = list(self.registry.workers())
        prober = Prober(http, deadline_s=self.probe_deadline_s, timeout_s=self.timeout_s) if self.probe else None
        audits = await asyncio.gather(*(self._audit(record, http, prober) for record in records))
        for audit in audits:
            self.runs.labels(audit.status).inc()
            if audit.status == "ok":
                self._export(audit)
            if audit.status == "error":
                if self._last_error.get(audit.worker_id) != audit.detail:
                    log.warning("audit of %s failed: %s", audit.worker_id, audit.detail)
                self._last_error[audit.worker_id] = audit.detail
            else:
                self._last_error.pop(audit.worker_id, None)
        self._forget_gone({r.worker_id for r in self.registry.workers()})
        return list(audits)

    async def _audit(self, record: WorkerRecord, http: aiohttp.ClientSession, prober: Prober | None) -> WorkerAudit:
        generation = record.generation

        def still_there() -> None:
            if self.registry.get(record.worker_id) is not record or record.generation != generation:
                raise AuditError("the worker re-registered or left during the audit")

        async def believed() -> ControlPlaneView:
            still_there()
            index = self.registry.index
            return ControlPlaneView(
                {tier.label: index.worker_keys(record.slot, tier) for tier in TIERS},
                {tier.label: n for tier, n in index.evicted_entries(record.slot).items()},
            )

        async def held(keys: list[int]) -> int:
            still_there()
            return self.registry.index.held_prefix(record.slot, keys)

        target = ProbeTarget(
            record.worker_id, record.endpoint, record.block_size, record.model, record.engine, record.data_parallel_rank, held
        )
        async with self._limit:
            return await audit_worker(
                record.worker_id,
                record.endpoint,
                record.block_size,
                believed,
                http,
                settle_s=self.settle_s,
                timeout_s=self.timeout_s,
                prober=prober,
                probe_target=target,
            )

    def _export(self, audit: WorkerAudit) -> None:
        if audit.probe is not None:
            series = {(PROBE_MEDIUM, "probe"): audit.divergence}
        else:
            series = {}
            for medium, tier in audit.tiers.items():
                series[(medium, "missing")] = tier.unexplained_missing
                series[(medium, "extra")] = len(tier.extra)
                if tier.evicted:
                    series[(medium, "missing_evicted")] = len(tier.missing) - tier.unexplained_missing
        exported = self._exported.setdefault(audit.worker_id, {})
        for labels in [labels for labels in exported if labels not in series]:  # the worker changed audit kind
            self.divergent.remove(audit.worker_id, *labels)
            del exported[labels]
        changed = False
        for (medium, kind), blocks in series.items():
            self.divergent.labels(audit.worker_id, medium, kind).set(blocks)
            if kind != "missing_evicted":  # the bound's own doing moves all the time: not worth a warning
                changed |= exported.get((medium, kind), 0) != blocks
            exported[(medium, kind)] = blocks
        if changed:
            log.warning("audit: %s: %s", audit.worker_id, _summary(audit))
        self.last_success.labels(audit.worker_id).set(time.time())

    def _forget_gone(self, present: set[str]) -> None:
        for worker_id in [w for w in self._last_error if w not in present]:
            del self._last_error[worker_id]
        for worker_id in [w for w in self._exported if w not in present]:
            for labels in self._exported.pop(worker_id):
                self.divergent.remove(worker_id, *labels)
            self.last_success.remove(worker_id)


def _summary(audit: WorkerAudit) -> str:
    if audit.probe is not None:
        probe = audit.probe
        return (
            f"probe: the index predicted a {probe.predicted_hit_tokens}-token hit, the engine hit "
            f"{probe.engine_hit_tokens}: {probe.missing} missing, {probe.extra} extra blocks {audit.detail}"
        )
    return "; ".join(
        f"{medium}: {len(tier.missing)} missing ({tier.evicted} entries evicted), {len(tier.extra)} "
        f"extra blocks (e.g. {sorted(tier.missing | tier.extra)[:3]})"
        for medium, tier in sorted(audit.tiers.items())
    )
