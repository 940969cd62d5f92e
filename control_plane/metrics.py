"""The control plane's Prometheus metrics (GET /metrics): the servicer's counters, and collectors
that read the registry, the applier, the in-flight tracker and the index at scrape time, so that
nothing is counted on the apply path.

    metrics = ControlPlaneMetrics(registry)          # handed to ControlPlaneService
    registry.register(IndexCollector(state.index))   # and the others, by server.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvroute.fleet.apply import LogApplier
from kvroute.fleet.inflight import InflightTracker
from kvroute.prefix_index import PrefixIndex, is_bounded


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.stream_errors = Counter("kvroute_cp_stream_errors_total", "Agent streams rejected", ["reason"], registry=registry)
        self.unknown_media = Counter(
            "kvroute_cp_unknown_medium_events_total",
            "Block events naming a tier outside gpu/cpu/disk (applied as disk)",
            registry=registry,
        )
        self.bad_requests = Counter(
            "kvroute_cp_bad_requests_total", "Router requests rejected", ["rpc", "reason"], registry=registry
        )
        self.query_seconds = Histogram(
            "kvroute_cp_query_seconds",
            "Query handling time",
            registry=registry,
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
        )


class ApplyCollector:
    """The registry's and the applier's figures at scrape time: nothing is counted on the apply path
    but the applier's plain integers (`kvroute.fleet.apply.ApplyCounters`)."""

    def __init__(self, applier: LogApplier) -> None:
        self.applier = applier

    def collect(self):
        applier, counters = self.applier, self.applier.counters
        yield GaugeMetricFamily("kvroute_cp_workers", "Registered live workers", value=len(applier.registry))
        yield GaugeMetricFamily(
            "kvroute_cp_index_entries", "(block key, worker) pairs in the index", value=applier.registry.index.entry_count()
        )
        batches = CounterMetricFamily("kvroute_cp_event_batches", "Event batches applied", labels=["kind"])
        batches.add_metric(["snapshot"], counters.snapshot_batches)
        batches.add_metric(["delta"], counters.delta_batches)
        yield batches
        events = CounterMetricFamily("kvroute_cp_block_events", "Block keys applied", labels=["op"])
        for op, value in (
            ("snapshot", counters.snapshot_keys),
            ("stored", counters.stored_keys),
            ("removed", counters.removed_keys),
            ("cleared", counters.cleared),
        ):
            events.add_metric([op], value)
        yield events
        yield CounterMetricFamily(
            "kvroute_cp_workers_expired", "Workers dropped for missing heartbeats", value=counters.expired_workers
        )


class InflightCollector:
    """Exports the in-flight tracker's counters and sizes at scrape time (nothing on the hot path).
    `local_sessions()`: the RouterSession streams this process serves; the tracker's other sessions
    mirror other replicas' routers."""

    def __init__(self, inflight: InflightTracker, local_sessions: Callable[[], int]) -> None:
        self.inflight = inflight
        self.local_sessions = local_sessions

    def collect(self):
        inflight = self.inflight
        sessions = GaugeMetricFamily(
            "kvroute_cp_router_sessions",
            "Open router sessions: origin=local, RouterSession streams served here; origin=replica, mirrored from other replicas",
            labels=["origin"],
        )
        local = self.local_sessions()
        sessions.add_metric(["local"], local)
        sessions.add_metric(["replica"], inflight.open_sessions - local)
        yield sessions
        yield GaugeMetricFamily("kvroute_cp_reservations", "Live in-flight reservations", value=inflight.reservation_count())
        yield GaugeMetricFamily(
            "kvroute_cp_speculative_claims", "(worker, block key) speculative claims", value=inflight.claim_count()
        )
        events = CounterMetricFamily(
            "kvroute_cp_reservation_events_total",
            "Reservation lifecycle events (see kvroute.fleet.inflight.InflightCounters)",
            labels=["event"],
        )
        for name, value in dataclasses.asdict(inflight.counters).items():
            events.add_metric([name], value)
        yield events


class IndexCollector:
    """The index's memory and, with a bound (--max-index-entries), its evictions, at scrape time (the
    byte figures are `estimated_bytes()`: O(workers) per scrape, nothing on the hot path).
    `kvroute_cp_index_entries` itself is a gauge of ControlPlaneMetrics, set as batches apply."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def collect(self):
        index = self.index
        bounded = is_bounded(index)
        entries, size = index.entry_count(), index.estimated_bytes()
        yield GaugeMetricFamily(
            "kvroute_cp_index_max_entries",
            "The index's bound (--max-index-entries); 0 = unbounded",
            value=index.max_entries if bounded else 0,
        )
        yield GaugeMetricFamily(
            "kvroute_cp_index_bytes",
            "Memory the prefix index holds (estimated from its containers' sizes; kvroute bench ingest measures it)",
            value=size,
        )
        yield GaugeMetricFamily(
            "kvroute_cp_index_bytes_per_entry",
            "kvroute_cp_index_bytes / kvroute_cp_index_entries (0 while empty): size --max-index-entries by it",
            value=size / entries if entries else 0,
        )
        evicted = CounterMetricFamily(
            "kvroute_cp_index_evicted_entries_total",
            "(block key, worker, tier) entries dropped for --max-index-entries; "
            "recently_matched=true: the bound is below the working set",
            labels=["recently_matched"],
        )
        counters = index.counters if bounded else None
        recent = counters.recently_matched_entries if counters else 0
        evicted.add_metric(["false"], (counters.entries if counters else 0) - recent)
        evicted.add_metric(["true"], recent)
        yield evicted
        yield GaugeMetricFamily(
            "kvroute_cp_index_workers_with_evictions",
            "Workers with entries dropped for the bound since their last snapshot (the index may "
            "lack blocks they hold; a replica holding such workers writes no snapshots)",
            value=index.workers_with_evictions() if bounded else 0,
        )
