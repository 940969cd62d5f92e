"""A logger wrapper for problems that can repeat many times a second (a publisher gone bad, every
engine down): one line per kind of problem per period, with how many were left out."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one warning per `period_s` per kind of problem; the rest are counted and summarised
    in the next warning of that kind."""

    def __init__(self, logger: logging.Logger, period_s: float = 5.0) -> None:
        self.logger, self.period_s = logger, period_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.period_s) >= self.period_s:
            suppressed = self._suppressed.pop(kind, 0)
            if suppressed:
                msg += f" ({suppressed} similar messages suppressed)"
            self.logger.warning(msg, *args, exc_info=exc_info)
            self._last[kind] = now
        else:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
