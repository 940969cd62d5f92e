"""The shared plumbing every loop uses: Backoff (reconnect waits) and RateLimitedLog (repeated problems)."""

from __future__ import annotations

import logging
import random

import pytest

from kvroute.backoff import Backoff
from kvroute.rate_limited_log import RateLimitedLog


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next_delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == 0.1
    backoff.at_least(2.0)  # a failure known to last: the floor, then the cap again
    assert [backoff.next_delay(), backoff.next_delay()] == [2.0, 0.5]


def test_backoff_jitter_stays_within_its_band() -> None:
    backoff = Backoff(1.0, 1.0, jitter=0.5, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(200)]
    assert all(0.5 <= d <= 1.5 for d in delays) and len(set(delays)) == 200


def test_backoff_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(0, 1.0)
    with pytest.raises(ValueError):
        Backoff(0.1, 1.0, jitter=2)


def test_rate_limited_log_one_line_per_period_then_a_summary_and_a_recovery(caplog) -> None:
    now = [0.0]
    problems = RateLimitedLog(logging.getLogger("kvroute.test.plumbing"), period_s=10, clock=lambda: now[0])
    caplog.set_level(logging.INFO, "kvroute.test.plumbing")
    assert problems.warning("down", "down %d", 1)
    assert not problems.warning("down", "down %d", 2) and not problems.warning("down", "down %d", 3)
    assert problems.error("other", "another kind is not held back")
    now[0] = 10.0
    assert problems.warning("down", "down %d", 4)
    assert problems.recovered("down", "up again")
    assert not problems.recovered("down", "up again")  # nothing was logged since
    assert problems.warning("down", "down %d", 5)  # a new outage is news at once
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "down 1"),
        ("ERROR", "another kind is not held back"),
        ("WARNING", "down 4 (2 similar messages suppressed)"),
        ("INFO", "up again"),
        ("WARNING", "down 5"),
    ]
