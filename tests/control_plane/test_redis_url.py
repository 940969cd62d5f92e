"""`--redis URL`: every accepted form parses to the deployment it names; anything else is a clear error."""

from __future__ import annotations

import pytest

from kvroute.addresses import parse_redis_url


def test_single_server_forms() -> None:
    t = parse_redis_url("redis://cache.internal")
    assert (t.kind, t.hosts, t.tls, t.db, t.password) == ("single", (("cache.internal", 6379),), False, 0, None)
    t = parse_redis_url("rediss://app:s%40cret@10.0.0.5:6380/2")
    assert (t.kind, t.hosts, t.tls, t.db, t.username, t.password) == ("single", (("10.0.0.5", 6380),), True, 2, "app", "s@cret")
    t = parse_redis_url("redis://:pw@[::1]:7000")
    assert (t.hosts, t.username, t.password) == ((("::1", 7000),), None, "pw")
    assert parse_redis_url("redis://pw@h").password == "pw"  # redis-py's password-only form
    assert "cache.internal:6379" in parse_redis_url("redis://u:secret@cache.internal").describe()
    assert "secret" not in parse_redis_url("redis://u:secret@cache.internal").describe()


def test_sentinel_form() -> None:
    t = parse_redis_url("redis+sentinel://:pw@s1:26380,s2,s3:26381/mymaster/1?sentinel_password=spw")
    assert t.kind == "sentinel" and t.service == "mymaster" and t.db == 1
    assert t.hosts == (("s1", 26380), ("s2", 26379), ("s3", 26381))
    assert (t.password, t.sentinel_password, t.tls) == ("pw", "spw", False)
    assert parse_redis_url("rediss+sentinel://s1/m").tls


def test_cluster_form() -> None:
    t = parse_redis_url("redis+cluster://n1:7000,n2:7001")
    assert (t.kind, t.hosts, t.db) == ("cluster", (("n1", 7000), ("n2", 7001)), 0)
    assert parse_redis_url("rediss+cluster://n1").tls


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h", "scheme must be one of"),
        ("h:6379", "scheme must be one of"),
        ("redis://", "no host"),
        ("redis://a,b", "several hosts need"),
        ("redis://h:port", "port 'port' in 'h:port' is not a number"),
        ("redis://h:70000", r"port 70000 in 'h:70000' is out of range"),
        ("redis://h/x", "database must be a number"),
        ("redis://h/1/2", "unexpected path"),
        ("redis+sentinel://s1", "names the master's service"),
        ("redis+cluster://n1/3", "has no databases"),
    ],
)
def test_malformed_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_redis_url(url)
