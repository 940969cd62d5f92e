"""Fixtures shared by the control plane's tests."""

from __future__ import annotations

import pytest

from kvroute.control_plane.index import BitmaskPrefixIndex, PrefixIndex, SetPrefixIndex

# The index the control plane serves, and the plain reference it is checked against.
INDEX_IMPLEMENTATIONS = [BitmaskPrefixIndex, SetPrefixIndex]


@pytest.fixture(params=INDEX_IMPLEMENTATIONS, ids=lambda c: c.__name__)
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    """Each prefix index implementation in turn, empty."""
    return request.param()
