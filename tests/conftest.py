"""Hypothesis profiles for the property-based tests (tests/test_hostile_*.py): `ci` (default, what
`make test` runs: ~200 examples per property, no deadline, since this machine's speed varies) and
`fuzz` (many more, for a long hand run, without the 120 s test timeout):
`HYPOTHESIS_PROFILE=fuzz .venv/bin/pytest --timeout 0 tests/test_hostile_*.py`."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_DATA)
settings.register_profile("fuzz", max_examples=20_000, deadline=None, print_blob=True, suppress_health_check=_SLOW_DATA)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
