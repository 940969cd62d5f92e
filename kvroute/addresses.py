"""Every address a kvroute command takes, parsed strictly at start, one parser per kind; and the
rotation over several control-plane replicas.

    p.add_argument("--control-plane", type=control_plane_addresses)  # HOST:PORT[,HOST:PORT...], port 1..65535
    p.add_argument("--listen", type=listen_address)                  # HOST:PORT, port 0 = any free port
    p.add_argument("--host", type=listen_host)                       # HOST (IPv6 with or without brackets)
    p.add_argument("--port", type=port)                              # 0..65535
    p.add_argument("--engine-url", type=http_url)                    # http(s)://HOST[:PORT][/PATH]
    p.add_argument("--engine-urls", type=http_urls)                  # URL[,URL...]
    p.add_argument("--kv-events", type=zmq_endpoint)                 # tcp://HOST:PORT, tcp://*:PORT, ipc://, inproc://
    p.add_argument("--static-workers", type=static_workers)          # ID[@MODEL]=URL[,ID[@MODEL]=URL...]
    p.add_argument("--pd-bootstrap-port", type=port_map)             # PORT and/or ID=PORT[,...], port 1..65535
    p.add_argument("--redis", type=redis_url)                        # redis[s][+sentinel|+cluster]://...

Each type returns the text as given (so `kvroute config show` prints what was written) or raises
argparse.ArgumentTypeError saying what is wrong: argparse prefixes the flag, the config layer the
file key or environment variable, so a value from a file or KVROUTE_* is checked exactly as a flag
is, before anything starts. `127.0.0.1:500051`, `http://127.0.0.1:50051` where HOST:PORT is meant,
a missing port and a host that cannot be a host name are all refused.

Several control-plane replicas behind one flag: `--control-plane A:50051,B:50051` or one name that
resolves to several addresses (a Kubernetes headless Service). Agents and routers go round them
(`AddressRotation`). Each entry is resolved again at every round, so replicas that moved (new pod
IPs) are found; an IP literal, or a name that resolves to one address, stays as written (gRPC
resolves it itself). A name that resolves to several becomes one address each (IPv4 when it has
any, else IPv6).
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str  # an IPv6 literal without its brackets
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _bad(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def check_host(host: str, where: str) -> str:
    """`host` (an IPv4 or IPv6 literal, or a DNS name) or ArgumentTypeError; `where` is the text it came from."""
    if not host:
        raise _bad(f"no host in {where!r}")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(f"{host!r} in {where!r} is not an IPv6 address") from None
        return host
    labels = host.removesuffix(".").split(".")
    if all(label.isdigit() for label in labels):  # looks like IPv4: it must be one
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _bad(f"{host!r} in {where!r} is not an IPv4 address") from None
        return host
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise _bad(f"{host!r} in {where!r} is not a host name")
    return host


def check_port(text: str, where: str | None, *, allow_zero: bool) -> int:
    """`text` as a port number (1..65535, or 0..65535 with `allow_zero`); `where`: the address it is
    part of, for the message (None: it stands alone)."""
    low = 0 if allow_zero else 1
    within = f" in {where!r}" if where is not None else ""
    if not text.isdigit():
        raise _bad(f"port {text!r}{within} is not a number" if text else f"no port{within}")
    number = int(text)
    if not low <= number <= 65535:
        raise _bad(f"port {number}{within} is out of range ({low}..65535)")
    return number


def parse_host_port(text: str, *, allow_zero: bool = False, default_port: int | None = None) -> HostPort:
    """HOST:PORT or [IPv6]:PORT (no scheme, no path); port 0 only with `allow_zero`; a missing port is
    `default_port` when there is one. ArgumentTypeError says what is wrong."""
    text = text.strip()
    if "://" in text:
        raise _bad(f"{text!r} is a URL: give HOST:PORT (no scheme)")
    if "/" in text:
        raise _bad(f"{text!r} is not HOST:PORT (no path)")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _bad(f"{text!r} is not [IPv6]:PORT")
        port_text = rest[1:] if rest else None
        if ":" not in host:
            raise _bad(f"{host!r} in {text!r} is not an IPv6 address (brackets are for IPv6)")
    elif text.count(":") > 1:
        raise _bad(f"{text!r}: write an IPv6 address in brackets, [ADDRESS]:PORT")
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
    check_host(host, text)
    if port_text is None:
        if default_port is None:
            raise _bad(f"no port in {text!r}: give HOST:PORT")
        return HostPort(host, default_port)
    return HostPort(host, check_port(port_text, text, allow_zero=allow_zero))


def split_list(spec: str, what: str) -> list[str]:
    """The comma-separated entries of `spec` (`what` they are, for the message); ArgumentTypeError when
    there is none."""
    entries = [part.strip() for part in spec.split(",") if part.strip()]
    if not entries:
        raise _bad(f"no {what} in {spec!r}")
    return entries


def parse_dns_server(text: str) -> HostPort:
    """A DNS server to ask: IP, IP:PORT or [IPv6]:PORT (a bare IPv6 address too); port 53 unless given.
    A name is refused: resolving the resolver would need a resolver."""
    text = text.strip()
    try:
        return HostPort(str(ipaddress.ip_address(text)), 53)
    except ValueError:
        pass
    target = parse_host_port(text, default_port=53)
    try:
        ipaddress.ip_address(target.host)
    except ValueError:
        raise _bad(f"{text!r}: the DNS server must be an IP address (IP[:PORT])") from None
    return target


# ------------------------------------------------------------------------------- argparse types


def dns_server(text: str) -> str:
    """argparse type of a DNS server (`parse_dns_server`); "" is the system's resolvers."""
    if not text.strip():
        return ""
    parse_dns_server(text)
    return text.strip()


def port(text: str) -> int:
    """A port to listen on: 0..65535, 0 = any free port (the bound one is read back from --port-file)."""
    return check_port(text.strip(), None, allow_zero=True)


OFF = "off"


def port_or_off(text: str) -> int | None:
    """A port for a listener that may be turned off: `off` -> None, else as `port` (0 = any free port)."""
    return None if text.strip().lower() == OFF else port(text)


def listen_host(text: str) -> str:
    """A host to listen on, without port; an IPv6 literal's brackets are dropped (`[::]` -> `::`)."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if "://" in host or "/" in host or host.count(":") == 1:
        raise _bad(f"{text!r} is not a host: no scheme, port or path (the port has its own flag)")
    return check_host(host, text)


def listen_address(text: str) -> str:
    """HOST:PORT to listen on; port 0 = any free port."""
    parse_host_port(text, allow_zero=True)
    return text.strip()


def connect_address(text: str) -> str:
    """HOST:PORT to connect to (port 1..65535)."""
    parse_host_port(text)
    return text.strip()


def control_plane_addresses(text: str) -> str:
    """One or more control-plane replicas: HOST:PORT[,HOST:PORT...]."""
    return ",".join(connect_address(entry) for entry in split_list(text, "control-plane address"))


def http_url(text: str) -> str:
    """An engine's or router's base URL: http(s)://HOST[:PORT][/PATH], no query, no credentials."""
    url = text.strip()
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise _bad(f"{url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise _bad(f"{url!r} is not an http:// or https:// URL")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise _bad(f"{url!r}: a base URL has no query, fragment or credentials")
    netloc = parts.netloc
    default = 443 if parts.scheme == "https" else 80
    if netloc.endswith(":"):
        raise _bad(f"no port after ':' in {url!r}")
    parse_host_port(netloc, default_port=default)
    return url


def http_url_or_none(text: str) -> str:
    """`http_url`, or "" for none (a flag whose absence means something, e.g. bench a local fleet)."""
    return http_url(text) if text.strip() else ""


def http_urls(text: str) -> str:
    """URL[,URL...] (each as `http_url`); "" = none."""
    return ",".join(http_url(entry) for entry in split_list(text, "URL")) if text.strip() else ""


def zmq_endpoint(text: str) -> str:
    """A ZMQ endpoint: tcp://HOST:PORT (HOST may be `*`), ipc://PATH or inproc://NAME."""
    endpoint = text.strip()
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise _bad(f"{endpoint!r} is not tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme != "tcp":
        if not rest:
            raise _bad(f"{endpoint!r} names no {'path' if scheme == 'ipc' else 'name'}")
        return endpoint
    if rest.startswith("*"):
        if not rest.startswith("*:"):
            raise _bad(f"no port in {endpoint!r}: give tcp://*:PORT")
        check_port(rest[2:], endpoint, allow_zero=True)
        return endpoint
    parse_host_port(rest, allow_zero=True)
    return endpoint


@dataclass(frozen=True, slots=True)
class StaticWorker:
    url: str  # without a trailing slash
    model: str  # "" = the router's default model


def parse_static_fleet(text: str) -> dict[str, StaticWorker]:
    """ID[@MODEL]=URL[,...] -> {id: StaticWorker}; "" = none. MODEL names the model the engine serves
    (a model id has no "@"), else it serves the router's default model."""
    workers: dict[str, StaticWorker] = {}
    for item in split_list(text, "ID=URL") if text.strip() else []:
        name, sep, url = item.partition("=")
        worker_id, at, model = name.strip().partition("@")
        worker_id, model = worker_id.strip(), model.strip()
        if not sep or not worker_id or not url.strip() or (at and not model):
            raise _bad(f"{item!r} is not ID=URL or ID@MODEL=URL")
        if worker_id in workers:
            raise _bad(f"worker id {worker_id!r} is given twice")
        workers[worker_id] = StaticWorker(http_url(url).rstrip("/"), model)
    return workers


def parse_static_workers(text: str) -> dict[str, str]:
    """ID[@MODEL]=URL[,...] -> {id: url without a trailing slash}; "" = none."""
    return {worker_id: worker.url for worker_id, worker in parse_static_fleet(text).items()}


def static_workers(text: str) -> str:
    parse_static_fleet(text)
    return text.strip()


def parse_port_map(text: str) -> tuple[int | None, dict[str, int]]:
    """`PORT` and/or `ID=PORT,...` -> (the port for all or None, {id: port}); ArgumentTypeError otherwise."""
    default, ports = None, {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.rpartition("=")
        if not value.isdigit() or not 0 < int(value) < 65536 or (sep and not name.strip()):
            raise _bad(f"expected PORT or ID=PORT (port 1..65535), got {item!r}")
        if sep:
            ports[name.strip()] = int(value)
        else:
            default = int(value)
    return default, ports


def port_map(text: str) -> str:
    parse_port_map(text)
    return text.strip()


# ------------------------------------------------------------------------------------ Redis URLs

RedisKind = Literal["single", "sentinel", "cluster"]
REDIS_SCHEMES: dict[str, tuple[RedisKind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Which Redis deployment a `--redis` URL names (kvroute/control_plane/replication/redis_url.py connects)."""

    kind: RedisKind
    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None
    service: str = ""  # sentinel: the master's name
    sentinel_password: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """For logs: the URL without credentials."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.service}" if self.kind == "sentinel" else ""
        return f"{self.kind} {'tls ' if self.tls else ''}{hosts}{tail} db={self.db}"


def parse_redis_url(url: str) -> RedisTarget:
    """Accepted forms (user and password are optional everywhere; `%`-escape special characters):
    - `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`: one server (or a proxy in front of several);
      `rediss://...` over TLS.
    - `redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]`: Sentinels
      (default port 26379) that name the master of SERVICE. The password is the master's; Sentinels
      that need one of their own take `?sentinel_password=...`. `rediss+sentinel://` for TLS.
    - `redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]`: a Redis Cluster; the hosts
      are seeds. `rediss+cluster://` for TLS. No DB (a cluster has only db 0).
    Default port 6379 except for Sentinels. Anything else is a ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in REDIS_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in REDIS_SCHEMES)}")
    kind, tls = REDIS_SCHEMES[scheme.lower()]
    # urllib cannot parse a comma-separated host list: split the authority ourselves.
    authority, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    if "?" in authority:
        authority, _, query = authority.partition("?")
    userinfo, at, hostlist = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
        if not colon:  # redis://secret@host is redis-py's form for a password alone
            username, password = None, urllib.parse.unquote(user)
    default_port = 26379 if kind == "sentinel" else 6379
    hosts = []
    for part in (p.strip() for p in hostlist.split(",")) if hostlist else ():
        try:
            where = parse_host_port(part, default_port=default_port)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        hosts.append((where.host, where.port))
    if not hosts:
        raise ValueError("no host")
    if kind == "single" and len(hosts) > 1:
        raise ValueError("several hosts need redis+sentinel:// or redis+cluster://")
    segments = [s for s in path.split("/") if s]
    service, db = "", 0
    if kind == "sentinel":
        if not segments:
            raise ValueError("a sentinel URL names the master's service: redis+sentinel://HOST:26379/SERVICE[/DB]")
        service, segments = urllib.parse.unquote(segments[0]), segments[1:]
    if kind == "cluster" and segments:
        raise ValueError(f"a Redis Cluster has no databases; drop the /{'/'.join(segments)}")
    if len(segments) > 1:
        raise ValueError(f"unexpected path /{'/'.join(segments)}")
    if segments:
        if not segments[0].isdigit():
            raise ValueError(f"database must be a number, got {segments[0]!r}")
        db = int(segments[0])
    options = dict(urllib.parse.parse_qsl(query))
    sentinel_password = options.pop("sentinel_password", None)
    if "db" in options:
        if not options["db"].isdigit():
            raise ValueError(f"database must be a number, got {options['db']!r}")
        db = int(options.pop("db"))
    return RedisTarget(kind, tuple(hosts), tls, db, username, password, service, sentinel_password, options)


def redis_url(text: str) -> str:
    """A `--redis` URL (`parse_redis_url`); "" = no Redis."""
    if text:
        try:
            parse_redis_url(text)
        except ValueError as exc:
            raise _bad(str(exc)) from None
    return text


# ------------------------------------------------------------------- several control-plane replicas


def split_addresses(spec: str) -> list[str]:
    """The comma-separated entries of `spec`; ValueError when there is none."""
    try:
        return split_list(spec, "control-plane address")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def resolve_all(address: str) -> list[str]:
    """`address` as one HOST:PORT per address its host resolves to; itself when it resolves to one
    or none (an unresolvable name is gRPC's to report) or is a literal."""
    try:
        where = parse_host_port(address)
    except argparse.ArgumentTypeError:
        return [address]
    host, port_number = where.host, where.port
    try:
        ipaddress.ip_address(host)
        return [address]  # a literal
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port_number, type=socket.SOCK_STREAM)
    except OSError:
        return [address]
    v4 = list(dict.fromkeys(info[4][0] for info in infos if info[0] == socket.AF_INET))
    ips = v4 or list(dict.fromkeys(info[4][0] for info in infos if info[0] == socket.AF_INET6))
    if len(ips) <= 1:
        return [address]
    return [str(HostPort(ip, port_number)) for ip in ips]


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
