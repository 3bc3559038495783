"""docs/engines.md: every "yes" names tests that exist, in files `make test` collects, and
each release row names at least one; a test named for vLLM 0.34 is in a file
tests/test_vllm_releases.py runs on 0.34, one named for LMCache 0.5.7 runs on 0.5.7."""

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
                assert _runs_on(cells[0], file, name), f"{cells[0]}: {file}::{name} does not run on that release"


def _runs_on(release: str, file: str, name: str) -> bool:
    """Whether ``file::name`` runs on ``release`` (a row's first cell) in ``make test``."""
    from test_vllm_releases import FILES

    if release.startswith("vLLM 0.34"):  # run again on 0.34 by test_vllm_releases
        return f"tests/{file}" in FILES or file == "test_vllm_releases.py"
    if release.startswith("LMCache 0.5.7"):  # the adapter cases run per release; the engine test names it
        return file == "test_lmcache_adapter.py" or "0_5_7" in name
    return True
