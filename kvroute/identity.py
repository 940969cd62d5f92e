"""Who a peer is, from the URI SANs of its client certificate (SPIFFE-style IDs under trust domain `kvroute`):

    spiffe://kvroute/worker/<worker_id>   an agent that may write this worker's blocks (one SAN per worker
                                          id: a data-parallel agent needs `<id>-dp<rank>` for each rank)
    spiffe://kvroute/router/<name>        a router: may query the index and reserve, never write blocks

A worker id is percent-encoded as a URI path segment (`urllib.parse.quote(id, safe=SAFE)`), so an id
like `node-7:8000` is written as is and an id with `/` or a space as `%2F` / `%20`. A certificate
may carry both kinds (a test harness, an all-in-one host). gRPC hands the peer's URI SANs to the
server as the `peer_uri` property of `context.auth_context()` (only when the handshake verified
the certificate against the server's CA).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote

TRUST_DOMAIN = "kvroute"
WORKER_PREFIX = f"spiffe://{TRUST_DOMAIN}/worker/"
ROUTER_PREFIX = f"spiffe://{TRUST_DOMAIN}/router/"
SAFE = "-._~!$&'()*+,;=:@"  # RFC 3986 pchar characters besides unreserved ones: kept as they are


def worker_uri(worker_id: str) -> str:
    return WORKER_PREFIX + quote(worker_id, safe=SAFE)


def router_uri(name: str) -> str:
    return ROUTER_PREFIX + quote(name, safe=SAFE)


@dataclass(frozen=True)
class PeerIdentity:
    """What a verified client certificate says its holder is."""

    worker_ids: frozenset[str] = frozenset()  # worker ids whose blocks it may write
    routers: frozenset[str] = frozenset()  # router names it holds
    uris: tuple[str, ...] = ()  # every URI SAN, for messages

    @property
    def is_router(self) -> bool:
        return bool(self.routers)

    def may_write(self, worker_id: str) -> bool:
        return worker_id in self.worker_ids

    def describe(self) -> str:
        return ", ".join(self.uris) if self.uris else "a certificate without kvroute URI SANs"


def identity_from_uris(uris: Iterable[str]) -> PeerIdentity:
    uris = tuple(uris)
    workers = frozenset(
        unquote(u[len(WORKER_PREFIX) :]) for u in uris if u.startswith(WORKER_PREFIX) and len(u) > len(WORKER_PREFIX)
    )
    routers = frozenset(
        unquote(u[len(ROUTER_PREFIX) :]) for u in uris if u.startswith(ROUTER_PREFIX) and len(u) > len(ROUTER_PREFIX)
    )
    return PeerIdentity(workers, routers, uris)


def identity_from_auth_context(auth_context: Mapping[str, Iterable[bytes]]) -> PeerIdentity | None:
    """The peer's identity from grpc's `context.auth_context()`; None when the connection carries no
    verified certificate (plaintext, or TLS without client authentication)."""
    if not auth_context.get("x509_subject") and not auth_context.get("peer_uri"):
        return None
    return identity_from_uris(value.decode("utf-8", "replace") for value in auth_context.get("peer_uri", ()))
