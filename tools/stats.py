"""Latency percentiles for the tools' reports, shared by the simulator, the benches and the demo."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values` by linear interpolation between the closest ranks
    (numpy's default method); 0.0 for no values."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(values, q))
