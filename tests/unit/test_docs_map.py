"""docs/architecture.md is the table of contents of the code: every `file.py:name` it cites exists,
and every folder of the package has its row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "decentrl"
DOC = (ROOT / "docs" / "architecture.md").read_text()
CITATION = re.compile(r"`([\w/]+\.py):([\w.]+)")


def defined_names(path: Path) -> set[str]:
    """Top-level functions and classes, and `Class.method` for their methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def test_every_cited_function_exists() -> None:
    citations = CITATION.findall(DOC)
    assert len(citations) >= 30  # the trip of one sample is cited step by step
    missing = [
        f"{file}:{name}"
        for file, name in citations
        if not (PACKAGE / file).is_file() or name not in defined_names(PACKAGE / file)
    ]
    assert not missing, missing


def test_every_folder_has_a_row() -> None:
    folders = sorted(
        str(path.parent.relative_to(PACKAGE))
        for path in PACKAGE.rglob("__init__.py")
        if path.parent != PACKAGE and path.parent.parent.name != "algo"
    )
    rows = re.findall(r"^\| `([\w/]+)/`", DOC, flags=re.MULTILINE)
    assert set(folders) <= set(rows), sorted(set(folders) - set(rows))
