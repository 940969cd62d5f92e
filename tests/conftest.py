"""Shared fixtures: real Redis servers for the replica tests (kvroute/redis_harness.py).

One single server and one 3-master Cluster per test session (starting a cluster takes ~1-2 s),
flushed before each test that asks for them, so tests stay isolated without paying the start-up
each time. `redis_any` runs a test against both."""

from __future__ import annotations

import pytest

from kvroute.redis_harness import RedisClusterHarness, RedisServer, temp_workdir


@pytest.fixture(scope="session")
def _redis_single():
    server = RedisServer(temp_workdir()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _redis_cluster():
    cluster = RedisClusterHarness(temp_workdir()).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_single(_redis_single) -> RedisServer:
    _redis_single.cli("flushall")
    return _redis_single


@pytest.fixture
def redis_cluster(_redis_cluster) -> RedisClusterHarness:
    for node in _redis_cluster.nodes:
        node.cli("flushall")
    return _redis_cluster


@pytest.fixture(params=["single", "cluster"])
def redis_any(request) -> str:
    """The URL of a flushed Redis: a single server, then a 3-master Cluster."""
    if request.param == "single":
        return request.getfixturevalue("redis_single").url
    return request.getfixturevalue("redis_cluster").url
