"""Continuous batching like vLLM's V1 scheduler, pure and clock-free (the fleet simulator reuses it).

Each `step()`:
1. gives every running sequence whose prefill is done one decode token (one token of budget each);
2. continues chunked prefill of running requests, in admission order, within the remaining
   token budget (`max_num_batched_tokens`, shared with the decodes);
3. admits waiting requests FIFO while budget, sequence slots (`max_num_seqs`) and KV blocks
   allow: admission looks up the prompt's cached prefix (those tokens are not computed) and
   reserves blocks (a prefix found on the cache's CPU tier is loaded back and its copy time
   charged to this step); a head-of-line request that does not fit waits (vLLM's FCFS);
4. produces the first output token for every request whose prefill completed in this step
   (so TTFT = queueing + prefill of the uncached tokens + the steps it shares with others)
   and finishes requests that reached max_tokens, unpinning their blocks;
5. prices the step with the cost model and returns a `StepResult`.

Caching per scheduled chunk, as vLLM v1 does (read in vLLM 0.32.0: `vllm/v1/core/kv_cache_manager.py`
`allocate_slots`, `vllm/v1/core/sched/scheduler.py` `schedule`): a request's full blocks enter the
prefix cache, and record BlockStored, when the chunk (or decode token) that computes them is scheduled
in steps 1-3, not when the step ends, so a request admitted later in the same step already hits them.
The prefix is looked up only when a waiting request is tried for admission, so one that waited finds
what was cached meanwhile; a running request never looks again and computes the rest of its prompt
itself, even blocks another request caches meanwhile. With FCFS and no per-request chunk cap (vLLM's
`long_prefill_token_threshold`, off by default; not modelled), every prompt ahead is scheduled in full
before the next one is admitted, so an admitted request sees all of their full blocks. Hits are
counted once, at admission (`PrefixCache.allocate`), as vLLM records them. A step's events are its
batch: the caller publishes them when the step ends, as vLLM does after the forward pass.

The caller owns the clock: run `step()`, wait `result.seconds` (or advance simulated time),
deliver `result.new_tokens`, repeat while `has_work()`. Output length is always `max_tokens`
(no EOS); output token ids are pseudo-random from `seed`.
"""

from __future__ import annotations

import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.block_keys import pack_token_ids
from kvroute.tools.sim_engine.cost_model import CostModel
from kvroute.tools.sim_engine.prefix_cache import BASE_NAMESPACE, Allocation, CacheNamespace, PrefixCache


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: Sequence[int]  # packed into array('I') by Scheduler.add (cheap slices, hashing, events)
    max_tokens: int
    prompt_hashes: list[int] = field(default_factory=list)
    alloc: Allocation | None = None
    computed: int = 0  # prompt tokens computed or taken from cache
    output: array = field(default_factory=lambda: array("I"))
    hashed_tokens: int = 0  # tokens covered by cached full blocks so far
    namespace: CacheNamespace = BASE_NAMESPACE  # LoRA adapter and cache salt: which blocks it may share
    remote_prefilled: bool = False  # P/D decode leg: the prompt's KV came from a prefill worker, none is computed

    @property
    def prefill_done(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_tokens

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until admitted)."""
        return self.alloc.hit_tokens if self.alloc else 0


@dataclass(slots=True)
class StepResult:
    seconds: float  # model time of this step (cost model)
    prefill_tokens: int  # prompt tokens computed in this step
    new_tokens: list[tuple[SimRequest, int]]  # (request, output token) in this step
    first_tokens: list[SimRequest]  # requests whose first token came out in this step
    finished: list[SimRequest]  # requests that reached max_tokens in this step
    decode_seqs: int = 0
    context_tokens: int = 0
    admitted: list[SimRequest] = field(default_factory=list)
    loaded_tokens: int = 0  # cached tokens copied back from the CPU tier in this step


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache,
        cost: CostModel,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        vocab_size: int = 2048,
        seed: int = 0,
        min_token_id: int = 3,
    ) -> None:
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if not 0 <= min_token_id < vocab_size:
            raise ValueError("need 0 <= min_token_id < vocab_size")
        self.cache = cache
        self.cost = cost
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.min_token_id = min_token_id
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._rng = random.Random(seed)
        self._token_pool: list[int] = []
        self._pool_offset = 0

    # ------------------------------------------------------------------ queue

    def add(self, request: SimRequest) -> None:
        """Queue a request. Raises ValueError (CacheFullError) if it could never run on this engine."""
        if not request.prompt:
            raise ValueError("prompt must not be empty")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.cache.check_fits(len(request.prompt) + request.max_tokens)
        request.prompt = pack_token_ids(request.prompt)
        request.prompt_hashes = self.cache.chain_hashes(request.prompt, namespace=request.namespace)
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (client went away), releasing its blocks."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                if req.alloc is not None:
                    self.cache.release(req.alloc)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, counting waiting requests in full (no cache lookup)."""
        return sum(len(r.prompt) - r.computed for r in self.running) + sum(len(r.prompt) for r in self.waiting)

    # ------------------------------------------------------------------ step

    def step(self) -> StepResult:
        budget = self.max_num_batched_tokens
        decoders = [r for r in self.running if r.prefill_done][:budget]
        budget -= len(decoders)
        context_tokens = sum(len(r.prompt) + len(r.output) for r in decoders)
        prefill_tokens = 0
        first: list[SimRequest] = []
        for req in decoders:  # this step computes the KV of every token it has, the newest output token's too
            self._cache_full_blocks(req, len(req.prompt) + len(req.output))

        def prefill(req: SimRequest) -> None:
            nonlocal budget, prefill_tokens
            chunk = min(len(req.prompt) - req.computed, budget)
            req.computed += chunk
            budget -= chunk
            prefill_tokens += chunk
            # Cached when scheduled, as vLLM's allocate_slots does: a request admitted later in this
            # very step already finds these blocks.
            self._cache_full_blocks(req, req.computed)
            if req.prefill_done:
                first.append(req)

        for req in self.running:
            if budget <= 0:
                break
            if not req.prefill_done:
                prefill(req)
        admitted: list[SimRequest] = []
        loaded_tokens = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Looked up on every try, so a request kept waiting finds what was cached meanwhile.
            alloc = self.cache.allocate(req.prompt_hashes, len(req.prompt), len(req.prompt) + req.max_tokens, req.namespace)
            if alloc is None:
                break  # head-of-line waits for blocks, as in vLLM's FCFS
            loaded_tokens += alloc.loaded_tokens
            self.waiting.popleft()
            req.alloc = alloc
            req.computed = req.hashed_tokens = alloc.hit_tokens
            if req.remote_prefilled:  # its KV arrived: the blocks are stored (and announced), not computed
                req.computed = len(req.prompt)
            self.running.append(req)
            admitted.append(req)
            prefill(req)

        new_tokens: list[tuple[SimRequest, int]] = []
        for req in decoders + first:
            token = self._rng.randrange(self.min_token_id, self.vocab_size)
            req.output.append(token)
            new_tokens.append((req, token))
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self.running.remove(req)
            self.cache.release(req.alloc)
        seconds = self.cost.step_seconds(prefill_tokens, len(decoders), context_tokens, loaded_tokens)
        return StepResult(
            seconds, prefill_tokens, new_tokens, first, finished, len(decoders), context_tokens, admitted, loaded_tokens
        )

    def fast_forward(self, max_steps: int) -> StepResult | None:
        """Run up to `max_steps` pure-decode steps at once (no request waiting or prefilling).

        Equivalent to calling step() that many times, except that the blocks those steps fill are
        cached at the end of the run rather than step by step, and `new_tokens` is left empty. The
        caller bounds `max_steps` by the next arrival, so no request could have joined in between.
        None when not applicable (then call step()).
        """
        if self.waiting or not self.running or max_steps < 2:
            return None
        if any(not r.prefill_done for r in self.running):
            return None
        k = min(max_steps, min(r.max_tokens - len(r.output) for r in self.running))
        if k < 2:
            return None
        n = len(self.running)
        context0 = sum(len(r.prompt) + len(r.output) for r in self.running)
        for req in self.running:
            req.output.extend(self._random_tokens(k))
            self._cache_full_blocks(req, len(req.prompt) + len(req.output) - 1)  # the newest token has no KV yet
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self.running.remove(req)
            self.cache.release(req.alloc)
        # k steps of n decodes; the context grows by n tokens per step.
        seconds = k * self.cost.step_seconds(0, n) + self.cost.decode_per_context_token_s * (k * context0 + n * k * (k - 1) // 2)
        return StepResult(seconds, 0, [], [], finished, n, k * context0 + n * k * (k - 1) // 2)

    def _random_tokens(self, k: int) -> list[int]:
        """k output token ids from a seeded pool (content only matters for which blocks match)."""
        if not self._token_pool:
            self._token_pool = [self._rng.randrange(self.min_token_id, self.vocab_size) for _ in range(1 << 12)]
        start = self._pool_offset
        self._pool_offset = (start + k) % len(self._token_pool)
        out = self._token_pool[start : start + k]
        while len(out) < k:
            out += self._token_pool[: k - len(out)]
        return out

    def decode_step_seconds(self) -> float:
        """Duration of the next step if it only decodes every running sequence (0.0 if none run)."""
        return self.cost.step_seconds(0, len(self.running), sum(len(r.prompt) + len(r.output) for r in self.running))

    def _cache_full_blocks(self, req: SimRequest, tokens_known: int) -> None:
        """Cache `req`'s blocks that the first `tokens_known` tokens (prompt, then output) fill."""
        bs = self.cache.block_size
        full = (tokens_known // bs) * bs
        if full <= req.hashed_tokens:
            return
        seq = req.prompt + req.output if full > len(req.prompt) else req.prompt
        parent = req.alloc.pinned_hashes[-1] if req.alloc.pinned_hashes else None
        span = seq[req.hashed_tokens : full]
        prompt_full = len(req.prompt_hashes) * bs
        if req.hashed_tokens < prompt_full:
            # Prompt blocks: hashed at arrival; any decode blocks continue the chain from them.
            hashes = req.prompt_hashes[req.hashed_tokens // bs : full // bs]
            rest = span[len(hashes) * bs :]
            if rest:
                hashes = hashes + self.cache.chain_hashes(rest, hashes[-1] if hashes else parent, req.namespace)
        else:
            hashes = self.cache.chain_hashes(span, parent, req.namespace)
        self.cache.commit(req.alloc, hashes, span)
        req.hashed_tokens = full
