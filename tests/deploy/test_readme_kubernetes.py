"""README "Kubernetes": its block, run as it is (kubectl from .venv-deploy, in a scratch folder that sees the
repository's deploy/): the Secret it makes carries a password the control planes' Redis URL takes
as it is, and the ha overlay renders."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import yaml

from kvroute.addresses import parse_redis_url
from tests.deploy.conftest import DeployTools
from tests.helpers import REPO, doc_sh_blocks


def test_the_kubernetes_block_makes_a_usable_redis_secret_and_renders_ha(deploy_tools: DeployTools, tmp_path: Path) -> None:
    (block,) = doc_sh_blocks("README.md", "## Kubernetes")
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    env = {**os.environ, "PATH": f"{deploy_tools.kubectl.parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    secret = yaml.safe_load((tmp_path / "kvroute-redis-secret.yaml").read_text())
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "kvroute-redis")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 64
    # What the ha overlay's control planes build from it (control-plane-redis.yaml) parses back to it.
    assert parse_redis_url(f"redis://:{password}@kvroute-redis:6379/0").password == password
    rendered = [d for d in yaml.safe_load_all((tmp_path / "kvroute-ha.yaml").read_text()) if d]
    assert ("StatefulSet", "kvroute-redis") in {(d["kind"], d["metadata"]["name"]) for d in rendered}
