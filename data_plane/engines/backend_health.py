"""Which engines to leave out: built once at start-up, written by the proxy and the active health
checks, read by decisions, readiness and the metrics.

    health = BackendHealth(cooldown_s=2.0, failures_to_down=3, successes_to_up=2)
    health.failed(worker_id)        # BackendProxy: an attempt failed before its first byte
    health.checked(worker_id, ok)   # HealthChecks: one active probe's result
    health.cooling_down()           # workers that failed a request lately (passive)
    health.down()                   # workers failing their active health checks

    checks = HealthChecks(health, targets, HealthCheckConfig(interval_s=5.0))
    checks.start(); ...; await checks.close()

Passive: a worker a request failed on sits out `cooldown_s`, so one dead engine does not cost
every request a connect attempt. Active: workers no agent reports on (no heartbeat reaches the
control plane for them: the `--static-workers` fleet) are probed with `GET <endpoint><path>` every
`interval_s`; a 2xx within `timeout_s` is a success, anything else a failure.
`failures_to_down` failures in a row mark a worker down, `successes_to_up` successes in a row
mark it up again (smg's --health-failure-threshold / --health-success-threshold, Envoy's
unhealthy_threshold / healthy_threshold). A worker not probed yet counts as up, and its first
probe alone decides (as Envoy does at start-up), so an engine dead when the router starts is out
after one probe. Decisions leave out down workers unless every one is down, then workers cooling
down unless every remaining one is (`Router.decide`, `build_candidates`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import aiohttp

from kvroute.aio import cancel_and_wait
from kvroute.poller import poll_forever

log = logging.getLogger("kvroute.router.health")


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """The router's --health-check-* flags (defaults: docs/operations.md "Health checks")."""

    interval_s: float = 5.0  # 0 = no active checks
    timeout_s: float = 5.0
    failures_to_down: int = 3
    successes_to_up: int = 2
    path: str = "/health"  # vLLM's and SGLang's liveness path


@dataclass(slots=True)
class _Checked:
    up: bool
    streak: int = 0  # results in a row that disagree with `up`
    last_failure: str = ""


class BackendHealth:
    def __init__(
        self,
        cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        failures_to_down: int = 3,
        successes_to_up: int = 2,
    ) -> None:
        self.cooldown_s = cooldown_s
        self.failures_to_down, self.successes_to_up = failures_to_down, successes_to_up
        self._clock = clock
        self._failed_at: dict[str, float] = {}  # worker_id -> time of its last failure
        self._checked: dict[str, _Checked] = {}  # worker_id -> its active checks' state

    # ------------------------------------------------------------ passive: requests that failed

    def failed(self, worker_id: str) -> bool:
        """Start (or restart) the worker's sit-out; True if it was not sitting out already."""
        now = self._clock()
        last = self._failed_at.get(worker_id)
        self._failed_at[worker_id] = now
        return last is None or now - last > self.cooldown_s

    def cooling_down(self) -> frozenset[str]:
        """Workers that failed within the last `cooldown_s`."""
        if not self._failed_at:
            return frozenset()
        now = self._clock()
        for wid in [w for w, t in self._failed_at.items() if now - t > self.cooldown_s]:
            del self._failed_at[wid]
        return frozenset(self._failed_at)

    # ------------------------------------------------------------ active: health checks

    def checked(self, worker_id: str, ok: bool, why: str = "") -> bool | None:
        """One probe's result (`why`: what failed). Returns the worker's new state when it changed
        (True up, False down), else None."""
        state = self._checked.get(worker_id)
        if state is None:  # the first probe decides alone
            self._checked[worker_id] = _Checked(ok, last_failure="" if ok else why)
            return None if ok else False
        if not ok:
            state.last_failure = why
        if ok == state.up:
            state.streak = 0
            return None
        state.streak += 1
        if state.streak < (self.failures_to_down if state.up else self.successes_to_up):
            return None
        state.up, state.streak = ok, 0
        return ok

    def down(self) -> frozenset[str]:
        """Workers failing their active health checks."""
        return frozenset(w for w, s in self._checked.items() if not s.up) if self._checked else frozenset()

    def last_failure(self, worker_id: str) -> str:
        state = self._checked.get(worker_id)
        return state.last_failure if state is not None else ""

    def keep_checks(self, worker_ids: Collection[str]) -> None:
        """Forget the check state of workers no longer probed (one that comes back starts afresh)."""
        for wid in [w for w in self._checked if w not in worker_ids]:
            del self._checked[wid]


class HealthChecks:
    """Probes `targets()` (worker_id -> endpoint URL, read before each round) every
    `config.interval_s`, all of them at once, and writes the results into `health`."""

    def __init__(self, health: BackendHealth, targets: Callable[[], Mapping[str, str]], config: HealthCheckConfig) -> None:
        self.health, self.targets, self.config = health, targets, config
        self._ssl: ssl.SSLContext | bool = True  # https:// engines: verified with the system's CAs
        self._task: asyncio.Task | None = None
        self.rounds = 0  # probe rounds completed

    def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        """Probe from now on (unless `config.interval_s` is 0); `ssl_context` verifies https:// engines
        (the router's --engine-tls-ca) instead of the system's CAs."""
        if ssl_context is not None:
            self._ssl = ssl_context
        if self._task is None and self.config.interval_s > 0:
            self._task = asyncio.create_task(
                poll_forever(self._round, self.config.interval_s, self.config.timeout_s), name="kvroute-health-checks"
            )

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _round(self, session: aiohttp.ClientSession) -> None:
        targets = dict(self.targets())
        self.health.keep_checks(targets)
        results = await asyncio.gather(*(self._probe(session, url) for url in targets.values()))
        for (worker_id, url), why in zip(targets.items(), results):
            changed = self.health.checked(worker_id, not why, why)
            if changed is False:
                log.warning(
                    "worker %s (%s) is down: %s; routing around it until %d health checks in a row pass",
                    worker_id,
                    url,
                    why,
                    self.health.successes_to_up,
                )
            elif changed:
                log.info("worker %s (%s) is up again: its health checks pass", worker_id, url)
        self.rounds += 1

    async def _probe(self, session: aiohttp.ClientSession, endpoint: str) -> str:
        """ "" when the engine answered 2xx, else what went wrong."""
        try:
            async with session.get(endpoint + self.config.path, ssl=self._ssl, allow_redirects=False) as response:
                await response.read()
                return "" if 200 <= response.status < 300 else f"GET {self.config.path} answered {response.status}"
        except TimeoutError:
            return f"GET {self.config.path} timed out ({self.config.timeout_s:g}s)"
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: an endpoint that is no URL
            return f"GET {self.config.path} failed: {type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
