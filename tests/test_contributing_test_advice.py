"""docs/contributing.md's advice on running the tests works as written: each `-m` expression it gives keeps the
real-vLLM tests out (a `-m` replaces pyproject's `-m 'not vllm'`), `make test` passes pytest
arguments on, and the run time is stated."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO


def running_the_tests_section() -> str:
    text = (REPO / "docs" / "contributing.md").read_text()
    section = text[text.index("\n## Running the tests\n") :]
    return section[: section.index("\n## ", 1)]


def test_every_marker_expression_the_doc_gives_leaves_the_real_vllm_tests_out() -> None:
    expressions = re.findall(r"`-m '([^']+)'", running_the_tests_section())
    assert {"not slow and not vllm", "not e2e and not vllm"} <= set(expressions), expressions
    for expression in expressions:
        collected = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", expression, "tests/vllm"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert "tests/vllm/" not in collected.stdout, (expression, collected.stdout)


def test_make_test_passes_pytest_arguments_on_and_the_doc_says_how_long_it_takes() -> None:
    section = running_the_tests_section()
    assert "~11 min on a 2-core machine" in section
    example = re.search(r"`make test PYTEST_ARGS='([^']+)'`", section)
    assert example, "the doc shows how to pass pytest arguments to make test"
    dry_run = subprocess.run(
        ["make", "-n", "test", f"PYTEST_ARGS={example.group(1)}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert dry_run.returncode == 0, dry_run.stderr
    assert re.search(rf"bin/pytest {re.escape(example.group(1))}$", dry_run.stdout, re.MULTILINE), dry_run.stdout
