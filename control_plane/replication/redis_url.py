"""`--redis URL`: which Redis deployment the replicas share, and a client for it.

Accepted forms (user and password are optional everywhere; `%`-escape special characters):
- `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`: one server (or a proxy in front of several).
- `rediss://...`: the same over TLS.
- `redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]`: Sentinels (default
  port 26379) that name the master of SERVICE; the client follows failovers. The password is the
  master's; Sentinels that need one of their own take `?sentinel_password=...`.
  `rediss+sentinel://` talks TLS to the master.
- `redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]`: a Redis Cluster; the hosts are
  seeds, the client learns the rest. `rediss+cluster://` for TLS. No DB (a cluster has only db 0).

Default port 6379 except for Sentinels. Anything else is a `ValueError` naming what is wrong.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Literal

from kvroute.backoff import Backoff

Kind = Literal["single", "sentinel", "cluster"]
SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False), "rediss": ("single", True),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    kind: Kind
    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None
    service: str = ""                  # sentinel: the master's name
    sentinel_password: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """For logs: the URL without credentials."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.service}" if self.kind == "sentinel" else ""
        return f"{self.kind} {'tls ' if self.tls else ''}{hosts}{tail} db={self.db}"


def parse_redis_url(url: str) -> RedisTarget:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"--redis {url!r}: scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    kind, tls = SCHEMES[scheme.lower()]
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
    hosts = tuple(_host_port(url, part, default_port) for part in hostlist.split(",")) if hostlist else ()
    if not hosts:
        raise ValueError(f"--redis {url!r}: no host")
    if kind == "single" and len(hosts) > 1:
        raise ValueError(f"--redis {url!r}: several hosts need redis+sentinel:// or redis+cluster://")
    segments = [s for s in path.split("/") if s]
    service, db = "", 0
    if kind == "sentinel":
        if not segments:
            raise ValueError(f"--redis {url!r}: a sentinel URL names the master's service: "
                             "redis+sentinel://HOST:26379/SERVICE[/DB]")
        service, segments = urllib.parse.unquote(segments[0]), segments[1:]
    if kind == "cluster" and segments:
        raise ValueError(f"--redis {url!r}: a Redis Cluster has no databases; drop the /{'/'.join(segments)}")
    if len(segments) > 1:
        raise ValueError(f"--redis {url!r}: unexpected path /{'/'.join(segments)}")
    if segments:
        if not segments[0].isdigit():
            raise ValueError(f"--redis {url!r}: database must be a number, got {segments[0]!r}")
        db = int(segments[0])
    options = dict(urllib.parse.parse_qsl(query))
    sentinel_password = options.pop("sentinel_password", None)
    if "db" in options:
        db = int(options.pop("db"))
    return RedisTarget(kind, hosts, tls, db, username, password, service, sentinel_password, options)


def _host_port(url: str, part: str, default_port: int) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):  # [IPv6]:port
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.partition(":")
    if not host:
        raise ValueError(f"--redis {url!r}: empty host in {part!r}")
    if port and not port.isdigit():
        raise ValueError(f"--redis {url!r}: port must be a number in {part!r}")
    number = int(port) if port else default_port
    if not 0 < number < 65536:
        raise ValueError(f"--redis {url!r}: port out of range in {part!r}")
    return host, number


def connect(target: RedisTarget, *, socket_timeout_s: float = 3.0, connect_timeout_s: float = 2.0,
            max_connections: int = 256):
    """A redis.asyncio client (Redis or RedisCluster) for `target`; bytes in, bytes out."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff

    # No retries inside the client: kvroute's own loops retry (and an agent's append should fail fast,
    # so it moves to another replica), and a client-side retry swallowed cancellations of blocking reads.
    common = {"username": target.username, "password": target.password, "socket_timeout": socket_timeout_s,
              "socket_connect_timeout": connect_timeout_s, "decode_responses": False,
              "retry": Retry(NoBackoff(), 0)}
    tls = {"ssl": True} if target.tls else {}
    if target.kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], max_connections=max_connections,
                            **common, **tls)
    if target.kind == "sentinel":
        sentinel_kwargs = {"password": target.sentinel_password} if target.sentinel_password else {}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, socket_timeout=socket_timeout_s)
        return sentinel.master_for(target.service, db=target.db, max_connections=max_connections, **common, **tls)
    host, port = target.hosts[0]
    # A blocking pool: a burst of agents registering at once waits for a connection instead of failing
    # (each shard's tail holds one for its blocking XREAD).
    pool = aioredis.BlockingConnectionPool(host=host, port=port, db=target.db, max_connections=max_connections,
                                           timeout=connect_timeout_s, **common,
                                           **({"connection_class": aioredis.SSLConnection} if target.tls else {}))
    return aioredis.Redis(connection_pool=pool)


def redis_backoff() -> Backoff:
    """The waits of a replica's loop while Redis fails: 50 ms doubling to 1 s, so a replica is back
    within about a second of Redis."""
    return Backoff(0.05, 1.0)
