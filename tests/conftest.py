"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvroute.tools.local_cluster import LocalCluster
from kvroute.tools.redis_harness import RedisClusterHarness, RedisServer, temp_workdir
from kvroute.tools.tiny_model import build_model_dir
from tests.helpers import REPO, InstalledKvroute, floor, floor_venv, pyproject, requirements

# What building the distribution reads: pyproject's package folders, and its readme.
DIST_SOURCES = ("pyproject.toml", "README.md", "kvroute", "control_plane", "data_plane", "worker_agent", "tools")


@pytest.fixture(scope="session")
def kvroute_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of the working tree as `pip install .` builds it, from a copy of what the build reads
    (an in-tree build would leave build/ behind). Built without isolation: setuptools is a dev dependency."""
    source = tmp_path_factory.mktemp("dist-source")
    for name in DIST_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(source),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, f"the wheel does not build:\n{build.stdout[-2000:]}\n{build.stderr[-3000:]}"
    (wheel,) = out.glob("kvroute-*.whl")
    return wheel


@pytest.fixture(scope="session")
def installed_kvroute(kvroute_wheel: Path) -> InstalledKvroute:
    """This tree installed as `pip install .` installs it (its wheel, not editable) into a virtualenv that
    holds the runtime dependencies and nothing else, grpcio and protobuf at their floors (built once per
    pyproject and interpreter under .kvroute-cache/). No package index is used: an install that needed
    anything more than the runtime dependencies fails here."""
    project = pyproject()["project"]
    deps = requirements(project["dependencies"])
    venv = floor_venv(project["dependencies"], {name: floor(deps[name]) for name in ("grpcio", "protobuf")})
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "uninstall", "-y", "kvroute"], check=True, capture_output=True, timeout=120)  # a previous run's
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    before = {p.name for p in site.iterdir()}
    install = subprocess.run(
        [*pip, "install", "--no-index", str(kvroute_wheel)], check=False, capture_output=True, text=True, timeout=300
    )
    assert install.returncode == 0, f"pip install . needs more than the runtime dependencies:\n{install.stderr[-3000:]}"
    after = {p.name for p in site.iterdir()}
    return InstalledKvroute(venv, site, frozenset(after - before), frozenset(before - after))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model (tokenizer, chat template, config), built once per run; its name is the
    model name routers default to."""
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama")


def _fleets(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Callable[..., LocalCluster]]:
    made: list[LocalCluster] = []

    def make(name: str = "fleet", **options) -> LocalCluster:
        cluster = LocalCluster(workdir=tmp_path_factory.mktemp(name), tokenizer_dir=model_dir, **options)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture
def local_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Callable[..., LocalCluster]]:
    """`local_fleet(name, **LocalCluster options)`: a local fleet (processes start as the test asks) on
    the tiny model, in a directory of its own, stopped when the test ends."""
    yield from _fleets(tmp_path_factory, tiny_model_dir)


@pytest.fixture(scope="module")
def module_local_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Callable[..., LocalCluster]]:
    """`local_fleet` for a module's tests to share: stopped when the module's last test ends."""
    yield from _fleets(tmp_path_factory, tiny_model_dir)


# Real Redis servers for the replica tests (tools/redis_harness.py): one single server and one
# 3-master Cluster per test session (a cluster takes ~1-2 s to start), flushed before each test
# that asks for them. `redis_any` runs a test against both.
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


# Hypothesis profiles for the property-based tests (tests/worker_agent/test_hostile_*.py,
# tests/e2e/test_hostile_input_properties.py): `ci`
# (default, what `make test` runs: ~200 examples per property, no deadline, since this machine's speed
# varies) and `fuzz` (many more, for a long hand run, without the 120 s test timeout):
# `HYPOTHESIS_PROFILE=fuzz .venv/bin/pytest --timeout 0 tests/worker_agent/test_hostile_*.py`.
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_DATA)
settings.register_profile("fuzz", max_examples=20_000, deadline=None, print_blob=True, suppress_health_check=_SLOW_DATA)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# What a test uses decides its markers (`make check` leaves out e2e, redis, slow and vllm):
# - redis: it takes a Redis fixture (a redis-server of its own, or the one on 6379);
# - e2e: it starts processes: a fixture that starts a fleet or a wheel install, or its module starts
#   them itself (one of PROCESS_STARTERS in its source).
REDIS_FIXTURES = frozenset({"_redis_single", "_redis_cluster", "redis_single", "redis_cluster", "redis_any"})
PROCESS_FIXTURES = frozenset({"local_fleet", "module_local_fleet", "installed_kvroute", "kvroute_wheel"})
PROCESS_STARTERS = (
    "ManagedProcess",
    "LocalCluster",
    "ReplicaCluster",
    "kvroute_argv",
    "subprocess.",
    "Popen(",
    "start_replica",
    "run_demo",
    "redis_harness",
    "multiprocessing",
)


def _starts_processes(path: Path, cache: dict[Path, bool]) -> bool:
    if path not in cache:
        text = path.read_text()
        cache[path] = any(word in text for word in PROCESS_STARTERS)
    return cache[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sources: dict[Path, bool] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & REDIS_FIXTURES:
            item.add_marker(pytest.mark.redis)
        if fixtures & (PROCESS_FIXTURES | REDIS_FIXTURES) or _starts_processes(item.path, sources):
            item.add_marker(pytest.mark.e2e)
