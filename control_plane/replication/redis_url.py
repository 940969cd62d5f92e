"""`--redis URL`: a client for the Redis deployment the replicas share.

    client = connect(parse_redis_url(url))   # parse_redis_url: kvroute/addresses.py, with every accepted form

`connect` builds a redis.asyncio client for a single server, Sentinels or a Cluster; `redis_backoff`
is the waits of a replica's loops while Redis fails.
"""

from __future__ import annotations

from kvroute.addresses import RedisTarget
from kvroute.backoff import Backoff


def connect(target: RedisTarget, *, socket_timeout_s: float = 3.0, connect_timeout_s: float = 2.0, max_connections: int = 256):
    """A redis.asyncio client (Redis or RedisCluster) for `target`; bytes in, bytes out."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff

    # No retries inside the client: kvroute's own loops retry (and an agent's append should fail fast,
    # so it moves to another replica), and a client-side retry swallowed cancellations of blocking reads.
    common = {
        "username": target.username,
        "password": target.password,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": False,
        "retry": Retry(NoBackoff(), 0),
    }
    tls = {"ssl": True} if target.tls else {}
    if target.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], max_connections=max_connections, **common, **tls
        )
    if target.kind == "sentinel":
        sentinel_kwargs = {"password": target.sentinel_password} if target.sentinel_password else {}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, socket_timeout=socket_timeout_s)
        return sentinel.master_for(target.service, db=target.db, max_connections=max_connections, **common, **tls)
    host, port = target.hosts[0]
    # A blocking pool: a burst of agents registering at once waits for a connection instead of failing
    # (each shard's tail holds one for its blocking XREAD).
    pool = aioredis.BlockingConnectionPool(
        host=host,
        port=port,
        db=target.db,
        max_connections=max_connections,
        timeout=connect_timeout_s,
        **common,
        **({"connection_class": aioredis.SSLConnection} if target.tls else {}),
    )
    return aioredis.Redis(connection_pool=pool)


def redis_backoff() -> Backoff:
    """The waits of a replica's loop while Redis fails: 50 ms doubling to 1 s, so a replica is back
    within about a second of Redis."""
    return Backoff(0.05, 1.0)
