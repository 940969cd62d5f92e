"""Continuous batching like vLLM's scheduler, pure and clock-free.

Each `step()` admits waiting requests FIFO while KV blocks and sequence slots allow, spends
a token budget (`max_num_batched_tokens`) on one decode token per running sequence and then on
chunked prefill of uncached prompt tokens, and reports what happened and how long the step
took under the cost model. A request's first token is produced in the step that completes its
prefill, so TTFT = queueing + prefill of the uncached tokens (+ the steps it shares).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from sim_engine.cost_model import CostModel
from sim_engine.prefix_cache import Allocation, PrefixCache


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    prompt_hashes: list[int] = field(default_factory=list)
    alloc: Allocation | None = None
    computed: int = 0            # prompt tokens computed or taken from cache
    output: list[int] = field(default_factory=list)
    hashed_tokens: int = 0       # tokens covered by cached full blocks so far

    @property
    def prefill_done(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_tokens


@dataclass(slots=True)
class StepResult:
    seconds: float
    prefill_tokens: int
    new_tokens: list[tuple[SimRequest, int]]
    first_tokens: list[SimRequest]
    finished: list[SimRequest]


class Scheduler:
    def __init__(self, cache: PrefixCache, cost: CostModel, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, vocab_size: int = 2048, seed: int = 0) -> None:
        self.cache = cache
        self.cost = cost
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._rng = random.Random(seed)
        self._token_pool: list[int] = []
        self._pool_offset = 0

    def add(self, request: SimRequest) -> None:
        request.prompt_hashes = self.cache.chain_hashes(request.prompt)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            alloc = self.cache.allocate(req.prompt_hashes, len(req.prompt), len(req.prompt) + req.max_tokens)
            if alloc is None:
                break  # head-of-line waits for blocks, as in vLLM's FCFS
            self.waiting.popleft()
            req.alloc = alloc
            req.computed = alloc.hit_tokens
            req.hashed_tokens = alloc.hit_tokens
            self.running.append(req)

    def step(self) -> StepResult:
        self._admit()
        budget = self.max_num_batched_tokens
        decoders = [r for r in self.running if r.prefill_done]
        budget -= len(decoders)
        prefill_tokens = 0
        first: list[SimRequest] = []
        for req in self.running:
            if req.prefill_done or budget <= 0:
                continue
            chunk = min(len(req.prompt) - req.computed, budget)
            req.computed += chunk
            budget -= chunk
            prefill_tokens += chunk
            if req.prefill_done:
                first.append(req)
        new_tokens: list[tuple[SimRequest, int]] = []
        for req in decoders + first:
            token = self._rng.randrange(3, self.vocab_size)  # skip the first special ids
            req.output.append(token)
            new_tokens.append((req, token))
            self._cache_full_blocks(req)
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self.running.remove(req)
            self.cache.release(req.alloc)
        seconds = self.cost.step_seconds(prefill_tokens, len(decoders))
        return StepResult(seconds, prefill_tokens, new_tokens, first, finished)

    def fast_forward(self, max_steps: int) -> StepResult | None:
        """Run up to `max_steps` pure-decode steps at once (no request waiting or prefilling).

        Equivalent to calling step() that many times, except that the blocks those steps fill are
        cached at the end of the run rather than step by step. The caller bounds `max_steps` by
        the next arrival, so no request could have joined in between. None when not applicable.
        """
        if self.waiting or not self.running or max_steps < 2:
            return None
        if any(not r.prefill_done for r in self.running):
            return None
        k = min(max_steps, min(r.max_tokens - len(r.output) for r in self.running))
        if k < 2:
            return None
        for req in self.running:
            req.output.extend(self._random_tokens(k))
            self._cache_full_blocks(req)
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self.running.remove(req)
            self.cache.release(req.alloc)
        return StepResult(k * self.cost.step_seconds(0, len(self.running) + len(finished)), 0, [], [], finished)

    def _random_tokens(self, k: int) -> list[int]:
        """k output token ids from a seeded pool (content only matters for which blocks match)."""
        if not self._token_pool:
            self._token_pool = [self._rng.randrange(3, self.vocab_size) for _ in range(1 << 16)]
        start = self._pool_offset
        self._pool_offset = (start + k) % len(self._token_pool)
        out = self._token_pool[start:start + k]
        while len(out) < k:
            out += self._token_pool[: k - len(out)]
        return out

    def decode_step_seconds(self) -> float:
        return self.cost.step_seconds(0, len(self.running))

    def _cache_full_blocks(self, req: SimRequest) -> None:
        bs = self.cache.block_size
        # Output tokens are only cached once computed, i.e. all but the newest one.
        tokens_known = len(req.prompt) + len(req.output) - 1
        full = (tokens_known // bs) * bs
        if full <= req.hashed_tokens:
            return
        seq = req.prompt + req.output
        parent = req.alloc.pinned_hashes[-1] if req.alloc.pinned_hashes else None
        span = seq[req.hashed_tokens:full]
        if req.hashed_tokens < len(req.prompt_hashes) * bs:
            # Prompt blocks: hashes were computed at arrival.
            start = req.hashed_tokens // bs
            hashes = req.prompt_hashes[start:full // bs]
            rest = span[len(hashes) * bs:]
            extra = self.cache.chain_hashes(rest, hashes[-1] if hashes else parent) if rest else []
            hashes = hashes + extra
        else:
            hashes = self.cache.chain_hashes(span, parent)
        self.cache.commit(req.alloc, hashes, span)
        req.hashed_tokens = full
