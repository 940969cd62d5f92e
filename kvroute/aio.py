"""Event-loop entry point shared by the long-running processes: uvloop (a runtime dependency)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import uvloop


def run_value(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop (what the services run on) and return its result: for tools and benches."""
    return uvloop.run(main)


def run(main: Coroutine[Any, Any, int | None]) -> int:
    return int(uvloop.run(main) or 0)
