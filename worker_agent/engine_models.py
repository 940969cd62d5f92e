"""What the engine serves, from its OpenAI `GET /v1/models`: the base model and its LoRA adapters.

vLLM lists every loaded adapter as its own entry whose `parent` is the base model (its `root` is
the adapter's path); an entry whose id differs from the served model and whose `parent` or `root`
names it is an adapter. Entries without such a link (another served name of the same weights, an
unrelated model) are not. Requests name an adapter in their `model` field, so the router needs the
list to send a request for adapter X only to workers that have X loaded: the agent polls it (the
set changes at run time with vLLM's dynamic LoRA loading) and reports it in `RegisterWorker` and
every `Heartbeat`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
import msgspec

from kvroute.backoff import Backoff
from kvroute.poller import poll_forever
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

    def __init__(self, engine_url: str, model: str | None, on_adapters: Callable[[list[str]], None], *,
                 interval_s: float = 5.0, timeout_s: float = 5.0) -> None:
        self.base = engine_url.rstrip("/")
        self.model = model
        self.on_adapters = on_adapters
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.adapters: list[str] | None = None  # None until the engine answered once
        self.engine_version = ""
        self.failures = 0
        self._problems = RateLimitedLog(log, period_s=60.0)

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.base + "/v1/models") as resp:
                resp.raise_for_status()
                model, adapters = parse_models(await resp.read(), self.model)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.failures += 1
            self._problems.warning("unavailable", "%s/v1/models unavailable (attempt %d): %s", self.base, self.failures,
                                   exc or type(exc).__name__)
            return False
        self._problems.recovered("unavailable", "%s/v1/models available again", self.base)
        self.model = model
        if adapters != self.adapters:
            if self.adapters is not None or adapters:
                log.info("engine %s serves LoRA adapters: %s", self.base, ", ".join(adapters) or "none")
            self.adapters = adapters
            self.on_adapters(adapters)
        return True

    async def discover(self) -> str:
        """Poll until the engine names its model (it may start after the agent); also reads /version."""
        backoff = Backoff(0.5, 5.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            while not await self.poll_once(session):
                await backoff.sleep()
            try:
                async with session.get(self.base + "/version") as resp:
                    if resp.status == 200:
                        self.engine_version = str((await resp.json(content_type=None)).get("version", ""))
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                pass
        assert self.model is not None
        return self.model

    async def run(self) -> None:
        """Poll forever (first poll at once); failures keep the last known adapters."""
        await poll_forever(self.poll_once, self.interval_s, self.timeout_s)
