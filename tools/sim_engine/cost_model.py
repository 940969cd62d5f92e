"""Step-time model of one engine replica, in seconds of (unscaled) model time. Pure and clock-free.

    step_seconds(prefill_tokens, decode_seqs, context_tokens, loaded_tokens)
        = step_overhead_s
        + prefill_tokens / prefill_tokens_per_s
        + (decode_step_s + decode_seqs * decode_per_seq_s        if decode_seqs > 0)
        + context_tokens * decode_per_context_token_s
        + loaded_tokens / cpu_load_tokens_per_s

`context_tokens` = KV-cache tokens the step's decode sequences attend over (the sum of their
current lengths); pass 0 to ignore it. `loaded_tokens` = cached tokens copied back from the CPU
offload tier for requests admitted in this step (0 unless the cache has a CPU tier).

Default: a 70B-class dense model (Llama-3.1-70B-like: 80 layers, d_model 8192, GQA with 8 KV
heads of 128, bf16) with tensor parallelism over one 8-GPU node. Reasoning:
- Prefill is compute-bound at ~2 * 70e9 = 140 GFLOP/token. Eight H100-class GPUs at ~40% of
  ~1 PFLOP/s dense bf16 each give ~3.2 PFLOP/s, i.e. ~20k tokens/s; we use 16k tokens/s to
  account for attention FLOPs on long prompts and TP all-reduces.
- A decode step is memory-bound: 140 GB of weights over 8 * 3.35 TB/s is ~5 ms, plus TP
  all-reduces, kernel launches and sampling; measured steps at small batch are ~15-25 ms. We use
  20 ms per step plus 0.1 ms per running sequence, which folds in the KV reads of a typical
  few-thousand-token context (sampling, per-sequence kernels, KV traffic).
- KV reads explicitly (off by default, so the per-sequence term above carries them):
  2 (K,V) * 80 layers * 8 heads * 128 * 2 bytes = 320 KiB per context token, over 8 * 3.35 TB/s
  of HBM is ~12 ns per token per step (256 sequences of 4k tokens: ~13 ms). To model long
  contexts set `decode_per_context_token_s=1.2e-8` and lower `decode_per_seq_s` to ~0.05 ms.
- 2 ms fixed scheduling / input-preparation overhead per step.
- Loading offloaded KV back from host memory: 320 KiB per token over PCIe. Eight Gen5 x16 links
  would allow ~1M tokens/s, but loads happen per 16-token block (640 KiB per block, 40 KiB per
  GPU under TP 8) through pinned staging buffers, with all GPUs copying at once and sharing host
  memory bandwidth; offload connectors measure a few GB/s per GPU for such copies. ~3.2 GB/s per
  GPU is ~80k tokens/s, 5x the prefill rate, which we use: a CPU hit is far cheaper than
  recomputing the block but not free. The copy is charged to the step that admits the request.
`speedup` (in the server) only divides wall time, so a demo runs faster while every ratio
stays that of the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 16_000.0
    decode_step_s: float = 0.020
    decode_per_seq_s: float = 0.0001
    decode_per_context_token_s: float = 0.0
    step_overhead_s: float = 0.002
    cpu_load_tokens_per_s: float = 80_000.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "cpu_load_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("decode_step_s", "decode_per_seq_s", "decode_per_context_token_s", "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int = 0, loaded_tokens: int = 0) -> float:
        """Duration of one engine step; 0.0 for an empty step."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        t = self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            t += self.decode_step_s + decode_seqs * self.decode_per_seq_s
        t += context_tokens * self.decode_per_context_token_s
        if loaded_tokens:  # only then, so steps without a CPU tier keep their exact float sums
            t += loaded_tokens / self.cpu_load_tokens_per_s
        return t
