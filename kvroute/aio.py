"""Event-loop entry point shared by the long-running processes (uvloop when available)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_value(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop (what the services run on) and return its result: for tools and benches."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)


def run(main: Coroutine[Any, Any, int | None]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, but keep a fallback
        return int(asyncio.run(main) or 0)
    return int(uvloop.run(main) or 0)
