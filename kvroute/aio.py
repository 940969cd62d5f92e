"""Event-loop entry point shared by the long-running processes (uvloop when available)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, int | None]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, but keep a fallback
        return int(asyncio.run(main) or 0)
    return int(uvloop.run(main) or 0)
