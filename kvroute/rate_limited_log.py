"""A logger wrapper for problems that can repeat many times a second (a publisher gone bad, every
engine down, a control plane unreachable): one line per kind of problem per period, with how many
were left out, and one line when the problem is over. Every kvroute loop that retries or polls
logs its failures through it.

    problems = RateLimitedLog(log, period_s=60)
    problems.warning("unreachable", "control plane %s unreachable: %s", address, why)  # at most once a minute
    problems.recovered("unreachable", "control plane %s reachable again", address)     # once, if it was logged
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most one line per `period_s` per kind of problem; the rest are counted and summarised
    in the next line of that kind."""

    def __init__(self, logger: logging.Logger, period_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.period_s, self.clock = logger, period_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log `msg` at `level` unless a line of `kind` was logged less than `period_s` ago (then
        count it). Returns whether it was logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.period_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        self._last[kind] = now
        return True

    def warning(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.WARNING, kind, msg, *args, exc_info=exc_info)

    def error(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, kind, msg, *args, exc_info=exc_info)

    def recovered(self, kind: str, msg: str | None = None, *args: object) -> bool:
        """The problem `kind` is over: if a line of it was logged, log `msg` at INFO (None: the caller
        says so itself); either way its next occurrence is logged at once. Returns whether a line of
        `kind` had been logged."""
        self._suppressed.pop(kind, None)
        if self._last.pop(kind, None) is None:
            return False
        if msg is not None:
            self.logger.info(msg, *args)
        return True
