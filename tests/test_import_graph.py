"""Who may import whom, and what a process loads.

Read from the source (every import statement of every packaged module, those inside functions
included): the planes never import one another, the shared core (`kvroute.*` outside the planes and
tools) imports no plane, the product imports nothing of `kvroute.tools` nor any package only the
tools extra installs, the sim engine (an engine's stand-in) imports no plane, every first-party
import is spelled `kvroute.*`, and the components (core, each plane, each tool) import one another
without a cycle.

Run: `kvroute --help` imports no subcommand, and `kvroute router` (its help, and a router serving)
loads nothing of the tools, of matplotlib or numpy, or of another plane."""

from __future__ import annotations

import ast
import functools
import json
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvroute.tools.local_cluster import ManagedProcess, free_port, http_ok, http_post_json, wait_until
from tests.helpers import REPO

PLANES = ("kvroute.control_plane", "kvroute.data_plane", "kvroute.worker_agent")
TOOLS = "kvroute.tools"
# Top-level names the folders had before they were mapped under kvroute.*.
OLD_NAMES = {"control_plane", "data_plane", "worker_agent", "tools", "sim_engine", "simulator", "bench"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the deepest packaged module the statement names)
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir: import name -> folder."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


@functools.cache
def modules() -> dict[str, Path]:
    """Every packaged module: dotted name -> file (a package's is its __init__.py)."""
    found: dict[str, Path] = {}
    for name, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" not in parts:
                found[".".join((name, *parts)).removesuffix(".__init__")] = path
    return found


def imports(known: dict[str, Path]) -> Iterator[Import]:
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(source, alias.name, where)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    yield Import(source, candidate if candidate in known else base, where)


def component(module: str) -> str:
    """kvroute (the shared core), a plane, or one tool (kvroute.tools.X)."""
    for plane in PLANES:
        if module == plane or module.startswith(plane + "."):
            return plane
    if module.startswith(TOOLS + "."):
        return ".".join(module.split(".")[:3])
    return TOOLS if module == TOOLS else "kvroute"


@functools.cache
def all_imports() -> tuple[Import, ...]:
    return tuple(imports(modules()))


def first_party() -> list[Import]:
    return [i for i in all_imports() if i.target == "kvroute" or i.target.startswith("kvroute.")]


def test_every_first_party_import_is_spelled_kvroute() -> None:
    old = [str(i) for i in all_imports() if i.target.split(".")[0] in OLD_NAMES]
    assert old == [], "import these as kvroute.*:\n" + "\n".join(old)


def test_no_plane_imports_another_plane() -> None:
    crossing = [
        str(i)
        for i in first_party()
        if component(i.source) in PLANES and component(i.target) in PLANES and component(i.source) != component(i.target)
    ]
    assert crossing == [], "planes talk through the proto only:\n" + "\n".join(crossing)


def test_the_core_imports_no_plane_and_the_product_no_tool() -> None:
    upward = [str(i) for i in first_party() if component(i.source) == "kvroute" and component(i.target) in PLANES]
    assert upward == [], "the shared core is below the planes:\n" + "\n".join(upward)
    product_to_tools = [
        str(i) for i in first_party() if not component(i.source).startswith(TOOLS) and component(i.target).startswith(TOOLS)
    ]
    assert product_to_tools == [], "the product never imports a tool:\n" + "\n".join(product_to_tools)


def test_the_sim_engine_imports_no_plane() -> None:
    """It stands in for vLLM, SGLang or TensorRT-LLM, which render, tokenize and publish on their own:
    sharing the router's code would hide the very mismatches the tests are there to catch."""
    shared = [str(i) for i in first_party() if component(i.source) == f"{TOOLS}.sim_engine" and component(i.target) in PLANES]
    assert shared == [], "the sim engine shares no code with the planes:\n" + "\n".join(shared)


def test_the_product_imports_nothing_only_the_tools_extra_installs() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("-", "_") for r in project["dependencies"]}
    tool_only = {
        re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("-", "_") for r in project["optional-dependencies"]["tools"]
    } - names
    assert tool_only, "the tools extra names no package of its own"
    found = [str(i) for i in all_imports() if not component(i.source).startswith(TOOLS) and i.target.split(".")[0] in tool_only]
    assert found == [], f"the product must run without {sorted(tool_only)}:\n" + "\n".join(found)


def test_components_import_one_another_without_a_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for i in first_party():
        a, b = component(i.source), component(i.target)
        if a != b and b != TOOLS:  # kvroute.tools itself is only a docstring
            edges.setdefault(a, set()).add(b)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif len(path) < len(edges) + 1:
                visit(nxt, [*path, nxt])

    for start in sorted(edges):
        visit(start, [start])
    assert cycles == [], "components import each other in a circle:\n" + "\n".join(sorted(set(cycles)))


# The data plane's rooms, lowest layer first. A room imports its own layer and those below; the
# transports (the last layer but the entry point) never import one another.
DATA_PLANE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"decision", "ops"}),
    frozenset({"prepare"}),
    frozenset({"api"}),
    frozenset({"access", "cp_link", "engines"}),
    frozenset({"service"}),
    frozenset({"http", "grpc", "epp"}),
    frozenset({"cli", "epp_cli"}),
)
TRANSPORTS = DATA_PLANE_LAYERS[-2]
DATA_PLANE = "kvroute.data_plane"
# What the pure decision may import: first-party, only itself and the key algorithm; otherwise
# computation only (no event loop, clock, socket or file).
PURE_IMPORTS = {
    "__future__",
    "array",
    "argparse",
    "bisect",
    "collections",
    "dataclasses",
    "difflib",
    "enum",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "typing",
    "xxhash",
}


def room(module: str) -> str | None:
    """A data-plane module's room (its first folder, or its own name at the top: cli)."""
    if not module.startswith(DATA_PLANE + "."):
        return None
    return module.removeprefix(DATA_PLANE + ".").split(".")[0]


def layer(name: str) -> int:
    return next(i for i, rooms in enumerate(DATA_PLANE_LAYERS) if name in rooms)


def test_every_data_plane_module_lives_in_a_room_of_a_layer() -> None:
    rooms = {room(m) for m in modules() if room(m)}
    known = set().union(*DATA_PLANE_LAYERS)
    assert rooms <= known, f"rooms without a layer: {sorted(rooms - known)}"


def test_data_plane_rooms_import_only_their_layer_and_below() -> None:
    upward, across = [], []
    for i in first_party():
        a, b = room(i.source), room(i.target)
        if a is None or b is None or a == b:
            continue
        if layer(b) > layer(a):
            upward.append(str(i))
        elif a in TRANSPORTS and b in TRANSPORTS:
            across.append(str(i))
    assert upward == [], "a room imports a layer above it:\n" + "\n".join(upward)
    assert across == [], "transports never import one another:\n" + "\n".join(across)


def test_the_decision_imports_nothing_with_io() -> None:
    found = [
        str(i)
        for i in all_imports()
        if room(i.source) == "decision"
        and not (room(i.target) == "decision" or i.target == "kvroute.block_keys" or i.target.split(".")[0] in PURE_IMPORTS)
    ]
    assert found == [], "the decision is pure (no await, no network, no clock):\n" + "\n".join(found)


def test_the_graph_sees_the_imports_it_judges() -> None:
    """The checks above pass trivially if nothing is found: pin a few known edges."""
    found = {(i.source, i.target) for i in first_party()}
    assert ("kvroute.data_plane.service.routing", "kvroute.data_plane.decision.policies") in found
    assert ("kvroute.tools.simulator.fleet", "kvroute.data_plane.decision.policies") in found
    assert ("kvroute.control_plane.auditor", "kvroute.control_plane.audit") in found
    assert ("kvroute.data_plane.cli", "kvroute.data_plane.service.routing_service") in found  # an import inside a function
    assert {"kvroute.cli", "kvroute.v1.kvroute_pb2", "kvroute.tools.sim_engine.tokenizer"} <= set(modules())
    assert ("kvroute.data_plane.http.proxy", "kvroute.data_plane.engines.backend_health") in found
    assert ("kvroute.data_plane.decision.decide", "kvroute.data_plane.decision.candidates") in found


# ---------------------------------------------------------------- what a process loads

_LOADED = """
import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
from kvroute.cli import main
sys.exit(main(sys.argv[2:]))
"""


def loaded_by(tmp_path: Path, *argv: str) -> tuple[int, set[str]]:
    """Run `kvroute ARGV` in a fresh interpreter: its exit code and every module it had loaded at exit."""
    dump = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", _LOADED, str(dump), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    return proc.returncode, set(json.loads(dump.read_text()))


def foreign(modules: set[str], plane: str | None) -> list[str]:
    """What a product process must not have loaded: tools, tools-only packages, another plane."""
    return sorted(
        m
        for m in modules
        if component(m).startswith(TOOLS)
        or m.split(".")[0] in ("matplotlib", "numpy")
        or (component(m) in PLANES and component(m) != plane)
    )


def test_kvroute_help_imports_no_subcommand(tmp_path: Path) -> None:
    code, modules = loaded_by(tmp_path, "--help")
    assert code == 0
    assert {m for m in modules if m.startswith("kvroute")} == {"kvroute", "kvroute.cli"}


def test_kvroute_router_help_loads_the_router_and_the_core_only(tmp_path: Path) -> None:
    code, modules = loaded_by(tmp_path, "router", "--help")
    assert code == 0 and "kvroute.data_plane.cli" in modules
    assert foreign(modules, "kvroute.data_plane") == []


def test_kvroute_epp_help_loads_the_data_plane_and_the_core_only(tmp_path: Path) -> None:
    code, modules = loaded_by(tmp_path, "epp", "--help")
    assert code == 0 and {"kvroute.data_plane.epp_cli", "kvroute.data_plane.epp.picker", "kvroute.data_plane.cli"} <= modules
    assert foreign(modules, "kvroute.data_plane") == []


@pytest.mark.e2e
def test_a_running_router_loads_no_tool_and_no_other_plane(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The router started and asked to route (no control plane: it fails open; no fleet: 503), then
    stopped with SIGTERM; what it had loaded by then."""
    dump, port = tmp_path / "modules.json", free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LOADED,
            str(dump),
            "router",
            "--tokenizer",
            str(tiny_model_dir),
            "--control-plane",
            f"127.0.0.1:{free_port()}",
            "--port",
            str(port),
            "--grpc-port",
            "0",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: http_ok(f"http://127.0.0.1:{port}/health"),
            30,
            "the router",
            [ManagedProcess("router", [], tmp_path / "none.log", proc)],
        )
        status, _ = http_post_json(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, stderr[-2000:]
    modules = set(json.loads(dump.read_text()))
    assert {"kvroute.data_plane.http.api", "kvroute.data_plane.prepare.tokenization", "grpc"} <= modules
    assert foreign(modules, "kvroute.data_plane") == []
