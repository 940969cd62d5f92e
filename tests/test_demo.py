"""`kvroute demo` (what `make demo` runs), shortened: it cleans up after itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHORT = ("--engines", "2", "--conversations", "6", "--turns", "2", "--system-prompts", "2",
         "--system-prompt-words", "200", "--arrival-rate", "20", "--think-time", "0.05")


def run_demo(tmpdir: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmpdir)}  # where its own temporary directory goes
    return subprocess.run([sys.executable, "-m", "kvroute.cli", "demo", *SHORT, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_demo_removes_its_temporary_directory_and_keeps_a_given_workdir(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = run_demo(tmpdir)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout.splitlines()[-1])["policies"]) == {"kv_aware", "round_robin"}
    assert list(tmpdir.iterdir()) == [], "the demo left its temporary directory behind"

    workdir = tmp_path / "kept"
    out = run_demo(tmpdir, "--workdir", str(workdir), "--policies", "kv_aware")
    assert out.returncode == 0, out.stderr
    assert (workdir / "control-plane.log").exists() and (workdir / "tiny-llama" / "tokenizer.json").exists()
    assert list(tmpdir.iterdir()) == []
