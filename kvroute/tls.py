"""TLS for every kvroute link: flags, loading, and certificates reloaded from disk without a restart.

Every command with a gRPC server or client takes `--tls-cert`, `--tls-key` and `--tls-ca` (or the
environment variables `KVROUTE_TLS_CERT`, `KVROUTE_TLS_KEY`, `KVROUTE_TLS_CA`; a flag wins). None
of them set: plaintext, as before (`make demo`). The rule is one CA per process:

- a server with a certificate and key serves TLS; with a CA too it requires a client certificate
  signed by that CA (mTLS) and the peer's identity comes from it (`kvroute.identity`);
- a client with a CA verifies the server against it (and presents its own certificate and key
  when it has them); without a CA but with a certificate it uses the system's trust store.

Reloading: the files are read again when one's modification time, size or inode changes (a rotated
certificate, e.g. cert-manager or a Kubernetes secret update). A gRPC server asks
`ServerTls.fetch` at every handshake (`grpc.dynamic_ssl_server_credentials`), an HTTPS listener
checks in its SNI callback, a client when it opens a channel (`ClientTls.generation` tells a
client that keeps channels that it should open new ones). Servers and clients load and check the
files the same way: files that do not load (half written, not PEM, a key that is not the
certificate's) keep the previous certificates, with one warning per version of the files, and the
next change is tried again.

A gRPC call that failed because the TLS handshake did (no or the wrong client certificate, a
plaintext client of a TLS server, ...) often reads as just `UNAVAILABLE ... Socket closed`;
`tls_failure_hint` turns it into a line that says so, with the likely cause and the flags, for the
errors and logs of every kvroute client (`describe_rpc_error`, `rpc_failure_reason`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("kvroute.tls")

ENV_CERT, ENV_KEY, ENV_CA = "KVROUTE_TLS_CERT", "KVROUTE_TLS_KEY", "KVROUTE_TLS_CA"
RECHECK_S = 1.0  # stat the files at most this often (a handshake storm must not become a stat storm)


class TlsConfigError(ValueError):
    """The TLS flags do not fit together, or a file cannot be read (one line, names the flag)."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM file paths; "" = not given."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @property
    def mutual(self) -> bool:
        """A CA is configured: servers require client certificates signed by it."""
        return bool(self.ca)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p)

    def check(self, *, server: bool) -> TlsFiles:
        """Self, or TlsConfigError naming what is missing or unreadable."""
        if bool(self.cert) != bool(self.key):
            raise TlsConfigError("--tls-cert and --tls-key go together (a certificate needs its private key)")
        if server and self.enabled and not self.cert:
            raise TlsConfigError("a TLS server needs --tls-cert and --tls-key (--tls-ca alone only verifies peers)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not os.access(path, os.R_OK):
                raise TlsConfigError(f"{flag} {path}: cannot read the file")
        if self.enabled:  # plaintext: nothing to load
            _load_pems(self)
        return self


def add_tls_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """--tls-cert/--tls-key/--tls-ca, defaulting to the KVROUTE_TLS_* environment variables."""
    p.add_argument(
        "--tls-cert",
        default=environ.get(ENV_CERT, ""),
        metavar="PEM",
        help=f"this process's certificate (chain), PEM; with --tls-key turns TLS on (env {ENV_CERT}). "
        "Reloaded when the file changes",
    )
    p.add_argument(
        "--tls-key", default=environ.get(ENV_KEY, ""), metavar="PEM", help=f"the private key of --tls-cert, PEM (env {ENV_KEY})"
    )
    p.add_argument(
        "--tls-ca",
        default=environ.get(ENV_CA, ""),
        metavar="PEM",
        help=f"CA bundle that verifies peers, PEM (env {ENV_CA}): servers then require client "
        "certificates signed by it (mTLS) and clients verify servers with it",
    )


def tls_files_from_args(args: argparse.Namespace, *, server: bool) -> TlsFiles:
    return TlsFiles(args.tls_cert or "", args.tls_key or "", args.tls_ca or "").check(server=server)


@dataclass(frozen=True)
class _Pems:
    """The bytes of a TlsFiles' files; None for a file not given."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


def _read_pems(files: TlsFiles) -> _Pems:
    """Read and validate `files`: the certificate with its key (and the CA), or the CA alone; raises
    OSError, ssl.SSLError or ValueError. The one loader of start-up checks and reloads alike."""
    pems = _Pems(*(Path(path).read_bytes() if path else None for path in (files.cert, files.key, files.ca)))
    if pems.cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _load_chain(context, pems.cert, pems.key or b"")
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if pems.ca is not None:
        context.load_verify_locations(cadata=pems.ca.decode("ascii", "replace"))
    return pems


def _load_pems(files: TlsFiles) -> _Pems:
    """`_read_pems`, failing with a TlsConfigError that names the flags (start-up)."""
    try:
        return _read_pems(files)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise TlsConfigError(
            f"--tls-cert {files.cert or '-'} / --tls-key {files.key or '-'} / --tls-ca {files.ca or '-'} do not load: {exc}"
        ) from None


def _load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`context.load_cert_chain` from bytes (ssl loads chains from files only: a private temp dir)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert)
        key_path.touch(0o600)
        key_path.write_bytes(key)
        # An encrypted key fails here instead of OpenSSL asking for its passphrase on the terminal.
        context.load_cert_chain(cert_path, key_path, password=b"")


class _WatchedFiles:
    """The loaded TLS files of a server or a client, loaded again when one of them changes.

    `refresh()` (at most once per RECHECK_S) stats the files; when they changed it loads and validates
    them (`_read_pems`), keeps the previous ones if they do not load, logging that once per version of
    the files, and bumps `generation` when they do."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads
        self._checked = 0.0
        self._stamps = self._stat()  # before the read: a write after it shows as a change
        self.pems = _load_pems(files)
        self.generation = 0  # bumped at every successful reload
        self._rejected: object = None  # the stamps (or stat error) of the version that did not load

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self.files.paths():
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def refresh(self) -> bool:
        """Reload if a file changed since the last load and the new files load; True when it did."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < RECHECK_S:
                return False
            self._checked = now
            try:
                stamps = self._stat()
            except OSError as exc:  # e.g. a secret's files swapped right now
                self._reject(str(exc), str(exc))
                return False
            if stamps in (self._stamps, self._rejected):
                return False
            try:
                pems = _read_pems(self.files)
            except (OSError, ssl.SSLError, ValueError) as exc:  # e.g. half written, or a key of another certificate
                self._reject(stamps, str(exc))
                return False
            self._stamps, self.pems, self._rejected = stamps, pems, None
            self.generation += 1
            log.info("TLS files reloaded: %s", ", ".join(self.files.paths()))
            return True

    def _reject(self, version: object, why: str) -> None:
        if version != self._rejected:
            log.warning(
                "TLS files %s changed but do not load (%s): keeping the previous ones", ", ".join(self.files.paths()), why
            )
            self._rejected = version


class ServerTls:
    """gRPC server credentials whose certificate (and CA) follow the files."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files.check(server=True)
        self._watch = _WatchedFiles(self.files)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        import grpc

        pems = self._watch.pems
        return grpc.ssl_server_certificate_configuration([(pems.key, pems.cert)], root_certificates=pems.ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's config fetcher (called at each handshake): a new configuration, or None to keep it."""
        return self._config() if self._watch.refresh() else None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.dynamic_ssl_server_credentials(self._config(), self.fetch, require_client_authentication=self.files.mutual)

    def ssl_context(self, *, require_client_cert: bool) -> ssl.SSLContext:
        """An HTTPS server context (aiohttp) that swaps in a reloaded one at the next handshake after
        the files changed (its SNI callback runs at every ClientHello, SNI or not)."""
        first = self._build_context(require_client_cert)
        current = [first]

        def on_hello(sock: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
            if self._watch.refresh():
                current[0] = self._build_context(require_client_cert)
            if sock.context is not current[0]:
                sock.context = current[0]

        first.sni_callback = on_hello
        return first

    def _build_context(self, require_client_cert: bool) -> ssl.SSLContext:
        pems = self._watch.pems
        # Not create_default_context: it trusts the system's CAs, and client certificates must come from ours.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(context, pems.cert or b"", pems.key or b"")
        if require_client_cert:
            if pems.ca is None:
                raise TlsConfigError("client certificates need --tls-ca (the CA that signs them)")
            context.load_verify_locations(cadata=pems.ca.decode("ascii", "replace"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


class ClientTls:
    """gRPC channel credentials from the files, rebuilt when they change (and load: files that do
    not keep the previous ones, as on a server)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files.check(server=False)
        self._watch = _WatchedFiles(self.files)

    @property
    def generation(self) -> int:
        """Changes when the files were reloaded: channels opened before use the old certificate."""
        self._watch.refresh()
        return self._watch.generation

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        self._watch.refresh()
        pems = self._watch.pems
        return grpc.ssl_channel_credentials(root_certificates=pems.ca, private_key=pems.key, certificate_chain=pems.cert)


def open_channel(address: str, tls: ClientTls | None, options: list[tuple[str, object]] | None = None):
    """A grpc.aio channel to `address`: TLS with `tls`, plaintext without."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.grpc_credentials(), options=options)


TLS_FLAGS = f"--tls-cert/--tls-key/--tls-ca (or {ENV_CERT}/{ENV_KEY}/{ENV_CA})"
_OPENSSL_REASON = re.compile(r"OPENSSL_internal:([A-Z0-9_]+)(?::\s*([^:]+))?")


def tls_failure_hint(error: grpc.RpcError, tls: ClientTls | None) -> str | None:
    """A one-line explanation when `error` (a failed call of a client with `tls`, None = plaintext)
    is a TLS handshake that failed, naming the flags to check; None when it is something else.

    gRPC tells only part of it: a handshake this client refused says why (the server's certificate,
    a plaintext server), one the server refused reads "Socket closed" at connection set-up, and the
    cause is then inferred from what this client presented."""
    code = error.code()
    if code is None or code.name != "UNAVAILABLE":
        return None
    details = error.details() or ""
    lowered = details.lower()
    if "handshake failed" in lowered:
        match = _OPENSSL_REASON.search(details)
        why, text = match.groups() if match else ("", "")
        if why == "WRONG_VERSION_NUMBER":
            cause = f" ({why}): the server answered in plaintext, it serves no TLS"
        elif why == "CERTIFICATE_VERIFY_FAILED":
            trusted = "a CA in --tls-ca" if tls is not None and tls.files.ca else "a CA this system trusts (no --tls-ca)"
            cause = f" ({why}: {text.strip()}): the server's certificate is not signed by {trusted}"
        else:
            cause = f" ({details.partition('handshake failed')[2].strip(' :')})"
    elif "hostname verification" in lowered:
        cause = ": the server's certificate does not name the address dialled (no such DNS or IP SAN)"
    elif "security handshaker" in lowered:
        cause = ": this client's own certificate files do not load"
    elif "failed to connect to all addresses" in lowered and ("socket closed" in lowered or "connection reset" in lowered):
        closed = ": the server closed the connection at set-up"
        if tls is None:
            cause = f"{closed}: it probably serves TLS and this client has none"
        elif not tls.files.cert:
            cause = f"{closed}: it probably requires a client certificate and this client has none"
        else:
            cause = f"{closed}: it probably refused this client's certificate (not signed by its CA, or expired)"
    else:
        return None
    return f"TLS handshake failed{cause}; check {TLS_FLAGS}"


def rpc_failure_reason(error: BaseException, tls: ClientTls | None) -> str:
    """Why a call failed, in a few words (logs, /ready): the TLS hint when a handshake failed, else
    the status name (the repr of an error that is not gRPC's)."""
    import grpc

    if not isinstance(error, grpc.RpcError) or not hasattr(error, "code"):
        return repr(error)
    return tls_failure_hint(error, tls) or error.code().name


def describe_rpc_error(error: grpc.RpcError, tls: ClientTls | None) -> str:
    """`CODE: details` of a failed call, or `CODE: <hint>` when it is a failed TLS handshake
    (`tls_failure_hint`)."""
    code = error.code()
    name = code.name if code is not None else "UNKNOWN"
    return f"{name}: {tls_failure_hint(error, tls) or error.details()}"


def client_tls(files: TlsFiles) -> ClientTls | None:
    return ClientTls(files) if files.enabled else None


def server_tls(files: TlsFiles) -> ServerTls | None:
    return ServerTls(files) if files.enabled else None


def grpc_message_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options capping one message each way at `max_bytes` (--grpc-max-message-bytes)."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


def add_grpc_message_argument(p: argparse.ArgumentParser, default: int) -> None:
    def positive(text: str) -> int:
        value = int(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    p.add_argument(
        "--grpc-max-message-bytes",
        type=positive,
        default=default,
        metavar="N",
        help="largest gRPC message this process sends or accepts, on each of its gRPC servers and clients "
        "(a larger one fails with RESOURCE_EXHAUSTED)",
    )


def engine_client_context(ca: str, files: TlsFiles) -> ssl.SSLContext:
    """The router's TLS client context for https:// engines: verified against `ca` (--engine-tls-ca);
    presents the router's own certificate when it has one (engines behind an mTLS proxy)."""
    try:
        context = ssl.create_default_context(cafile=ca)
        if files.cert:
            context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"--engine-tls-ca {ca}: {exc}") from None
    return context
