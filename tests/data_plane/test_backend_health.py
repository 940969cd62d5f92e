"""BackendHealth: written by the proxy, read by decisions and readiness (one direction only)."""

from __future__ import annotations

import asyncio

from kvroute.data_plane.backend_health import BackendHealth
from kvroute.data_plane.control_plane_client import KnownWorker
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.inflight import RouterInflight
from kvroute.data_plane.query_deadline import QueryDeadline
from kvroute.data_plane.routing import Router
from kvroute.v1 import kvroute_pb2 as pb


def test_a_failed_worker_sits_out_its_cooldown_then_comes_back() -> None:
    now = [100.0]
    health = BackendHealth(cooldown_s=2.0, clock=lambda: now[0])
    assert health.cooling_down() == frozenset()
    health.failed("a")
    now[0] += 1.5
    health.failed("b")
    assert health.cooling_down() == {"a", "b"}
    now[0] += 0.6  # a: 2.1 s ago
    assert health.cooling_down() == {"b"}
    now[0] += 2.0
    assert health.cooling_down() == frozenset()


class _Fleet:
    """A control plane that knows two workers and whose index is down (decisions fail open)."""
    reachable = True
    query_deadline = QueryDeadline.fixed(0.005)

    def workers_for(self, model: str, lora_name: str = "") -> list[KnownWorker]:
        return [KnownWorker(w, model, f"http://{w}", 16, pb.WorkerLoad()) for w in ("a", "b")]

    async def query(self, model, chains, lora_name=""):
        raise TimeoutError


def test_decisions_leave_out_workers_the_health_reports_unless_none_is_left() -> None:
    health = BackendHealth()
    router = Router(_Fleet(), make_policy("round_robin"), RouterInflight(), health)

    async def workers(n: int) -> set[str]:
        return {(await router.decide("m", [1, 2, 3])).worker_id for _ in range(n)}

    assert asyncio.run(workers(4)) == {"a", "b"}
    health.failed("a")
    assert asyncio.run(workers(4)) == {"b"}
    health.failed("b")  # every worker failed: still routed (fail open), over all of them
    assert asyncio.run(workers(4)) == {"a", "b"}
