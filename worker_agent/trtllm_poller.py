"""TensorRT-LLM pull path: `POST /kv_cache_events` on trtllm-serve every interval
(docs/wire-formats.md#tensorrt-llm-pull-path).

The endpoint drains the engine's event queue, so exactly one poller may run per server (a second
one would steal events and both would see gaps). Each body goes through `TrtllmEventConverter`;
its actions are applied in order: `on_batch(rank, batch)` for events, `on_reset(rank, reason)`
when a rank's state became unknown. An unreachable engine is counted and retried at the same pace;
a body that is not a JSON array of events is counted and dropped (its events are lost, the next
event_id shows the gap). So is a body over `max_body_bytes` (`Content-Length` checked before
reading, the body itself counted as it arrives, after decompression) or with more events than the
converter's limit: `oversize_bodies`. Nothing a body holds stops the poll loop.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields

import aiohttp

from kvroute.poller import poll_forever
from kvroute.rate_limited_log import RateLimitedLog
from kvroute.worker_agent.events import DecodedBatch
from kvroute.worker_agent.limits import DEFAULT_MAX_POLL_BYTES
from kvroute.worker_agent.trtllm_events import BodyError, OversizeBodyError, RankEvents, TrtllmEventConverter

log = logging.getLogger("kvroute.agent.trtllm")

RankBatchCallback = Callable[[int | None, DecodedBatch], Awaitable[None] | None]
RankResetCallback = Callable[[int | None, str], Awaitable[None] | None]


@dataclass(slots=True)
class PollerCounters:
    polls: int = 0  # POST /kv_cache_events answered
    poll_failures: int = 0  # requests that failed (engine unreachable, HTTP error, timeout)
    batches: int = 0  # per-rank event batches applied
    callback_errors: int = 0  # exceptions raised by on_batch / on_reset (or, a bug, by a poll)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TrtllmEventPoller:
    def __init__(
        self,
        engine_url: str,
        converter: TrtllmEventConverter,
        on_batch: RankBatchCallback,
        on_reset: RankResetCallback,
        *,
        interval_s: float = 0.1,
        timeout_s: float = 5.0,
        max_body_bytes: int = DEFAULT_MAX_POLL_BYTES,
    ) -> None:
        # Older servers hold the request up to 2 s when the queue is empty: the timeout must exceed that.
        self.url = engine_url.rstrip("/") + "/kv_cache_events"
        self.converter = converter
        self.on_batch, self.on_reset = on_batch, on_reset
        self.interval_s, self.timeout_s, self.max_body_bytes = interval_s, timeout_s, max_body_bytes
        self.counters = PollerCounters()
        self.last_event_id: int | None = None
        self.last_success: float | None = None  # monotonic time of the last answered poll (readiness)
        self.last_error = ""  # why the last poll failed ("" after a success)
        self._log = RateLimitedLog(log)

    def counter_values(self) -> dict[str, int]:
        return {**self.converter.counters.as_dict(), **self.counters.as_dict()}

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.post(self.url) as resp:
                resp.raise_for_status()
                body = await self._read_body(resp)
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.counters.poll_failures += 1
            self.last_error = str(exc) or type(exc).__name__
            self._log.warning("poll", "POST %s failed: %s", self.url, exc or type(exc).__name__)
            return False
        self._log.recovered("poll", "POST %s answers again", self.url)
        self.counters.polls += 1
        self.last_success, self.last_error = time.monotonic(), ""
        try:
            if body is None:
                raise OversizeBodyError(f"response body over {self.max_body_bytes} bytes")
            actions = self.converter.feed(body)
        except BodyError as exc:
            if isinstance(exc, OversizeBodyError):
                self.converter.counters.oversize_bodies += 1
            else:
                self.converter.counters.malformed_frames += 1
            self._log.warning(type(exc).__name__, "KV event response dropped: %s", exc)
            return True
        converter = self.converter
        if converter.last_bad_event:
            self._log.warning("bad_event", "KV event skipped: %s", converter.last_bad_event)
            converter.last_bad_event = None
        if converter.last_unknown_fields:
            self._log.warning(
                "unknown_fields", "KV event fields not known to this agent dropped: %s", ", ".join(converter.last_unknown_fields)
            )
            converter.last_unknown_fields = None
        for action in actions:
            if type(action) is RankEvents:
                self.last_event_id = action.last_id
                self.counters.batches += 1
                await self._call(
                    self.on_batch, action.rank, DecodedBatch(action.last_id, time.time(), action.rank, action.events)
                )
            else:
                log.warning("TRT-LLM KV events, rank %s: %s; worker state reset", action.rank, action.reason)
                await self._call(self.on_reset, action.rank, action.reason)
        return True

    async def _read_body(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The body, or None when it is over max_body_bytes (then not read further)."""
        if resp.content_length is not None and resp.content_length > self.max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _call(self, callback, *args) -> None:
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - one bad batch must not stop the poller
            self.counters.callback_errors += 1
            self._log.warning("callback", "applying TRT-LLM KV events failed", exc_info=True)

    async def run(self) -> None:
        await poll_forever(self._poll_guarded, self.interval_s, self.timeout_s)

    async def _poll_guarded(self, session: aiohttp.ClientSession) -> None:
        try:
            await self.poll_once(session)
        except Exception:  # noqa: BLE001 - a bug must not stop the event stream
            self.counters.callback_errors += 1
            self._log.warning("internal", "polling KV events failed", exc_info=True)
