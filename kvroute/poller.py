"""Periodic HTTP polling, the loop the pollers of an engine run (its /metrics, TensorRT-LLM's
/kv_cache_events; the agent's /v1/models poll retries faster while the engine does not answer, see
worker_agent/engine_models.py): one aiohttp session for the poller's life, whose requests time out
after `timeout_s`; a poll now, then one every `interval_s` after the previous one ended. A poll
handles its own failures (counts them, logs them through `RateLimitedLog`): one that raises ends the
loop, as a bug should.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp


async def poll_forever(
    poll_once: Callable[[aiohttp.ClientSession], Awaitable[object]], interval_s: float, timeout_s: float
) -> None:
    """Call `poll_once(session)` now and every `interval_s` after; returns only by cancellation."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        while True:
            await poll_once(session)
            await asyncio.sleep(interval_s)
