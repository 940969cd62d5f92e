"""The control-plane query's deadline, fitted to how fast this host answers.

    deadline = clamp(factor x the slowest of the last `window` query latencies, min_s, max_s)

A fixed deadline that suits an idle host silently loses affinity on a loaded one (its queries run
past it and the router decides on load alone); a long fixed one makes a hung control plane cost
every request that long. So the deadline follows the latencies actually seen: every answer counts,
including one that arrives after its query was given up on (the router session reports those: a
loaded host's true latency), and a query that is never answered (a hung control plane) adds
nothing, so the deadline does not grow for it. Until `warmup` latencies are known the deadline is
`max_s`: a router started on a busy host learns the host before it shortens the wait.

The slowest, not a percentile: on a shared host the query latencies are heavy-tailed (a process
that waits a scheduler slice for a CPU answers tens of ms late), and every query past the deadline
is a decision without the index. Measured beside two busy loops and other jobs (load 5-7 on 2
cores): with 3x the p99 the demo's kv_aware router still failed open 1-6 times a run, each time at
the first stall after a calm stretch (deadline 13-28 ms, recent p99 4-9 ms); with 2x the slowest
and a 5 ms floor, once in two runs of three (deadline 5 ms, slowest recent 2.2 ms); with 2x the
slowest and a 25 ms floor, in none of four (`kvroute router --query-timeout-factor 2
--query-timeout-ms 25`). The router keeps a fixed 5 ms deadline by default for now: see docs/operations.md
("Failure behaviour") for the burst that an adaptive deadline places worse.

`factor` 0 (or max_s <= min_s) keeps the deadline fixed at `min_s`. The slowest is recomputed
every `recompute_every` latencies, not per query.
"""

from __future__ import annotations

from collections import deque


class QueryDeadline:
    def __init__(
        self,
        min_s: float,
        max_s: float | None = None,
        factor: float = 0.0,
        window: int = 256,
        warmup: int = 32,
        recompute_every: int = 16,
    ) -> None:
        if min_s <= 0:
            raise ValueError(f"the query deadline must be positive, got {min_s}")
        self.min_s = min_s
        self.max_s = max(max_s if max_s is not None else min_s, min_s)
        self.factor = factor
        self.adaptive = factor > 0 and self.max_s > min_s
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)
        self._recompute_every = recompute_every
        self._since = 0
        self._slowest = 0.0
        self._current = self.max_s if self.adaptive else min_s

    def describe(self) -> str:
        """What the deadline is, for the router's start-up line."""

        def ms(seconds: float) -> str:
            return f"{seconds * 1000:g} ms"

        if not self.adaptive:
            return f"control-plane query deadline {ms(self.min_s)}, fixed"
        return (
            f"control-plane query deadline {self.factor:g} x the slowest of the last {self._recent.maxlen} "
            f"answers, kept within {ms(self.min_s)}-{ms(self.max_s)} ({ms(self.max_s)} until {self.warmup} "
            "answers are known)"
        )

    @classmethod
    def fixed(cls, seconds: float) -> QueryDeadline:
        return cls(seconds)

    @property
    def seconds(self) -> float:
        """The deadline for the next query."""
        return self._current

    @property
    def recent_slowest_s(self) -> float:
        return self._slowest

    def observe(self, seconds: float) -> None:
        """A query's answer arrived `seconds` after it was sent (on time or late)."""
        if not self.adaptive:
            return
        self._recent.append(seconds)
        self._since += 1
        if len(self._recent) < self.warmup or self._since < self._recompute_every:
            return
        self._since = 0
        self._slowest = max(self._recent)
        self._current = min(self.max_s, max(self.min_s, self.factor * self._slowest))
