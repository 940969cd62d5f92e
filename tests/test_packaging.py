"""One distribution, `kvroute`: every folder with an __init__.py is packaged under kvroute.*, `pip install .`
puts the product with its runtime dependencies only into site-packages, and a tool subcommand
without its extra says what to install."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from kvroute.cli import SUBCOMMANDS
from tests.helpers import REPO, InstalledKvroute, pyproject, requirements

TOOLS_ONLY = {"matplotlib", "numpy"}


def test_every_package_folder_is_packaged() -> None:
    """A folder holding an __init__.py under one of the mapped roots must be in pyproject's package list
    (or pip install leaves it out, and only an installed kvroute notices), and every listed one exists."""
    setuptools = pyproject()["tool"]["setuptools"]
    listed, roots = set(setuptools["packages"]), setuptools["package-dir"]
    found = set()
    for name, folder in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(REPO / folder).parts)))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but not a package folder: {sorted(listed - found)}"


def test_the_runtime_dependencies_are_the_products() -> None:
    project = pyproject()["project"]
    runtime = requirements(project["dependencies"])
    extras = {name: requirements(lines) for name, lines in project["optional-dependencies"].items()}
    assert TOOLS_ONLY & set(runtime) == set(), "matplotlib and numpy are for the tools, not the router"
    assert TOOLS_ONLY <= set(extras["tools"])
    assert {"pytest", "ruff", "grpcio-tools"} <= set(extras["dev"])
    # xds-protos overwrites other distributions' files (scripts/restore_shadowed_protos.py): never a runtime need
    assert "xds-protos" not in runtime and "xds-protos" in extras["epp"]
    assert all(str(r.specifier).startswith("==") for n, r in extras["dev"].items() if n in ("ruff", "grpcio-tools"))


def test_the_wheel_holds_kvroute_only(kvroute_wheel: Path) -> None:
    with zipfile.ZipFile(kvroute_wheel) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    name, version = kvroute_wheel.name.split("-")[:2]  # a platform wheel: it holds the prefix index's C extension
    assert {n.split("/")[0] for n in names} == {"kvroute", f"{name}-{version}.dist-info"}
    for module in ("kvroute/control_plane/server.py", "kvroute/tools/sim_engine/tokenizer.py", "kvroute/v1/kvroute_pb2.py"):
        assert module in names
    assert any(n.startswith("kvroute/prefix_index/_native.") and n.endswith((".so", ".pyd")) for n in names), names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for line in requires:
        if line.split()[1].split(">")[0].split("=")[0].lower() in TOOLS_ONLY:
            assert 'extra == "tools"' in line, line


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_dot_adds_kvroute_only_and_its_commands_work(installed_kvroute: InstalledKvroute, tmp_path: Path) -> None:
    version = pyproject()["project"]["version"]
    assert installed_kvroute.added == {"kvroute", f"kvroute-{version}.dist-info"}
    assert installed_kvroute.removed == set()
    present = {p.name.split("-")[0].lower() for p in installed_kvroute.site_packages.iterdir()}
    assert present & TOOLS_ONLY == set(), "the runtime install pulled in a tools-only package"

    kvroute = str(installed_kvroute.venv / "bin" / "kvroute")

    def run(*args: str) -> subprocess.CompletedProcess:  # outside the source tree: the installed package only
        return subprocess.run([kvroute, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)

    listing = run("--help")
    assert listing.returncode == 0, listing.stderr
    assert all(name in listing.stdout for name in SUBCOMMANDS)
    router = run("router", "--help")
    assert router.returncode == 0 and "--control-plane" in router.stdout and "--tokenizer" in router.stdout, router.stderr
    tools = [name for name, command in SUBCOMMANDS.items() if command.extra == "tools"]
    assert {"demo", "simulate", "sim-engine", "bench"} <= set(tools)
    for name in tools:
        refused = run(name, "--help")
        assert refused.returncode == 2 and refused.stdout == "", (name, refused.stdout)
        assert refused.stderr.count("\n") == 1 and "pip install 'kvroute[tools]'" in refused.stderr, refused.stderr
    picker = run("epp", "--help")  # Envoy's protos are the epp extra
    assert picker.returncode == 2 and "pip install 'kvroute[epp]'" in picker.stderr, picker.stderr
