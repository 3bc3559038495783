"""docs/engines.md: every "yes" names tests that exist, in files `make test` collects, and
each release row names at least one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "engines.md"


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name.startswith("test_")}


def test_every_yes_names_tests_that_exist() -> None:
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 6, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert any(c.startswith("yes") for c in cells[1:]), cells[0]
        for cell in cells[1:]:
            assert cell == "-" or cell.startswith("yes: "), (cells[0], cell)
            refs = re.findall(r"`(test_\w+\.py)::(test_\w+)`", cell)
            assert cell == "-" or refs, (cells[0], cell)  # a yes names its tests
            for file, name in refs:
                path = ROOT / "tests" / file
                assert path.exists(), f"{cells[0]}: {file} does not exist"
                assert name in _tests_in(path), f"{cells[0]}: {file} has no {name}"
