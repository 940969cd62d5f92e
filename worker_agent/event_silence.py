"""Is the agent's KV event stream silent while its engine works? (the agent's /ready, its log and
`kvroute_agent_event_stream_silent`)

    watch = SilenceWatch(SILENCE_WINDOWS_S["vllm"])
    watch.observe(now, work, last_event_at, block_size)   # each new sample of the engine's own counters
    watch.events_seen(last_event_at)                      # any time: a batch since it turned silent ends it
    watch.silent, watch.reason

Contract: `silent` turns True when, over the last `window_s`, no KV event batch arrived (on any of
the agent's workers) while the engine's own counters (`EngineWork`, worker_agent/engine_metrics.py)
prove it stored at least `min_blocks` new full blocks. Proof, not a guess: a request that computed
t uncached prompt tokens filled at least t / block_size - 1 blocks its engine did not hold, which
an engine with prefix caching and KV events on announces. What it computed without a new block is
at most one block's worth: the partial last block (under block_size tokens), or, for a prompt
cached whole whose length is a multiple of block_size, its last block again (every engine computes
the last prompt token, and SGLang announces nothing for a page its radix tree holds). Over R
requests that computed W tokens in all, that is at least (W - block_size * R) / block_size new
blocks. So an idle engine never makes the stream silent, nor do requests whose prompts were cached
but for their last block (a load test repeating one prompt). Once silent it stays so until a batch
arrives: an engine going idle does not repair the stream. Counters that went backwards (an engine
restart) start the history over.

The window is the longest the engine may take from counting work to publishing its events, plus
margin:
- vLLM: counted when a request is scheduled; its blocks are announced at the end of each step that
  computed them (chunked prefill too): 10 s;
- SGLang: counted when a request finishes; its pages go into the radix tree (and out as events) no
  later: 10 s;
- TensorRT-LLM: counted per iteration; a request's context blocks are stored for reuse when its
  whole (possibly chunked) context phase is done, then pulled or published: 30 s.
A data-parallel engine is judged as a whole: its counters are summed over ranks, so a rank whose
stream alone is silent while the others' events flow is not noticed here (its publisher connection
still is, in the agent's readiness).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvroute.worker_agent.engine_metrics import EngineWork

SILENCE_WINDOWS_S = {"vllm": 10.0, "sglang": 10.0, "trtllm": 30.0}
MIN_BLOCKS = 4  # proven new blocks before the stream counts as silent: a margin over counter timing


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float  # monotonic
    work: EngineWork


class SilenceWatch:
    def __init__(self, window_s: float, min_blocks: int = MIN_BLOCKS) -> None:
        if window_s <= 0 or min_blocks <= 0:
            raise ValueError(f"window_s and min_blocks must be positive, got {window_s}, {min_blocks}")
        self.window_s, self.min_blocks = window_s, min_blocks
        self.silent = False
        self.since: float | None = None  # when it turned silent
        self.reason = ""  # what the engine did meanwhile (for /ready and the log)
        self._samples: deque[_Sample] = deque()

    def observe(self, now: float, work: EngineWork, last_event_at: float | None, block_size: int) -> bool:
        """One sample of the engine's counters taken at `now` (monotonic); `last_event_at`: when the
        last KV batch arrived (None: never). Returns `silent`."""
        self.events_seen(last_event_at)
        samples = self._samples
        if samples and (work.computed_tokens < samples[-1].work.computed_tokens or work.requests < samples[-1].work.requests):
            samples.clear()  # the engine restarted: its counters began again
        samples.append(_Sample(now, work))
        while len(samples) >= 2 and samples[1].at <= now - self.window_s:
            samples.popleft()  # keep one sample at least a window old: the baseline
        base = samples[0]
        if self.silent or now - base.at < self.window_s:
            return self.silent
        if last_event_at is not None and last_event_at >= base.at:
            return False
        tokens = work.computed_tokens - base.work.computed_tokens
        requests = work.requests - base.work.requests
        blocks = int((tokens - block_size * requests) // block_size)
        if blocks >= self.min_blocks:
            self.silent, self.since = True, now
            self.reason = (
                f"the engine computed {tokens:.0f} uncached prompt tokens for {requests:.0f} requests in the "
                f"last {now - base.at:.0f}s (at least {blocks} new {block_size}-token blocks) and no KV event "
                "arrived"
            )
        return self.silent

    def events_seen(self, last_event_at: float | None) -> bool:
        """A batch that arrived since the stream turned silent ends it. Returns `silent`."""
        if self.silent and last_event_at is not None and self.since is not None and last_event_at >= self.since:
            self.silent, self.since, self.reason = False, None, ""
        return self.silent
