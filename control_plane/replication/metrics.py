"""A replica's Redis-log counters and positions, exported at scrape time (nothing on the hot path)."""

from __future__ import annotations

import dataclasses

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvroute.control_plane.replication.inflight_sync import InflightSync
from kvroute.control_plane.replication.redis_log import RedisEventLog


class RedisLogCollector:
    def __init__(self, redis_log: RedisEventLog, inflight_sync: InflightSync | None = None) -> None:
        self.redis_log = redis_log
        self.inflight_sync = inflight_sync

    def collect(self):
        rlog = self.redis_log
        events = CounterMetricFamily(
            "kvroute_cp_redis_log_events_total",
            "Redis log events (see control_plane.replication.redis_log.RedisLogCounters)",
            labels=["event"],
        )
        for name, value in dataclasses.asdict(rlog.counters).items():
            events.add_metric([name], value)
        yield events
        ready = rlog.ready and (self.inflight_sync is None or self.inflight_sync.ready)
        yield GaugeMetricFamily(
            "kvroute_cp_redis_ready",
            "1 once the log is loaded and caught up and the other replicas' router sessions replayed",
            value=int(ready),
        )
        yield GaugeMetricFamily("kvroute_cp_redis_reachable", "1 while the last Redis call succeeded", value=int(rlog.redis_ok))
        applied = GaugeMetricFamily("kvroute_cp_redis_shard_entries_applied", "Entry number applied per shard", labels=["shard"])
        for tail in rlog.shards:
            applied.add_metric([str(tail.keys.shard)], tail.n)
        yield applied
        if self.inflight_sync is not None:
            sync = CounterMetricFamily(
                "kvroute_cp_inflight_sync_events_total",
                "Reservations shared with other replicas (see control_plane.replication.inflight_sync.SyncCounters)",
                labels=["event"],
            )
            for name, value in dataclasses.asdict(self.inflight_sync.counters).items():
                sync.add_metric([name], value)
            yield sync
