"""Which prefix index a process holds, chosen by configuration (`kvroute control-plane --index-backend`).

    from kvroute.prefix_index.backends import make_index, resolve_backend
    resolve_backend("native")                  # "native", or IndexBackendError (one line) when it is not built
    index = make_index("auto", max_entries=0)  # native when the extension imports, else bitmask

Backends: `native` (NativePrefixIndex / NativeBoundedPrefixIndex: the C extension built by `pip install`),
`bitmask` (BitmaskPrefixIndex / BoundedPrefixIndex: pure Python), `auto` (native when it imports). Every
backend holds the same entries and answers every query the same way (the conformance suite runs them all
against SetPrefixIndex); they differ in memory per entry and speed only.
"""

from __future__ import annotations

from kvroute.prefix_index.base import PrefixIndex
from kvroute.prefix_index.bitmask import BitmaskPrefixIndex
from kvroute.prefix_index.bounded import BoundedPrefixIndex

BACKENDS = ("auto", "native", "bitmask")

try:
    from kvroute.prefix_index.native import NativeBoundedPrefixIndex, NativePrefixIndex
except ImportError as exc:  # an install that did not build the extension
    NATIVE_IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
    BOUNDED_INDEXES: tuple[type, ...] = (BoundedPrefixIndex,)
else:
    NATIVE_IMPORT_ERROR = None
    BOUNDED_INDEXES = (BoundedPrefixIndex, NativeBoundedPrefixIndex)


class IndexBackendError(ValueError):
    """The backend asked for cannot be had; the message is one line for the command line."""


def resolve_backend(name: str) -> str:
    """ "native" or "bitmask" for a backend name (auto: native when the extension imports)."""
    if name not in BACKENDS:
        raise IndexBackendError(f"--index-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "bitmask" if NATIVE_IMPORT_ERROR else "native"
    if name == "native" and NATIVE_IMPORT_ERROR:
        raise IndexBackendError(
            "--index-backend native: the C extension kvroute.prefix_index._native is not built "
            f"({NATIVE_IMPORT_ERROR}); reinstall kvroute where a C compiler and the Python "
            "headers are present (pip install .), or use --index-backend bitmask"
        )
    return name


def make_index(backend: str = "auto", max_entries: int = 0) -> PrefixIndex:
    """A new empty index of `backend`, bounded to `max_entries` entries when that is not 0."""
    if resolve_backend(backend) == "native":
        return NativeBoundedPrefixIndex(max_entries) if max_entries else NativePrefixIndex()
    return BoundedPrefixIndex(max_entries) if max_entries else BitmaskPrefixIndex()


def is_bounded(index: PrefixIndex) -> bool:
    """Whether `index` drops entries for a bound (it then has max_entries, counters, workers_with_evictions)."""
    return isinstance(index, BOUNDED_INDEXES)
