"""Step-time model of one engine replica, in seconds of (unscaled) model time.

Default: a 70B-class dense model (Llama-3.1-70B-like, bf16) with tensor parallelism over one
8-GPU node. Reasoning for the numbers: prefill is compute-bound at ~2*70e9 FLOP/token; eight
H100-class GPUs at ~40% of ~1 PFLOP/s dense bf16 each give ~3.2 PFLOP/s, i.e. ~20k tokens/s;
we use 16k tokens/s to account for attention cost on long prompts. A decode step is
memory-bound: 140 GB of weights over ~8*3.35 TB/s plus TP all-reduces is ~15-25 ms; we use
20 ms plus 0.1 ms per running sequence for KV reads. `speedup` only scales wall time, so a
demo runs faster while every ratio stays that of the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 16_000.0
    decode_step_s: float = 0.020
    decode_per_seq_s: float = 0.0001
    step_overhead_s: float = 0.002

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        t = self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            t += self.decode_step_s + decode_seqs * self.decode_per_seq_s
        return t
