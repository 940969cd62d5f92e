"""What the engine serves, from its OpenAI `GET /v1/models`: the base model and its LoRA adapters.

vLLM lists every loaded adapter as its own entry whose `parent` is the base model (its `root` is
the adapter's path); an entry whose id differs from the served model and whose `parent` or `root`
names it is an adapter. Entries without such a link (another served name of the same weights, an
unrelated model) are not. Requests name an adapter in their `model` field, so the router needs the
list to send a request for adapter X only to workers that have X loaded: the agent polls it (the
set changes at run time with vLLM's dynamic LoRA loading) and reports it in `RegisterWorker` and
every `Heartbeat`.

The same poll is how the agent knows its engine answers at all (every engine kvroute reads serves
`/v1/models`): `until_answering` retries (0.5 s doubling to 5 s) until it does, `until_gone` polls
every `interval_s` and returns once it has not answered for a given time (retrying meanwhile from
0.5 s up to `interval_s`). `answering`, `last_error` and `failing_since` say how it stands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import msgspec

from kvroute.backoff import Backoff
from kvroute.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvroute.agent.models")


class _Model(msgspec.Struct):
    id: str
    parent: str | None = None
    root: str | None = None


class _ModelList(msgspec.Struct):
    data: list[_Model]


_dec_models = msgspec.json.Decoder(_ModelList)


def parse_models(body: bytes, model: str | None) -> tuple[str, list[str]]:
    """(served model, sorted adapters) from a `/v1/models` body. `model` None: the first entry that is
    not an adapter of another entry. Raises ValueError if the body names no model."""
    try:
        entries = _dec_models.decode(body).data
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not an OpenAI model list: {exc}") from None
    if not entries:
        raise ValueError("the model list is empty")
    if model is None:
        ids = {e.id for e in entries}
        model = next((e.id for e in entries if e.parent not in ids), entries[0].id)
        if not model:
            raise ValueError("the first model has an empty id")
    adapters = sorted({e.id for e in entries if e.id != model and model in (e.parent, e.root)})
    return model, adapters


class EngineModelsPoller:
    """Finds the served model (unless given) and keeps the adapter list current. `on_adapters(list)` is
    called whenever the list changes (and once at the first answer)."""

    def __init__(
        self,
        engine_url: str,
        model: str | None,
        on_adapters: Callable[[list[str]], None],
        *,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.base = engine_url.rstrip("/")
        self.model = model
        self.on_adapters = on_adapters
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.adapters: list[str] | None = None  # None until the engine answered once
        self.engine_version = ""
        self.failures = 0
        self.answering = False  # the last poll was answered with a model list
        self.last_error = ""  # why the last poll failed ("" after an answer)
        self.failing_since: float | None = None  # monotonic time of the first failure in the current run of them
        self._problems = RateLimitedLog(log, period_s=60.0)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.base + "/v1/models") as resp:
                resp.raise_for_status()
                model, adapters = parse_models(await resp.read(), self.model)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.failures += 1
            self.answering, self.last_error = False, str(exc) or type(exc).__name__
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self._problems.warning(
                "unavailable", "%s/v1/models unavailable (attempt %d): %s", self.base, self.failures, self.last_error
            )
            return False
        self._problems.recovered("unavailable", "%s/v1/models available again", self.base)
        self.answering, self.last_error, self.failing_since = True, "", None
        self.model = model
        if adapters != self.adapters:
            if self.adapters is not None or adapters:
                log.info("engine %s serves LoRA adapters: %s", self.base, ", ".join(adapters) or "none")
            self.adapters = adapters
            self.on_adapters(adapters)
        return True

    async def until_answering(self, session: aiohttp.ClientSession) -> str:
        """Poll until the engine names its model (it may start after the agent, or come back), then
        read its /version while that is unknown. Returns the model."""
        backoff = Backoff(0.5, 5.0)
        while not await self.poll_once(session):
            await backoff.sleep()
        if not self.engine_version:
            await self._read_version(session)
        assert self.model is not None
        return self.model

    async def until_gone(self, session: aiohttp.ClientSession, gone_s: float) -> None:
        """Poll every `interval_s` (failures keep the last known adapters); return once the engine has
        not answered for `gone_s`."""
        backoff = Backoff(0.5, max(0.5, self.interval_s))
        while True:
            if await self.poll_once(session):
                backoff.reset()
                await asyncio.sleep(self.interval_s)
                continue
            assert self.failing_since is not None
            left = gone_s - (time.monotonic() - self.failing_since)
            if left <= 0:
                return
            await asyncio.sleep(min(left, backoff.next_delay()))

    async def discover(self) -> str:
        """`until_answering` in a session of its own."""
        async with self.session() as session:
            return await self.until_answering(session)

    async def _read_version(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.base + "/version") as resp:
                if resp.status == 200:
                    self.engine_version = str((await resp.json(content_type=None)).get("version", ""))
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            pass
