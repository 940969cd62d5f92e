"""The waits between a reconnect loop's attempts, the one way every kvroute loop computes them.

    backoff = Backoff(initial_s=0.05, max_s=1.0)
    while True:
        try:
            ...                     # one attempt
            backoff.reset()         # it worked: the next failure waits `initial_s` again
        except ConnectionError:
            await backoff.sleep()   # initial_s, then doubling up to max_s

With `jitter` j each wait is drawn from [1 - j, 1 + j] x the current step, so that many clients
that lost one server together (agents, routers) do not come back in step. A loop with waits of its
own (the agent waits for a probe channel instead of sleeping) takes `next_delay()`.

Why not tenacity or backoff: kvroute's loops run forever, reset after a success, rotate replicas
between attempts and sometimes end a wait early; a retry decorator fits none of that, and what is
left to share is these few lines.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    initial_s: float
    max_s: float
    jitter: float = 0.0  # 0..1: each wait is the step x uniform(1 - jitter, 1 + jitter)
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _step_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s <= 0 or not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff needs initial_s, max_s > 0 and 0 <= jitter <= 1, got {self!r}")
        self._step_s = self.initial_s

    @property
    def step_s(self) -> float:
        """The wait the next attempt would get before jitter."""
        return self._step_s

    def reset(self) -> None:
        """An attempt succeeded: start over from `initial_s`."""
        self._step_s = self.initial_s

    def at_least(self, floor_s: float) -> None:
        """Make the next wait at least `floor_s` (a failure known not to clear up soon)."""
        self._step_s = max(self._step_s, floor_s)

    def next_delay(self) -> float:
        """The wait before the next attempt; the one after it doubles (up to `max_s`)."""
        delay = self._step_s
        if self.jitter:
            delay *= self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        self._step_s = min(self._step_s * 2, self.max_s)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())
