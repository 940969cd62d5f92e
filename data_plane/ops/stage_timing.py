"""Where a request's time goes inside the router, stage by stage (`kvroute router --stage-timing`).

    samples = StageSamples()              # once per router, only with --stage-timing
    clock = samples.start()               # per request; None when off, and every mark is skipped
    clock.mark("parse") ... clock.mark("first_byte")
    samples.record(clock)                 # GET /debug/stages returns the samples (ms) per stage

Stages, each from the end of the previous one (the first from the handler's start):
    parse       read the body, parse the fields routing needs
    prepare     model/adapter check, tokenize, length check
    keys        block keys of the prompt per block size
    query       the control plane's answer (or the fail-open decision not to wait for it)
    score       candidates and the policy's choice
    connect     send to the engine until its response headers (a pooled connection: no handshake;
                includes the engine's own time to headers)
    first_byte  the engine's first body byte read and written to the client

What happens before the handler runs (accepting the connection, parsing the request line and
headers) and after it returns is not here; `kvroute bench proxy` measures it as the floor of a
pass-through on the same HTTP stack. Off (the default), a request pays one `is None` test per stage.
Samples are per-process and bounded (the last `max_samples` of each stage).
"""

from __future__ import annotations

import time
from collections import deque

STAGES = ("parse", "prepare", "keys", "query", "score", "connect", "first_byte")


class StageClock:
    __slots__ = ("_last", "durations")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.durations: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """End `stage` now (a stage marked twice, e.g. a retried connect, adds up)."""
        now = time.perf_counter()
        self.durations[stage] = self.durations.get(stage, 0.0) + now - self._last
        self._last = now


class StageSamples:
    def __init__(self, max_samples: int = 100_000) -> None:
        self._samples: dict[str, deque[float]] = {s: deque(maxlen=max_samples) for s in STAGES}

    def start(self) -> StageClock:
        return StageClock()

    def record(self, clock: StageClock) -> None:
        for stage, seconds in clock.durations.items():
            self._samples[stage].append(seconds * 1000.0)

    def as_json(self, reset: bool = False) -> dict[str, list[float]]:
        """Samples in ms per stage, oldest first (`reset`: and start over)."""
        out = {stage: list(values) for stage, values in self._samples.items()}
        if reset:
            for values in self._samples.values():
                values.clear()
        return out
