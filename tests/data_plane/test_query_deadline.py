"""The control-plane query deadline follows the host's query latencies within its bounds."""

from __future__ import annotations

import pytest

from kvroute.data_plane.cp_link.query_deadline import QueryDeadline


def test_fixed_deadline_never_moves() -> None:
    deadline = QueryDeadline.fixed(0.005)
    for _ in range(100):
        deadline.observe(0.2)
    assert deadline.seconds == 0.005 and not deadline.adaptive


def test_it_waits_the_longest_until_it_knows_the_host_then_follows_its_slowest_answers() -> None:
    deadline = QueryDeadline(0.005, 0.05, factor=3.0, window=64, warmup=32, recompute_every=16)
    assert deadline.seconds == 0.05  # nothing known yet: a busy host must not lose its first queries
    for _ in range(31):
        deadline.observe(0.001)
    assert deadline.seconds == 0.05
    deadline.observe(0.001)
    assert deadline.seconds == 0.005  # 3 x 1 ms is under the floor
    for _ in range(64):  # the host slows down: answers (late ones included) take 4 ms
        deadline.observe(0.004)
    assert deadline.seconds == pytest.approx(0.012) and deadline.recent_slowest_s == pytest.approx(0.004)
    deadline.observe(0.009)  # one stall: the next recompute covers it
    for _ in range(15):
        deadline.observe(0.001)
    assert deadline.seconds == pytest.approx(0.027)
    for _ in range(64):
        deadline.observe(0.1)  # far past the bound: clamped
    assert deadline.seconds == 0.05


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        QueryDeadline(0.0)
    assert not QueryDeadline(0.01, 0.005, factor=3.0).adaptive  # a max under the min: fixed at the min
