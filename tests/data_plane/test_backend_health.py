"""BackendHealth: written by the proxy and the active health checks, read by decisions and readiness
(one direction only); the --health-check-* flags."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from kvroute.cli import parse_args
from kvroute.data_plane.cp_link.control_plane_client import KnownWorker
from kvroute.data_plane.cp_link.inflight import RouterInflight
from kvroute.data_plane.cp_link.query_deadline import QueryDeadline
from kvroute.data_plane.decision.policies import make_policy
from kvroute.data_plane.engines.backend_health import BackendHealth, HealthCheckConfig, HealthChecks
from kvroute.data_plane.service.routing import Router
from kvroute.data_plane.service.routing_service import health_check_config
from kvroute.tools.local_cluster import free_port
from kvroute.v1 import kvroute_pb2 as pb
from tests.helpers import eventually


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


def test_health_checks_take_a_worker_out_after_failures_in_a_row_and_back_after_successes() -> None:
    health = BackendHealth(failures_to_down=3, successes_to_up=2)
    assert health.checked("a", True) is None and health.down() == frozenset()
    assert health.checked("a", False, "refused") is None
    assert health.checked("a", True) is None  # a success in between: the count starts over
    assert [health.checked("a", False, "refused") for _ in range(3)] == [None, None, False]
    assert health.down() == {"a"} and health.last_failure("a") == "refused"
    assert health.checked("a", True) is None and health.down() == {"a"}
    assert health.checked("a", False, "timed out") is None  # a failure in between: the count starts over
    assert [health.checked("a", True) for _ in range(2)] == [None, True]
    assert health.down() == frozenset() and health.cooling_down() == frozenset()


def test_a_workers_first_health_check_decides_alone_and_an_unchecked_one_starts_afresh() -> None:
    health = BackendHealth(failures_to_down=3, successes_to_up=2)
    assert health.checked("dead", False, "refused") is False  # dead when the router starts: out at once
    assert health.checked("alive", True) is None
    assert health.down() == {"dead"}
    health.keep_checks({"alive"})  # "dead" is no longer probed (not in use): its state goes
    assert health.down() == frozenset()
    assert health.checked("dead", True) is None and health.down() == frozenset()


def test_decisions_leave_out_workers_failing_health_checks_unless_every_one_is() -> None:
    health = BackendHealth(failures_to_down=1)
    router = Router(_Fleet(), make_policy("round_robin"), RouterInflight(), health)

    async def workers(n: int) -> set[str]:
        return {(await router.decide("m", [1, 2, 3])).worker_id for _ in range(n)}

    health.checked("a", True)
    health.checked("b", True)
    health.checked("a", False, "refused")
    assert asyncio.run(workers(4)) == {"b"}
    health.failed("b")  # the only one up also failed a request: it is still the one tried, not "a"
    assert asyncio.run(workers(4)) == {"b"}
    health.checked("b", False, "refused")  # every worker down: all are candidates, less the one cooling down
    assert asyncio.run(workers(4)) == {"a"}
    health.checked("a", True)
    health.checked("a", True)  # "a" passes twice (successes_to_up=2): the only one up again
    assert health.down() == {"b"} and asyncio.run(workers(4)) == {"a"}


def test_the_health_check_flags_take_their_defaults_and_refuse_bad_values(tiny_model_dir, capsys) -> None:
    base = ["router", "--tokenizer", str(tiny_model_dir)]
    checks = health_check_config(parse_args(base))
    assert checks == HealthCheckConfig(interval_s=5.0, timeout_s=5.0, failures_to_down=3, successes_to_up=2, path="/health")
    assert health_check_config(parse_args([*base, "--health-check-interval-s", "0"])).interval_s == 0  # off
    for flag, value, says in (
        ("--health-check-interval-s", "-1", "must be >= 0 seconds"),
        ("--health-check-interval-s", "nan", "must be >= 0 seconds"),
        ("--health-check-timeout-s", "0", "must be positive seconds"),
        ("--health-failure-threshold", "0", "must be > 0"),
        ("--health-success-threshold", "1.5", "invalid"),
        ("--health-check-path", "health", "must be a URL path starting with /"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse_args([*base, flag, value])
        assert exited.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith(f"kvroute router: error: argument {flag}: ") and says in error, error


async def test_health_checks_probe_over_http_and_name_what_failed() -> None:
    """Real sockets in this process: an engine answering 200 then 503, one that never answers in time,
    and an address where nothing listens."""
    answer = {"status": 200}
    released = asyncio.Event()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=answer["status"])

    async def hang(_request: web.Request) -> web.Response:
        await released.wait()
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/slow/health", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    targets = {"ok": url, "slow": url + "/slow", "gone": f"http://127.0.0.1:{free_port()}"}
    health_state = BackendHealth(failures_to_down=2, successes_to_up=2)
    checks = HealthChecks(
        health_state, lambda: targets, HealthCheckConfig(interval_s=0.05, timeout_s=0.3, failures_to_down=2, successes_to_up=2)
    )
    checks.start()
    try:
        await eventually(lambda: health_state.down() == {"slow", "gone"}, 10, what="first checks")
        assert "timed out (0.3s)" in health_state.last_failure("slow")
        assert "GET /health failed: " in health_state.last_failure("gone")
        answer["status"] = 503
        await eventually(lambda: "ok" in health_state.down(), 10, what="ok down after its 503s")
        assert health_state.last_failure("ok") == "GET /health answered 503"
        answer["status"] = 200
        del targets["slow"]  # no longer a target: forgotten, not reported down
        await eventually(lambda: health_state.down() == {"gone"}, 10, what="ok back up, slow forgotten")
    finally:
        await checks.close()
        released.set()
        await runner.cleanup()
