"""Fixtures shared by the control plane's tests."""

from __future__ import annotations

import pytest

from kvroute.prefix_index import BitmaskPrefixIndex, BoundedPrefixIndex, PrefixIndex, SetPrefixIndex
from kvroute.prefix_index.native import NativeBoundedPrefixIndex, NativePrefixIndex


def BoundedPrefixIndexUnreached() -> BoundedPrefixIndex:
    """The index --max-index-entries serves, with a bound these tests never reach: it must behave
    exactly as the unbounded one (test_bounded_index.py covers what happens past the bound)."""
    return BoundedPrefixIndex(1 << 40)


def NativeBoundedPrefixIndexUnreached() -> NativeBoundedPrefixIndex:
    """The same for the native backend (--index-backend native --max-index-entries)."""
    return NativeBoundedPrefixIndex(1 << 40)


# The indexes the control plane serves (each backend, unbounded or bounded) and the plain reference they are
# checked against.
INDEX_IMPLEMENTATIONS = [
    NativePrefixIndex,
    NativeBoundedPrefixIndexUnreached,
    BitmaskPrefixIndex,
    BoundedPrefixIndexUnreached,
    SetPrefixIndex,
]


@pytest.fixture(params=INDEX_IMPLEMENTATIONS, ids=lambda c: c.__name__)
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    """Each prefix index implementation in turn, empty."""
    return request.param()
