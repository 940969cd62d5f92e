"""Privacy-safe capture of routed traffic as a Mooncake JSONL trace (`kvroute simulate --trace`).

One line per captured request, the Mooncake fields plus the block size the ids stand for:

    {"timestamp": <ms since capture start>, "input_length": N, "output_length": M, "hash_ids": [0, 1, ...],
     "block_size": B}

`hash_ids` has one id per B-token block of the prompt, ceil(N / B) of them, the last one for the
partial tail. B is 64 by default (`--capture-block-tokens`): Mooncake's own traces use 512, which
hides any sharing shorter than 512 tokens, so a trace of short prompts would show none; the
simulator reads B from the rows (512 when absent, as in Mooncake's). Each id stands for a chained `kvroute.block_keys` key (namespaced by model, LoRA
adapter and cache salt), so equal ids mean equal whole prefixes up to that block; the tail is
chained too and hashes its own length. Keys become dense ids (0, 1, 2, ... in order of first
appearance in this file, like the public Mooncake traces), so the file holds no prompt text, no
token ids and no raw keys: a key is a hash of tokens and could be checked against a guessed prompt.

The key -> id map is an LRU of at most `max_ids` keys (1M by default): a key evicted from it that
shows up again simply gets a new id, which can only make the trace share less than the traffic did.

Recording never blocks or fails a request: `record` hashes and appends to a bounded in-memory
buffer; a background task maps keys to ids, serializes and writes in a worker thread about once a
second, and `aclose` writes the rest. Rows are sorted by timestamp within each flush only (a request
is recorded when it completes); the simulator sorts arrivals itself. A full buffer or a failing disk
drops rows, counted in `kvroute_router_capture_dropped_rows_total` (logged once; the ids those rows took are
then missing from the file); written rows are counted in `kvroute_router_capture_rows_total`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvroute.block_keys import chain_block_keys, namespace_seed
from kvroute.data_plane.ops.metrics import RouterMetrics

log = logging.getLogger("kvroute.router.capture")

CAPTURE_BLOCK_TOKENS = 64  # tokens per hash id by default; written into every row as block_size


def trace_block_keys(
    token_ids: Sequence[int], model: str, lora_name: str = "", cache_salt: str = "", block_tokens: int = CAPTURE_BLOCK_TOKENS
) -> list[int]:
    """Chained keys of every `block_tokens` block of the prompt, plus one for a partial tail.

    The tail key is chained from the last full block's key (or the namespace seed) over the tail's
    own tokens; xxh3 hashes the input length, so tails of different lengths get different keys."""
    seed = namespace_seed(model, block_tokens, lora_name, cache_salt)
    keys = chain_block_keys(token_ids, block_tokens, seed)
    tail = len(token_ids) % block_tokens
    if tail:
        keys += chain_block_keys(token_ids[len(token_ids) - tail :], tail, keys[-1] if keys else seed)
    return keys


def _token_count(value: object) -> int | None:
    """A JSON token count (a non-negative int, and not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def requested_output_tokens(body: dict) -> int:
    """The request's own output budget: max_completion_tokens, else max_tokens, else 0."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = _token_count(body.get(name))
        if value is not None:
            return value
    return 0


_USAGE = b'"usage":'


def reported_usage(tail: bytes | bytearray) -> dict | None:
    """The last `"usage"` object in the end of a response body, or None.

    Works on a JSON response and on an SSE stream alike (the last chunk carrying usage holds the
    totals). Inside JSON strings quotes are escaped, so `"usage":` only matches a real key."""
    at = tail.rfind(_USAGE)
    if at < 0:
        return None
    try:
        text = bytes(tail[at + len(_USAGE) :]).decode("utf-8", errors="replace").lstrip()
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def reported_output_tokens(tail: bytes | bytearray) -> int | None:
    """`usage.completion_tokens` of the last usage object in the end of a response body, or None."""
    usage = reported_usage(tail)
    return None if usage is None else _token_count(usage.get("completion_tokens"))


def reported_cached_tokens(usage: dict | None) -> tuple[int, int] | None:
    """(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) when the engine reports both
    (vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report), else None."""
    details = usage.get("prompt_tokens_details") if usage else None
    if not isinstance(details, dict):
        return None
    prompt, cached = _token_count(usage.get("prompt_tokens")), _token_count(details.get("cached_tokens"))
    return None if prompt is None or cached is None else (prompt, cached)


@dataclass(slots=True)
class _Row:
    timestamp_ms: int
    input_length: int
    output_length: int
    keys: list[int]  # raw block keys: kept in memory until the flush maps them to dense ids


def _open_unbuffered(path: Path) -> BinaryIO:
    # Unbuffered: a failed write must leave no bytes in a buffer that a later write would flush.
    return open(path, "wb", buffering=0)


class TrafficCapture:
    def __init__(
        self,
        path: str | Path,
        sample_rate: float = 1.0,
        metrics: RouterMetrics | None = None,
        *,
        max_ids: int = 1_000_000,
        max_buffered_rows: int = 100_000,
        flush_interval_s: float = 1.0,
        block_tokens: int = CAPTURE_BLOCK_TOKENS,
        open_file: Callable[[Path], BinaryIO] = _open_unbuffered,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if block_tokens <= 0:
            raise ValueError(f"block tokens must be positive, got {block_tokens}")
        self.path = Path(path)
        self.sample_rate = sample_rate
        self.metrics = metrics or RouterMetrics()
        self.max_ids, self.max_buffered_rows = max_ids, max_buffered_rows
        self.flush_interval_s, self.block_tokens = flush_interval_s, block_tokens
        self.open_file = open_file  # tests hand in a file that fails as a full disk does
        self._credit = 0.0  # deterministic sampling: a request is kept each time the credit reaches 1
        self._pending: list[_Row] = []
        self._ids: OrderedDict[int, int] = OrderedDict()  # block key -> dense id, least recently used first
        self._next_id = 0
        self._file: BinaryIO | None = None
        self._good_bytes = 0  # file length after the last complete write (a failed one is cut back to it)
        self._started_at = 0.0
        self._stop = asyncio.Event()
        self._flushing = asyncio.Lock()  # one _write thread at a time owns the id map and the file
        self._task: asyncio.Task | None = None
        self._write_error_logged = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Opens (truncates) the file now, so a bad path stops the router at startup, not later."""
        self._file = self.open_file(self.path)
        self._started_at = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._flush_loop(), name="kvroute-capture-flush")
        log.info("capturing traffic to %s (sample rate %g, %d-token blocks)", self.path, self.sample_rate, self.block_tokens)

    async def aclose(self) -> None:
        """Writes every buffered row and closes the file."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
        else:
            await self.flush()
        if self._file is not None:
            await asyncio.to_thread(self._file.close)
            self._file = None

    async def _flush_loop(self) -> None:
        # Stopping goes through an event, not cancellation: a cancelled to_thread keeps writing in
        # its thread, and the final flush would then interleave with it.
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.flush_interval_s)
            except TimeoutError:
                pass
            await self.flush()
            if self._stop.is_set():
                # Rows recorded while that flush was writing (its thread, awaited) are not in it: one
                # more flush, now that nothing is writing, so the last rows are always written.
                await self.flush()
                return

    # ------------------------------------------------------------ the request path

    def sample_arrival(self) -> int | None:
        """At a request's arrival: its timestamp (ms since capture start) if it is to be captured."""
        self._credit += self.sample_rate
        if self._credit < 1.0:
            return None
        self._credit -= 1.0
        return int((time.monotonic() - self._started_at) * 1000)

    def record(
        self,
        timestamp_ms: int,
        token_ids: Sequence[int],
        output_length: int,
        model: str,
        lora_name: str = "",
        cache_salt: str = "",
    ) -> None:
        """Buffers one row. Never raises: a row that cannot be kept is counted as dropped."""
        if len(self._pending) >= self.max_buffered_rows:
            self.metrics.capture_dropped.inc()
            return
        try:
            keys = trace_block_keys(token_ids, model, lora_name, cache_salt, self.block_tokens)
        except ValueError:  # token ids past 32 bits; the router rejects those before routing anyway
            self.metrics.capture_dropped.inc()
            return
        self._pending.append(_Row(timestamp_ms, len(token_ids), max(0, output_length), keys))

    # ------------------------------------------------------------ writing

    async def flush(self) -> None:
        async with self._flushing:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            error = await asyncio.to_thread(self._write, batch)
        if error is None:
            self.metrics.capture_rows.inc(len(batch))
            return
        self.metrics.capture_dropped.inc(len(batch))
        if not self._write_error_logged:
            self._write_error_logged = True
            log.error(
                "cannot write the traffic capture %s (%s); dropping rows, counted in "
                "kvroute_router_capture_dropped_rows_total (logged once)",
                self.path,
                error,
            )

    def _write(self, batch: list[_Row]) -> Exception | None:
        batch.sort(key=lambda r: r.timestamp_ms)
        lines = [
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": [self._id(k) for k in r.keys],
                    "block_size": self.block_tokens,
                }
            )
            for r in batch
        ]
        data = memoryview(("\n".join(lines) + "\n").encode())
        if self._file is None:
            return ValueError("capture file is not open")
        try:
            while data:  # a raw write may be short
                data = data[self._file.write(data) :]
        except OSError as exc:
            # Cut a half-written line back off, so the trace stays loadable when the disk recovers.
            try:
                self._file.truncate(self._good_bytes)
                self._file.seek(self._good_bytes)
            except OSError:
                pass
            return exc
        self._good_bytes = self._file.tell()
        return None

    def _id(self, key: int) -> int:
        dense = self._ids.get(key)
        if dense is not None:
            self._ids.move_to_end(key)
            return dense
        dense = self._ids[key] = self._next_id
        self._next_id += 1
        if len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)  # a reappearing evicted key gets a fresh id (never a reused one)
        return dense
