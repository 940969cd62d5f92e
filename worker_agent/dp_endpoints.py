"""Where each data-parallel rank of an engine publishes its KV events (docs/wire-formats.md#data-parallel-endpoints).

Every rank runs its own publisher (its own sequence counter and replay buffer) on the base
endpoint offset by its global rank: `tcp://host:P` -> `tcp://host:P+rank`, `inproc://x` ->
`inproc://x_dp<rank>`; the replay endpoint is offset the same way. vLLM and SGLang refuse `ipc://`
for rank > 0; TensorRT-LLM maps it to `ipc://x_dp<rank>`.
"""

from __future__ import annotations


def offset_endpoint(endpoint: str, rank: int, engine: str) -> str:
    """The endpoint rank `rank` of `engine` publishes on. Raises ValueError for one it cannot have."""
    if rank < 0:
        raise ValueError(f"data-parallel rank must be >= 0, got {rank}")
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise ValueError(f"KV event endpoint {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"KV event endpoint {endpoint!r} has no numeric port (tcp://HOST:PORT)")
        base = int(port)
        if rank == 0:
            return endpoint
        if base == 0:
            raise ValueError(f"KV event endpoint {endpoint!r}: port 0 cannot be offset per data-parallel rank")
        if base + rank > 65535:
            raise ValueError(f"KV event endpoint {endpoint!r}: rank {rank} would publish on port {base + rank} > 65535")
        return f"tcp://{host}:{base + rank}"
    if rank == 0:
        return endpoint
    if scheme == "ipc" and engine != "trtllm":
        raise ValueError(f"{engine} cannot publish KV events on ipc:// with data parallelism (rank {rank}): use tcp://")
    return f"{endpoint}_dp{rank}"


def rank_endpoints(endpoint: str, ranks: list[int], engine: str) -> list[str]:
    return [offset_endpoint(endpoint, rank, engine) for rank in ranks]


def check_no_overlap(live: list[str], replay: list[str]) -> None:
    """A rank's replay endpoint must not be another rank's live endpoint: keep the replay base port at least
    the DP size away from the live one (docs/wire-formats.md#data-parallel-endpoints)."""
    clash = sorted(set(live) & set(replay))
    if clash:
        raise ValueError(
            f"replay endpoints overlap KV event endpoints ({', '.join(clash)}): with data parallelism "
            "put the replay base port at least --data-parallel-size away from the event port"
        )
