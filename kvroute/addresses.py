"""Several control-plane replicas behind one flag: `--control-plane A:50051,B:50051` or one name that
resolves to several addresses (a Kubernetes headless Service). Agents and routers go round them.

Each entry is resolved again at every round, so replicas that moved (new pod IPs) are found; an IP
literal, or a name that resolves to one address, stays as written (gRPC resolves it itself). A
name that resolves to several becomes one address each (IPv4 when it has any, else IPv6).
"""

from __future__ import annotations

import socket
from collections.abc import Callable


def split_addresses(spec: str) -> list[str]:
    """The comma-separated entries of `spec`; ValueError when there is none."""
    entries = [part.strip() for part in spec.split(",") if part.strip()]
    if not entries:
        raise ValueError(f"no control-plane address in {spec!r}")
    return entries


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def resolve_all(address: str) -> list[str]:
    """`address` as one HOST:PORT per address its host resolves to; itself when it resolves to one
    or none (an unresolvable name is gRPC's to report) or is a literal."""
    host, port = _host_port(address)
    if not host or not port.isdigit():
        return [address]
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [address]  # a literal
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return [address]
    v4 = list(dict.fromkeys(info[4][0] for info in infos if info[0] == socket.AF_INET))
    ips = v4 or list(dict.fromkeys(info[4][0] for info in infos if info[0] == socket.AF_INET6))
    if len(ips) <= 1:
        return [address]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class AddressRotation:
    """Hands out the replicas' addresses in turn; every `round()` re-resolves the entries."""

    def __init__(self, spec: str, resolve: Callable[[str], list[str]] = resolve_all) -> None:
        self.spec = spec
        self.entries = split_addresses(spec)
        self._resolve = resolve
        self._round: list[str] = []
        self._position = 0

    @property
    def several(self) -> bool:
        return len(self.entries) > 1 or len(self.round_addresses()) > 1

    def round_addresses(self) -> list[str]:
        addresses: list[str] = []
        for entry in self.entries:
            addresses.extend(a for a in self._resolve(entry) if a not in addresses)
        return addresses

    @property
    def round_done(self) -> bool:
        """Every address of the current round was handed out (the next `next()` starts a new round)."""
        return self._position >= len(self._round)

    def next(self) -> tuple[str, bool]:
        """(the next address, whether it starts a new round: every address was tried since the last)."""
        new_round = self._position >= len(self._round)
        if new_round:
            self._round, self._position = self.round_addresses(), 0
        address = self._round[self._position]
        self._position += 1
        return address, new_round
