"""Workloads for the simulator: Mooncake JSONL traces and a generated suite.

Every request carries real token ids, so the router-side hashing, the index and the engines'
caches all run on the same bytes they would see live.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvroute.block_keys import pack_token_ids

MOONCAKE_BLOCK_TOKENS = 512  # what a hash id stands for in the public Mooncake traces, which name no block size
_TOKEN_ID_LIMIT = 1 << 32


@dataclass(slots=True)
class SimWorkloadRequest:
    arrival_s: float
    tokens: array  # array('I'): 4 bytes a token, sliced and hashed without per-token Python work
    output_tokens: int
    session: str = ""  # conversation id (multi-turn), the session policy's key; "" = no session


@dataclass
class Trace:
    """A trace's requests and the block size its hash ids stand for."""

    requests: list[SimWorkloadRequest]
    block_size: int
    tail_token_share: float  # of all prompt tokens, those in a partial last block (never shared)


class _TraceRow(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_size: int | None = None  # written by `kvroute router --capture-trace`; absent in Mooncake's traces


def load_mooncake_trace(path: str | Path, limit: int | None = None) -> Trace:
    """`timestamp` (ms), `input_length`, `output_length`, `hash_ids` per line, and optionally
    `block_size`: the tokens each hash id stands for (every row must agree; without it, Mooncake's
    512). Equal hash ids get equal token ids, so shared blocks are shared prefixes exactly as in the
    trace. Raises ValueError on a malformed row."""
    decoder = msgspec.json.Decoder(_TraceRow)
    block_tokens: dict[int, array] = {}
    out: list[SimWorkloadRequest] = []
    block_size: int | None = None
    filler = array("I")
    size_line = 0
    tail_tokens = total_tokens = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row: {exc}") from exc
            row_block_size = MOONCAKE_BLOCK_TOKENS if row.block_size is None else row.block_size
            if block_size is None:
                if row_block_size <= 0:
                    raise ValueError(f"{path}:{line_no}: block_size must be positive, got {row_block_size}")
                block_size, size_line = row_block_size, line_no
                # The filler after each block's id is shared, so building a block is a copy.
                filler = array("I", range(1, block_size))
            elif row_block_size != block_size:
                raise ValueError(
                    f"{path}:{line_no}: block_size {row_block_size} (a row without one means "
                    f"{MOONCAKE_BLOCK_TOKENS}), but line {size_line} has {block_size}: one trace, one "
                    "block size"
                )
            if len(row.hash_ids) * block_size < row.input_length:
                raise ValueError(
                    f"{path}:{line_no}: {len(row.hash_ids)} hash ids of {block_size} tokens cannot "
                    f"cover input_length {row.input_length}"
                )
            tokens = array("I")
            for h in row.hash_ids:
                block = block_tokens.get(h)
                if block is None:
                    # The id itself as the first token makes blocks with different ids differ.
                    block = block_tokens[h] = array("I", (h % _TOKEN_ID_LIMIT,)) + filler
                tokens += block
            if row.input_length < len(tokens):
                del tokens[row.input_length :]
            tail_tokens += row.input_length % block_size
            total_tokens += row.input_length
            out.append(SimWorkloadRequest(row.timestamp / 1000.0, tokens, max(1, row.output_length)))
            if limit and len(out) >= limit:
                break
    return Trace(out, block_size or MOONCAKE_BLOCK_TOKENS, tail_tokens / total_tokens if total_tokens else 0.0)


@dataclass
class GeneratedWorkload:
    """Knobs shared by the generated suite."""

    name: str
    requests: int = 2000
    rate_rps: float = 20.0
    arrival: str = "poisson"  # or "bursty"
    seed: int = 0
    system_prompt_tokens: int = 2048  # shared-prefix / agent schema size
    groups: int = 8  # distinct shared prompts / documents / agents
    user_tokens: int = 256
    output_tokens: int = 128
    turns: int = 4
    docs: int = 32
    doc_tokens: int = 2048
    docs_per_request: int = 2
    hot_share: float = 0.6  # hot-prefix: share of requests on the one hot system prompt
    burst_size: int = 4  # bursts: requests per burst, all on one prefix
    burst_gap_ms: float = 1.5  # bursts: between two requests of a burst
    new_prefix_share: float = 0.5  # bursts: share of bursts on a prefix never seen before


WORKLOAD_NAMES = ("shared-prefix", "multi-turn", "rag", "agent", "one-shot", "hot-prefix", "bursts")


def _arrivals(w: GeneratedWorkload, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for i in range(w.requests):
        if w.arrival == "bursty":  # on/off: bursts at 4x the rate, then silence, same mean rate
            t += rng.expovariate(w.rate_rps * 4) if (i // 50) % 2 == 0 else rng.expovariate(w.rate_rps * 4 / 7)
        else:
            t += rng.expovariate(w.rate_rps)
        out.append(t)
    return out


def generate(w: GeneratedWorkload) -> list[SimWorkloadRequest]:
    if w.name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {w.name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    rng = random.Random(w.seed)
    fresh = iter(range(10_000_000, 2_000_000_000))

    def unique(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    if w.name == "bursts":
        return _bursts(w, rng, unique)
    arrivals = _arrivals(w, rng)
    out: list[SimWorkloadRequest] = []
    if w.name in ("shared-prefix", "agent"):
        size = w.system_prompt_tokens * (4 if w.name == "agent" else 1)  # agents carry a large tool schema
        prefixes = [unique(size) for _ in range(w.groups)]
        for t in arrivals:
            out.append(SimWorkloadRequest(t, pack_token_ids(rng.choice(prefixes) + unique(w.user_tokens)), w.output_tokens))
    elif w.name == "rag":
        docs = [unique(w.doc_tokens) for _ in range(w.docs)]
        system = unique(256)
        for t in arrivals:
            chosen = rng.sample(range(w.docs), w.docs_per_request)
            out.append(
                SimWorkloadRequest(
                    t, pack_token_ids(system + [tok for d in chosen for tok in docs[d]] + unique(w.user_tokens)), w.output_tokens
                )
            )
    elif w.name == "multi-turn":
        systems = [unique(w.system_prompt_tokens // 2) for _ in range(w.groups)]
        conversations: list[list[int]] = []
        turn_of: list[int] = []
        for t in arrivals:
            live = [i for i, n in enumerate(turn_of) if n < w.turns]
            if live and rng.random() < 1 - 1 / w.turns:
                i = rng.choice(live[-32:])  # recent conversations continue
                conversations[i] = conversations[i] + unique(w.output_tokens) + unique(w.user_tokens)
                turn_of[i] += 1
            else:
                conversations.append(rng.choice(systems) + unique(w.user_tokens))
                turn_of.append(1)
                i = len(conversations) - 1
            out.append(SimWorkloadRequest(t, pack_token_ids(conversations[i]), w.output_tokens, session=str(i)))
    elif w.name == "hot-prefix":
        # One system prompt on hot_share of the traffic, far more than a 1/workers share, so a policy
        # that pins a prefix to one worker overloads it; the rest is shared-prefix over `groups` prompts.
        if not 0.0 <= w.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in [0, 1], got {w.hot_share}")
        hot = unique(w.system_prompt_tokens)
        prefixes = [unique(w.system_prompt_tokens) for _ in range(w.groups)]
        for t in arrivals:
            prefix = hot if rng.random() < w.hot_share else rng.choice(prefixes)
            out.append(SimWorkloadRequest(t, pack_token_ids(prefix + unique(w.user_tokens)), w.output_tokens))
    else:  # one-shot: nothing to share, routing can only balance load
        for t in arrivals:
            out.append(SimWorkloadRequest(t, pack_token_ids(unique(w.system_prompt_tokens + w.user_tokens)), w.output_tokens))
    return out


def _bursts(w: GeneratedWorkload, rng: random.Random, unique) -> list[SimWorkloadRequest]:
    """Bursts of `burst_size` requests `burst_gap_ms` apart on one prefix, starting as a Poisson
    process (`rate_rps` requests a second in all); a burst's prefix is new with `new_prefix_share`,
    else one of the last `groups` prefixes. What several routers must agree on without talking: where
    the first requests of a new prefix go, while the first one's blocks are not cached anywhere yet."""
    if w.burst_size <= 0 or w.burst_gap_ms < 0 or not 0.0 <= w.new_prefix_share <= 1.0:
        raise ValueError("bursts need burst_size > 0, burst_gap_ms >= 0 and new_prefix_share in [0, 1]")
    prefixes: list[list[int]] = []
    out: list[SimWorkloadRequest] = []
    t = 0.0
    while len(out) < w.requests:
        t += rng.expovariate(w.rate_rps / w.burst_size)
        if not prefixes or rng.random() < w.new_prefix_share:
            prefixes.append(unique(w.system_prompt_tokens))
            prefix = prefixes[-1]
        else:
            prefix = rng.choice(prefixes[-w.groups :])
        for i in range(min(w.burst_size, w.requests - len(out))):
            out.append(
                SimWorkloadRequest(t + i * w.burst_gap_ms / 1000, pack_token_ids(prefix + unique(w.user_tokens)), w.output_tokens)
            )
    return out
