"""The Dockerfile, without a Docker engine: it passes hadolint; it is multi-stage and non-root; every
COPY source exists and is in the build context .dockerignore leaves; its install takes every extra
the shipped manifests' commands need; and its build stage, replayed step by step in a fresh
virtualenv from that build context (COPY as copies, RUN as shell commands), gives a `kvroute` whose
`epp` runs and whose Envoy and OpenTelemetry protos import together."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvroute import cli
from tests.deploy.conftest import DeployTools
from tests.deploy.manifests import kvroute_containers, render
from tests.helpers import REPO, pyproject

DOCKERFILE = REPO / "Dockerfile"
# Every component the manifests ship, so every command a container runs.
ALL_COMPONENTS = ("gateway", "mtls", "prometheus-operator")


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def stages(text: str) -> list[Stage]:
    """The Dockerfile's stages and their instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            out.append(Stage(rest.split(" AS ")[-1].strip() if " AS " in rest else str(len(out))))
        elif out:
            out[-1].instructions.append((instruction.upper(), rest.strip()))
    return out


def copy_sources(arguments: str) -> list[str]:
    """A COPY's sources (all but its destination), for a COPY from the build context (no --from)."""
    words = shlex.split(arguments)
    return [] if any(w.startswith("--from") for w in words) else [w for w in words[:-1] if not w.startswith("--")]


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(exception, pattern) per .dockerignore line, as Docker reads them: patterns anchored at the context's
    root, `*` within one path segment, `**` across any number, a leading `!` re-includes."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = line.removeprefix("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
        rules.append((exception, re.compile(regex + "$")))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves `path` (relative to the context) out: the last rule matching it or one of its
    parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for exception, pattern in rules:
        if any(pattern.match(p) for p in prefixes):
            out = not exception
    return out


def context_files() -> list[str]:
    """The files of the build context: the repository's (tracked, or new and not git-ignored) that
    .dockerignore does not exclude."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    return [f for f in listed if (REPO / f).is_file() and not excluded(f, rules)]


def install_extras(build: Stage) -> set[str]:
    """The extras of `pip install '.[a,b]'` in the build stage's RUN lines."""
    found: set[str] = set()
    for instruction, arguments in build.instructions:
        if instruction == "RUN":
            for match in re.finditer(r"pip install\s+['\"]?\.(?:\[([^\]]*)\])?", arguments):
                found |= {e.strip() for e in (match.group(1) or "").split(",") if e.strip()}
    return found


def test_the_dockerignore_reading_is_dockers() -> None:
    """The matcher above on the cases that decide this repository's context."""
    rules = dockerignore_rules("**\n!kvroute/\n!scripts/restore_shadowed_protos.py\n**/__pycache__\n")
    assert not excluded("kvroute/cli.py", rules) and not excluded("scripts/restore_shadowed_protos.py", rules)
    assert excluded("scripts/gen_protos.sh", rules) and excluded("kvroute/__pycache__/cli.cpython-312.pyc", rules)
    assert excluded("tests/deploy/test_image.py", rules) and excluded(".git/HEAD", rules)


def test_the_dockerfile_is_multi_stage_non_root_and_lints_clean(deploy_tools: DeployTools) -> None:
    result = subprocess.run(
        [str(deploy_tools.hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    build, *_, final = stages(DOCKERFILE.read_text())
    assert build is not final, "multi-stage: build, then a final stage holding the virtualenv only"
    users = [a for i, a in final.instructions if i == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), f"numeric non-root user, got {users}"
    assert any(i == "COPY" and a.startswith("--from=build ") for i, a in final.instructions)
    assert not any(i == "RUN" for i, _ in final.instructions), "the final stage installs nothing (no compiler, no pip run)"
    # The build stage copies every folder the wheel packages.
    copied = {s.rstrip("/") for i, a in build.instructions if i == "COPY" for s in copy_sources(a)}
    assert set(pyproject()["tool"]["setuptools"]["package-dir"].values()) <= copied


def test_every_copy_source_is_in_the_build_context() -> None:
    """A COPY of a file .dockerignore leaves out fails `docker build` (or copies an empty folder)."""
    context = context_files()
    for stage in stages(DOCKERFILE.read_text()):
        for instruction, arguments in stage.instructions:
            if instruction != "COPY":
                continue
            for source in copy_sources(arguments):
                source = source.rstrip("/")
                assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
                inside = [f for f in context if f == source or f.startswith(source + "/")]
                assert inside, f"COPY {source}: .dockerignore leaves it out of the build context"
                if (REPO / source).is_dir():  # every tracked Python file of a copied folder goes in
                    tracked = subprocess.run(
                        ["git", "ls-files", source], cwd=REPO, capture_output=True, text=True, check=True
                    ).stdout.split()
                    missing = [f for f in tracked if f.endswith(".py") and f not in inside]
                    assert not missing, f"COPY {source}: .dockerignore leaves out {missing[:5]}"


def test_the_image_installs_every_extra_the_manifests_commands_need(deploy_tools: DeployTools, tmp_path: Path) -> None:
    docs = render(deploy_tools, "ha", ALL_COMPONENTS, tmp_path)
    commands = {container["args"][0] for _, container in kvroute_containers(docs)}
    assert "epp" in commands, commands
    needed = {cli.SUBCOMMANDS[c].extra for c in commands} - {""}
    build = stages(DOCKERFILE.read_text())[0]
    assert needed <= install_extras(build), f"the image's pip install lacks the extras {needed - install_extras(build)}"
    assert "tools" not in install_extras(build), "the image runs the product, not the benches"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_build_stage_replayed_in_a_fresh_virtualenv_runs_the_picker(tmp_path: Path) -> None:
    """The build stage as Docker would run it, here: its COPY instructions from the build context (what
    .dockerignore leaves), its RUN lines through a shell, /opt/kvroute a fresh virtualenv of this
    machine's Python. The pip cache is kept (PIP_NO_CACHE_DIR dropped): it changes the speed, not the result."""
    build = stages(DOCKERFILE.read_text())[0]
    context, venv, bin_dir = tmp_path / "context", tmp_path / "opt-kvroute", tmp_path / "bin"
    for file in context_files():
        (context / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / file, context / file)
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # the image's `python`
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    workdir = tmp_path
    for instruction, arguments in build.instructions:
        arguments = arguments.replace("/opt/kvroute", str(venv))
        if instruction == "WORKDIR":
            workdir = tmp_path / arguments.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", arguments):
                if key != "PIP_NO_CACHE_DIR":
                    env[key] = value
        elif instruction == "COPY":
            *sources, destination = shlex.split(arguments)
            target = workdir / destination
            for source in (s.rstrip("/") for s in sources):
                if (context / source).is_dir():  # a folder's contents go into the destination folder
                    copies = [(f, target / Path(f).relative_to(source)) for f in context_files() if f.startswith(source + "/")]
                else:  # a file goes into a destination ending in / under its own name, else becomes it
                    copies = [(source, target / Path(source).name if destination.endswith("/") else target)]
                for file, into in copies:
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(context / file, into)
        elif instruction == "RUN":
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", arguments],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=800,
                check=False,
            )
            assert done.returncode == 0, f"RUN {arguments}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    kvroute = venv / "bin" / "kvroute"
    picker = subprocess.run(
        [str(kvroute), "epp", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert picker.returncode == 0 and "--grpc-port" in picker.stdout, picker.stderr
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
    )
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert imported.returncode == 0, imported.stderr[-2000:]
    check = subprocess.run(
        [str(venv / "bin" / "python"), str(REPO / "scripts" / "restore_shadowed_protos.py"), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    assert not (venv / "bin" / "pip").exists(), "the build stage removes pip from the virtualenv it ships"
