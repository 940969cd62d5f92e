"""Event-loop plumbing shared by the long-running processes: the entry point on uvloop (a runtime
dependency) and the one way a background task is stopped.

    return run(main())                    # a process's asyncio main, on uvloop
    await cancel_and_wait(task_a, task_b)  # cancelled and finished (None entries are skipped)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import uvloop

log = logging.getLogger(__name__)


def run_value(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop (what the services run on) and return its result: for tools and benches."""
    return uvloop.run(main)


def run(main: Coroutine[Any, Any, int | None]) -> int:
    return int(uvloop.run(main) or 0)


async def cancel_and_wait(*tasks: asyncio.Task | asyncio.Future | None, timeout_s: float | None = None) -> set[asyncio.Future]:
    """Cancel background tasks and wait until they have stopped (at most `timeout_s` when given);
    returns those still running then. A task that had already failed is logged at debug level: its
    failure was its own loop's to report, and stopping it adds nothing."""
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    if not live:
        return set()
    done, pending = await asyncio.wait(live, timeout=timeout_s)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            log.debug("background task %s had failed: %r", name, task.exception())
    return pending
