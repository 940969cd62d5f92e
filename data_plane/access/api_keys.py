"""API keys for the router's APIs (`Authorization: Bearer <key>` on HTTP, metadata `authorization` on gRPC).

Keys are held, and compared, only as SHA-256 digests: the file holds digests, never keys, so a copy of
it (a ConfigMap, a backup) lets nobody in. `--api-keys-file`, one key a line:

    # comments and blank lines are ignored
    sha256:<64 hex digits>  [name]  [scope=all|route]

made with `printf %s "$KEY" | sha256sum`. `name` appears in the log when the key is refused for its
scope; `scope=route` allows only the routing decision (POST /v1/route and the gRPC Router API), not
requests the router proxies to engines (403). `KVROUTE_API_KEYS` adds keys from the environment,
comma-separated, each either `sha256:<hex>` or the key itself (hashed as it is read). The file is
read again when it changes (checked at most once a second). No key configured: every request is
let in, as before.

A presented key is hashed, then compared with every digest by `hmac.compare_digest` (constant time
per digest, and no early exit), so the time to answer says nothing about how close a guess was.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger("kvroute.router.auth")
ENV_API_KEYS = "KVROUTE_API_KEYS"
SCOPES = ("all", "route")
RECHECK_S = 1.0


class KeyFileError(ValueError):
    """A line of the keys file that is not `sha256:<hex> [name] [scope=...]` (names file and line)."""


@dataclass(frozen=True)
class ApiKey:
    digest: bytes
    name: str
    scope: str = "all"  # "all", or "route": the routing decision only

    def allows(self, proxied: bool) -> bool:
        return self.scope == "all" or not proxied


class Verdict(Enum):
    OPEN = "open"  # no keys configured
    ALLOWED = "allowed"
    MISSING = "missing"  # 401: no `Authorization: Bearer`
    INVALID = "invalid"  # 401: a key that is not one of ours
    FORBIDDEN = "forbidden"  # 403: a valid key whose scope does not cover this request


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _parse_digest(text: str, where: str) -> bytes:
    hexdigits = text.removeprefix("sha256:")
    try:
        digest = bytes.fromhex(hexdigits)
    except ValueError:
        digest = b""
    if not text.startswith("sha256:") or len(digest) != 32:
        raise KeyFileError(f"{where}: expected sha256:<64 hex digits> (printf %s KEY | sha256sum), not a key itself")
    return digest


def parse_key_file(text: str, source: str) -> list[ApiKey]:
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        digest_text, *rest = line.split()
        name, scope = f"{source}:{number}", "all"
        for word in rest:
            if word.startswith("scope="):
                scope = word.removeprefix("scope=")
                if scope not in SCOPES:
                    raise KeyFileError(f"{where}: scope must be one of {', '.join(SCOPES)}, got {scope!r}")
            else:
                name = word
        keys.append(ApiKey(_parse_digest(digest_text, where), name, scope))
    return keys


def parse_env_keys(text: str) -> list[ApiKey]:
    keys = []
    for i, entry in enumerate(filter(None, (e.strip() for e in text.split(","))), 1):
        digest = _parse_digest(entry, f"{ENV_API_KEYS} entry {i}") if entry.startswith("sha256:") else digest_of(entry)
        keys.append(ApiKey(digest, f"{ENV_API_KEYS}[{i}]"))
    return keys


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    """The configured keys (file + environment); `check` decides a request."""

    def __init__(self, path: str = "", env_value: str = "") -> None:
        self.path = path
        self._env_keys = parse_env_keys(env_value)
        self._file_keys: list[ApiKey] = []
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        if path:
            self._file_keys = parse_key_file(Path(path).read_text(), path)
            self._stamp = self._stat()

    @classmethod
    def from_environment(cls, path: str) -> ApiKeys:
        return cls(path, os.environ.get(ENV_API_KEYS, ""))

    @property
    def enabled(self) -> bool:
        return bool(self.path or self._env_keys)

    def __len__(self) -> int:
        return len(self._file_keys) + len(self._env_keys)

    def _stat(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if not self.path or now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            keys = parse_key_file(Path(self.path).read_text(), self.path)
        except (OSError, KeyFileError) as exc:
            log.warning("API keys file %s changed but does not load (%s): keeping the previous keys", self.path, exc)
            return
        self._file_keys, self._stamp = keys, stamp
        log.info("API keys file %s reloaded: %d keys", self.path, len(keys))

    def find(self, token: str) -> ApiKey | None:
        """The key whose digest is the token's; every digest is compared (no early exit)."""
        digest = digest_of(token)
        found = None
        for key in (*self._file_keys, *self._env_keys):
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return found

    def check(self, authorization: str | None, proxied: bool) -> tuple[Verdict, ApiKey | None]:
        """The verdict for a request carrying this Authorization value; `proxied`: it goes to an engine."""
        if not self.enabled:
            return Verdict.OPEN, None
        self._reload_if_changed()
        token = bearer_token(authorization)
        if token is None:
            return Verdict.MISSING, None
        key = self.find(token)
        if key is None:
            return Verdict.INVALID, None
        return (Verdict.ALLOWED if key.allows(proxied) else Verdict.FORBIDDEN), key
