"""References from code to the docs stay valid.

Code comments cite a documented fact as a repository path to a markdown file plus a heading anchor
(the wire formats, for instance, are cited section by section). This test parses every cited
file's headings into the anchors GitHub generates and fails on a citation whose file or anchor does
not exist, and on a section-sign reference to the wire-format spec that is not in the repository.
Markdown links with an anchor in README.md and docs/ are checked the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SECTION_SIGN = "\u00a7"
THIS_FILE = Path(__file__).resolve()  # its examples of broken references are not references

# A citation in code: a repository-relative path to a markdown file, '#', an anchor.
CODE_CITATION = re.compile(r"\b((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
# A markdown link with an anchor: [text](path.md#anchor) or [text](#anchor).
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (letters, digits, '_', '-'
    and spaces kept), each space a hyphen."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown_anchors(text: str) -> set[str]:
    """Every anchor a markdown document defines: its headings (outside code fences), with GitHub's
    -1, -2 ... suffixes for repeated headings, and explicit <a id/name> anchors."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        anchors.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = github_anchor(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def python_files(root: Path) -> list[Path]:
    """The repository's Python files: no hidden folders (.git, .venv), no virtualenvs, no build output."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and not (Path(folder) / d / "pyvenv.cfg").exists()
        ]
        out.extend(Path(folder) / f for f in files if f.endswith(".py"))
    return sorted(out)


def markdown_files(root: Path) -> list[Path]:
    docs = root / "docs"
    return [p for p in [root / "README.md", *sorted(docs.rglob("*.md"))] if p.is_file()]


def broken_references(root: Path, skip: frozenset[Path] = frozenset()) -> list[str]:
    """'file:line: why' for every citation whose document or anchor is missing, and every
    section-sign reference left in Python code (files in `skip` are not read)."""
    cache: dict[Path, set[str] | None] = {}

    def anchors_of(doc: Path) -> set[str] | None:
        if doc not in cache:
            cache[doc] = markdown_anchors(doc.read_text(encoding="utf-8")) if doc.is_file() else None
        return cache[doc]

    def check(source: Path, lineno: int, doc: Path, anchor: str, shown: str) -> str | None:
        anchors = anchors_of(doc)
        where = f"{source.relative_to(root)}:{lineno}"
        if anchors is None:
            return f"{where}: {shown} cites {doc.relative_to(root) if doc.is_relative_to(root) else doc}, which does not exist"
        if anchor not in anchors:
            return f"{where}: {shown}: no heading with anchor #{anchor}"
        return None

    problems = []
    for path in python_files(root):
        if path.resolve() in skip:
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SECTION_SIGN in line:
                problems.append(
                    f"{path.relative_to(root)}:{lineno}: a {SECTION_SIGN} reference: cite "
                    f"the docs section instead: {line.strip()[:100]}"
                )
            for rel, anchor in CODE_CITATION.findall(line):
                problem = check(path, lineno, root / rel, anchor, f"{rel}#{anchor}")
                if problem:
                    problems.append(problem)
    for path in markdown_files(root):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for target, anchor in MARKDOWN_LINK.findall(line):
                if "://" in target or (target and not target.endswith(".md")):
                    continue
                doc = (path.parent / target).resolve() if target else path
                problem = check(path, lineno, doc, anchor, f"({target}#{anchor})")
                if problem:
                    problems.append(problem)
    return problems


def test_every_docs_reference_resolves() -> None:
    problems = broken_references(ROOT, skip=frozenset({THIS_FILE}))
    assert not problems, "broken references to the docs:\n" + "\n".join(problems)


def test_the_wire_formats_doc_is_cited_from_the_code() -> None:
    # The check above passes vacuously if nothing cites the docs; the decoders must.
    cited = {
        anchor
        for path in python_files(ROOT)
        for rel, anchor in CODE_CITATION.findall(path.read_text(encoding="utf-8"))
        if rel == "docs/wire-formats.md"
    }
    assert {"vllm-event-fields", "sglang-events-per-version", "replay-reply-framings", "tensorrt-llm-pull-path-json"} <= cited


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("vLLM event fields", "vllm-event-fields"),
        ("vLLM extra keys, LoRA and cache salt", "vllm-extra-keys-lora-and-cache-salt"),
        ("TensorRT-LLM pull-path JSON", "tensorrt-llm-pull-path-json"),
        ("The `extra_keys` field (0.17+)", "the-extra_keys-field-017"),
        ("Ünïcode stays", "ünïcode-stays"),
    ],
)
def test_github_anchor(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def test_repeated_headings_and_code_fences() -> None:
    text = '# Top\n## Replay\n```\n# not a heading\n```\n## Replay\n<a id="custom"></a>\n'
    assert markdown_anchors(text) == {"top", "replay", "replay-1", "custom"}


def test_broken_citations_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n## Real section\n[ok](#real-section) [bad](#gone)\n")
    (tmp_path / "README.md").write_text("[ok](docs/guide.md#guide) [bad](docs/guide.md#missing)\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "# fine: docs/guide.md#real-section\n# stale: docs/guide.md#old-section\n"
        f"# elsewhere: docs/absent.md#x\nX = 1  # wire spec {SECTION_SIGN}2.3\n"
    )
    venv = tmp_path / ".venv" / "lib"
    venv.mkdir(parents=True)
    (venv / "ignored.py").write_text(f"# {SECTION_SIGN}1 docs/guide.md#nowhere\n")
    problems = broken_references(tmp_path)
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    assert "pkg/mod.py:2: docs/guide.md#old-section: no heading" in text
    assert "pkg/mod.py:3: docs/absent.md#x cites docs/absent.md, which does not exist" in text
    assert f"pkg/mod.py:4: a {SECTION_SIGN} reference" in text
    assert "README.md:1: (docs/guide.md#missing)" in text
    assert "docs/guide.md:3: (#gone)" in text
