"""Who may do what on the control plane, when it runs with mTLS (a --tls-ca): checked from the peer's
verified client certificate (`kvroute.identity`) before anything of a request is applied or
appended to the replicas' Redis log.

    Connect (an agent's event stream)   register only worker ids named in the certificate
                                        (spiffe://kvroute/worker/<id>); a router certificate never
    RouterSession (query + reserve)     router certificates (spiffe://kvroute/router/<name>)
    Query, ListWorkers, GetWorkerKeys   any certificate the CA signed (read only)

A refusal is PERMISSION_DENIED with a message saying which identity lacks what, counted in
`kvroute_cp_auth_denied_total{reason}` and logged at most once per peer and reason per period.
Without a CA every peer may do everything (plaintext or server-only TLS: nothing identifies it).
"""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter

from kvroute.identity import PeerIdentity, identity_from_auth_context
from kvroute.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvroute.control_plane.auth")


class Refused(Exception):
    """The peer may not do this: (reason label, message for the client)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Authority:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.denied = Counter(
            "kvroute_cp_auth_denied_total",
            "Requests refused for the peer's certificate identity (PERMISSION_DENIED)",
            ["reason"],
            registry=registry,
        )
        for reason in ("no_certificate", "router_cannot_write", "worker_not_in_certificate", "not_a_router"):
            self.denied.labels(reason)  # exported at 0 from the start, so a rate() alert sees the first refusal
        self._log = RateLimitedLog(log, period_s=60.0)

    @staticmethod
    def identity(context: grpc.aio.ServicerContext) -> PeerIdentity | None:
        return identity_from_auth_context(context.auth_context())

    def check_writer(self, context: grpc.aio.ServicerContext, worker_id: str) -> None:
        """Refused unless the peer's certificate names `worker_id`."""
        peer = self.identity(context)
        if peer is None:
            raise self._refuse(context, "no_certificate", "the control plane requires a client certificate")
        if peer.may_write(worker_id):
            return
        if peer.is_router and not peer.worker_ids:
            raise self._refuse(
                context,
                "router_cannot_write",
                f"a router identity ({peer.describe()}) may query and "
                f"reserve but not write blocks (register worker {worker_id!r})",
            )
        raise self._refuse(
            context,
            "worker_not_in_certificate",
            f"the client certificate ({peer.describe()}) does not "
            f"name worker {worker_id!r}: it needs the URI SAN spiffe://kvroute/worker/{worker_id}",
        )

    def check_router(self, context: grpc.aio.ServicerContext) -> None:
        """Refused unless the peer holds a router identity (reservations count as routing traffic)."""
        peer = self.identity(context)
        if peer is None:
            raise self._refuse(context, "no_certificate", "the control plane requires a client certificate")
        if not peer.is_router:
            raise self._refuse(
                context,
                "not_a_router",
                f"RouterSession and Follow need a router identity "
                f"(spiffe://kvroute/router/<name>); the certificate holds {peer.describe()}",
            )

    def check_reader(self, context: grpc.aio.ServicerContext) -> None:
        if self.identity(context) is None:
            raise self._refuse(context, "no_certificate", "the control plane requires a client certificate")

    def _refuse(self, context: grpc.aio.ServicerContext, reason: str, message: str) -> Refused:
        self.denied.labels(reason).inc()
        peer = context.peer() or "unknown peer"
        who = self.identity(context)
        # Keyed by the certificate, not the peer address: a client reconnecting from new ports is one peer.
        self._log.warning(f"{who.describe() if who else 'no certificate'}:{reason}", "refused %s: %s", peer, message)
        return Refused(reason, message)
