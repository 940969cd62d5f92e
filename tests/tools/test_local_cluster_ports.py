"""LocalCluster's ports: below the kernel's ephemeral range, never handed out twice, never one in use."""

from __future__ import annotations

import socket

import pytest

from kvroute.tools.local_cluster import PortAllocator, _ephemeral_low


def test_ports_stay_below_the_ephemeral_range_and_are_never_repeated() -> None:
    ports = PortAllocator(seed=1)
    taken = [ports.take() for _ in range(300)]
    assert len(set(taken)) == len(taken)
    assert all(20000 <= p < _ephemeral_low() for p in taken)


def test_a_port_in_use_is_skipped_and_the_range_wraps() -> None:
    ports = PortAllocator(low=21000, high=21100, seed=0)
    start = ports._next
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", start))
        busy.listen()
        assert ports.take() != start
    taken = []
    with pytest.raises(RuntimeError, match="no free port"):
        for _ in range(100):  # the rest of the 100, wrapping past `high`, then none left
            taken.append(ports.take())
    assert len(set(taken)) == len(taken) and all(21000 <= p < 21100 for p in taken)
    assert start in taken  # skipped while in use, handed out once free


def test_a_range_too_small_is_refused() -> None:
    with pytest.raises(ValueError):
        PortAllocator(low=30000, high=30010)
