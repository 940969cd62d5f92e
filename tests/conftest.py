"""Fixtures shared by every test folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-w", str(out), str(source)],
                           check=False, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"the wheel does not build:\n{build.stdout[-2000:]}\n{build.stderr[-3000:]}"
    (wheel,) = out.glob("kvroute-*.whl")
    return wheel
