"""Shared by the property-based tests of the agent's decoders (tests/test_hostile_*.py): what an engine
may name a namespace with, and the check that a decode stayed within time and memory."""

from __future__ import annotations

import gc
import time
import tracemalloc
from array import array

from hypothesis import strategies as st

from kvroute.tools.sim_engine.prefix_cache import CacheNamespace

NAMES = st.text(min_size=1, max_size=8)
_MAYBE_NAME = st.none() | NAMES
_MAYBE_LORA_ID = st.none() | st.integers(1, 2**31)


def token_ids(count: int) -> st.SearchStrategy[list[int]]:
    """`count` u32 token ids, drawn as one byte string (a draw per id made the properties several times slower)."""
    return st.binary(min_size=4 * count, max_size=4 * count).map(lambda b: array("I", b).tolist())


@st.composite
def namespaces(draw) -> CacheNamespace:
    return CacheNamespace(lora_name=draw(_MAYBE_NAME), lora_id=draw(_MAYBE_LORA_ID), cache_salt=draw(_MAYBE_NAME))


class Bounded:
    """Runs a decode and checks it was bounded: under `seconds` of CPU (this thread's: a machine busy with
    other work does not count), and peak memory under 256 KiB plus 200 bytes per input byte (a decoder
    that trusted a length header would allocate gigabytes)."""

    def __init__(self, seconds: float = 2.0) -> None:
        self.seconds = seconds

    def __call__(self, fn, data: bytes, *args, **kwargs):
        gc.disable()  # a collection of what the test run holds (the fuzz profile's examples) is not the decoder's time
        tracemalloc.start()
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.thread_time() - started
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            gc.enable()
            assert elapsed < self.seconds, f"decode took {elapsed:.2f}s of CPU for {len(data)} bytes"
            assert peak < (256 << 10) + 200 * len(data), f"decode peaked at {peak} bytes for {len(data)} bytes"
