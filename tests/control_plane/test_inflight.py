"""InflightTracker on its own (a manual clock): reservation sums, exclusion of the asking router,
speculative claims and every way they end."""

from __future__ import annotations

import pytest

from kvroute.fleet.answer import answer_columns
from kvroute.fleet.inflight import DuplicateReservation, InflightTracker
from kvroute.fleet.state import FleetState
from kvroute.prefix_index import TierMatch


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def tracker(index, clock) -> InflightTracker:
    return InflightTracker(index, default_ttl_s=5.0, max_age_s=60.0, clock=clock)


def test_sums_per_worker_exclude_the_asking_router(tracker: InflightTracker) -> None:
    a, b = tracker.open_session("router-a"), tracker.open_session("router-b")
    tracker.reserve(a, 1, slot=0, keys=[], prefill_tokens=100)
    tracker.reserve(a, 2, slot=0, keys=[], prefill_tokens=50)
    tracker.reserve(b, 1, slot=0, keys=[], prefill_tokens=7)  # ids are per session
    tracker.reserve(b, 2, slot=3, keys=[], prefill_tokens=0)
    assert tracker.reserved_by_others(0, None) == (3, 157)
    assert tracker.reserved_by_others(0, a.router) == (1, 7)
    assert tracker.reserved_by_others(0, b.router) == (2, 150)
    assert tracker.reserved_by_others(3, a.router) == (1, 0) and tracker.reserved_by_others(3, b.router) == (0, 0)
    assert tracker.prefill_done(a, 1)
    assert tracker.reserved_by_others(0, b.router) == (2, 50)  # still a request, no longer prefill
    assert tracker.prefill_done(a, 1)  # twice is harmless
    assert tracker.release(a, 1) and not tracker.release(a, 1)
    assert not tracker.prefill_done(a, 99)
    assert tracker.reserved_by_others(0, b.router) == (1, 50)
    assert tracker.counters.unknown_reservation == 2
    assert tracker.reservation_count() == 3


def test_sessions_of_one_router_share_its_exclusion(tracker: InflightTracker) -> None:
    """A router that reconnected before its old stream closed still tracks both sets itself."""
    old, new = tracker.open_session("router-a"), tracker.open_session("router-a")
    tracker.reserve(old, 1, slot=0, keys=[], prefill_tokens=10)
    tracker.reserve(new, 1, slot=0, keys=[], prefill_tokens=20)
    assert tracker.reserved_by_others(0, new.router) == (0, 0)
    tracker.close_session(old)
    assert tracker.reserved_by_others(0, None) == (1, 20)
    assert tracker.counters.closed_with_session == 1
    tracker.close_session(new)
    assert tracker.routers == {} and tracker.requests == {} and tracker.prefill_tokens == {}


def test_duplicate_live_id_is_refused_and_changes_nothing(tracker: InflightTracker) -> None:
    session = tracker.open_session("r")
    tracker.reserve(session, 5, slot=0, keys=[1], prefill_tokens=10)
    with pytest.raises(DuplicateReservation, match="already live"):
        tracker.reserve(session, 5, slot=1, keys=[2], prefill_tokens=10)
    assert tracker.reserved_by_others(1, None) == (0, 0) and tracker.index.match_tiers([2]) == TierMatch()
    tracker.release(session, 5)
    tracker.reserve(session, 5, slot=1, keys=[], prefill_tokens=1)  # free again once released


def test_claims_cover_only_what_the_worker_does_not_hold(tracker: InflightTracker) -> None:
    index = tracker.index
    index.store(0, [1, 2])
    session = tracker.open_session("r")
    tracker.reserve(session, 1, slot=0, keys=[1, 2, 3, 4], prefill_tokens=32)
    assert index.match_tiers([1, 2, 3, 4, 5]) == TierMatch(depth={0: 4}, speculative_blocks={0: 2})
    assert tracker.claim_count() == 2
    tracker.release(session, 1)
    assert index.match_tiers([1, 2, 3, 4]) == TierMatch(depth={0: 2}) and tracker.claim_count() == 0


def test_claims_expire_at_their_ttl_while_the_reservation_lives(tracker: InflightTracker, clock) -> None:
    index = tracker.index
    session = tracker.open_session("r")
    tracker.reserve(session, 1, slot=0, keys=[1, 2], prefill_tokens=0)  # default TTL: 5 s
    tracker.reserve(session, 2, slot=1, keys=[1], prefill_tokens=0, ttl_ms=500)
    clock.now += 0.4
    tracker.expire()
    assert index.match_tiers([1, 2]).depth == {0: 2, 1: 1}
    clock.now += 0.2
    tracker.expire()
    assert index.match_tiers([1, 2]).depth == {0: 2}
    clock.now += 5
    tracker.expire()
    assert index.match_tiers([1, 2]) == TierMatch()
    assert tracker.counters.claims_expired == 2
    assert tracker.reserved_by_others(0, None) == (1, 0)  # the request itself still counts
    tracker.release(session, 1)  # after its claims expired: nothing left to unclaim
    assert tracker.claim_count() == 0


def test_a_shared_claim_lasts_until_its_last_voucher_goes(tracker: InflightTracker, clock) -> None:
    index = tracker.index
    a, b = tracker.open_session("a"), tracker.open_session("b")
    tracker.reserve(a, 1, slot=0, keys=[1, 2], prefill_tokens=0, ttl_ms=1000)
    tracker.reserve(b, 1, slot=0, keys=[1, 2, 3], prefill_tokens=0, ttl_ms=3000)
    tracker.release(a, 1)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 3}, speculative_blocks={0: 3})
    clock.now += 3
    tracker.expire()
    assert index.match_tiers([1, 2, 3]) == TierMatch()


def test_confirmed_claims_go_and_old_vouchers_do_not_touch_new_ones(tracker: InflightTracker) -> None:
    index = tracker.index
    a, b = tracker.open_session("a"), tracker.open_session("b")
    tracker.reserve(a, 1, slot=0, keys=[1, 2, 3], prefill_tokens=0)
    # The engine stored 1 and 2: the index holds them, the claims are no longer needed.
    index.store(0, [1, 2])
    tracker.confirm(0, [1, 2])
    assert tracker.counters.claims_confirmed == 2 and tracker.claim_count() == 1
    # The engine evicts 2 again; another router's request claims it anew.
    index.remove(0, [2])
    tracker.reserve(b, 1, slot=0, keys=[1, 2], prefill_tokens=0)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 3}, speculative_blocks={0: 2})
    # a's release must not take b's claim on 2 (a vouched for the confirmed one, not this one).
    tracker.release(a, 1)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 2}, speculative_blocks={0: 1})
    tracker.release(b, 1)
    assert index.match_tiers([1, 2, 3]) == TierMatch(depth={0: 1}) and tracker.claim_count() == 0


def test_reservations_expire_at_max_age(tracker: InflightTracker, clock) -> None:
    session = tracker.open_session("r")
    tracker.reserve(session, 1, slot=0, keys=[1], prefill_tokens=10, ttl_ms=600_000)  # TTL capped at max age
    clock.now += 30
    tracker.reserve(session, 2, slot=0, keys=[], prefill_tokens=5)
    clock.now += 31
    tracker.expire()
    assert tracker.reserved_by_others(0, None) == (1, 5) and tracker.counters.expired == 1
    assert tracker.index.match_tiers([1]) == TierMatch() and tracker.claim_count() == 0
    assert not tracker.release(session, 1)  # already gone
    clock.now += 30
    tracker.expire()
    assert tracker.reservation_count() == 0 and tracker.requests == {}


def test_cleared_worker_loses_claims_dropped_worker_loses_everything(tracker: InflightTracker) -> None:
    index = tracker.index
    session = tracker.open_session("r")
    tracker.reserve(session, 1, slot=0, keys=[1, 2], prefill_tokens=10)
    tracker.reserve(session, 2, slot=1, keys=[1, 2], prefill_tokens=20)
    tracker.slot_cleared(0)
    assert index.match_tiers([1, 2]).depth == {1: 2}
    assert tracker.reserved_by_others(0, None) == (1, 10)
    tracker.slot_dropped(1)
    assert index.match_tiers([1, 2]) == TierMatch()
    assert tracker.reserved_by_others(1, None) == (0, 0) and tracker.counters.dropped_with_worker == 1
    assert not tracker.release(session, 2)  # the router's later release is counted, not an error
    tracker.release(session, 1)
    assert tracker.reservation_count() == 0 and tracker.claim_count() == 0


def test_bad_settings_are_refused(index) -> None:
    with pytest.raises(ValueError):
        InflightTracker(index, default_ttl_s=0)


def test_the_answer_counts_the_other_routers_deciding_on_the_fleet() -> None:
    state = FleetState.build()
    assert answer_columns(state, "m", {}).other_routers == 0  # alone
    mine = state.inflight.open_session("router-a")
    state.inflight.open_session("router-b")
    state.inflight.open_session("router-b")  # one router, two sessions (it moved replicas)
    assert answer_columns(state, "m", {}, "", mine.router).other_routers == 1
    assert answer_columns(state, "m", {}).other_routers == 2  # a unary query names no router
