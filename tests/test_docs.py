"""Docs that run: every Python block of README.md and docs/ executes, every ``kvtiers``
command shown with its output prints that output, every JSON config is one the code accepts.
A page that drifts from the code fails here. The conventions are in :mod:`docs_blocks`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import DRIVER, Block, DocsError, blocks, check_json, commands, output_matches, python_source

from kvtiers.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BIN = str(Path(sys.executable).parent)

pytest_plugins = ["s3_fixture"]


def _collect() -> tuple[dict[str, list[Block]], list[str]]:
    found, errors = {}, []
    for p in PAGES:
        try:
            found[str(p.relative_to(ROOT))] = blocks(p, ROOT)
        except DocsError as e:
            errors.append(str(e))
    return found, errors


BLOCKS, ERRORS = _collect()
ALL = [b for bs in BLOCKS.values() for b in bs]
PY_PAGES = sorted({b.path for b in ALL if b.lang == "python"})
GPU = None  # whether torch finds an accelerator; asked once, at collection, only if a page needs one


def have_accelerator() -> bool:
    global GPU
    if GPU is None:
        try:
            import torch

            GPU = bool(getattr(torch, "accelerator", None) and torch.accelerator.is_available())
        except ImportError:
            GPU = False
    return GPU


def why_not_run(b: Block) -> str | None:
    """Why a python block does not run here (None: it runs)."""
    if b.skip:
        return b.skip
    if "gpu" in b.needs and not have_accelerator():
        return "needs a GPU (torch finds no accelerator here)"
    return None


NOT_RUN = [b for b in ALL if b.lang == "python" and why_not_run(b)]
COMMANDS = [c for b in ALL if b.lang == "console" and not b.skip for c in commands(b)]
JSON = [b for b in ALL if b.lang == "json" and not b.skip]


def venv_env(**extra: str) -> dict[str, str]:
    """This environment with the venv's bin first on PATH (so `kvtiers` is this checkout's)."""
    return {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""), **extra}


def run_page(blocks_: list[Block], cwd: Path, s3_endpoint: str | None = None) -> subprocess.CompletedProcess:
    """Run ``blocks_`` in one fresh interpreter, in order, in one namespace."""
    payload = [{"path": b.path, "line": b.line, "text": python_source(b, s3_endpoint)} for b in blocks_]
    return subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(payload), capture_output=True,
                          text=True, cwd=cwd, env=venv_env(), timeout=300)


def run_command(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=cwd, env=venv_env(COLUMNS="100"),
                          timeout=300)


def test_pages_follow_the_conventions() -> None:
    assert ERRORS == []
    assert {"README.md"} < set(BLOCKS), "no docs/ pages found"
    # the suite must see the blocks it is meant to run: a parser that finds none passes nothing
    assert "README.md" in PY_PAGES and len(PY_PAGES) >= 3, PY_PAGES


@pytest.mark.parametrize("page", PY_PAGES)
def test_python_blocks_run(page: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    todo = [b for b in BLOCKS[page] if b.lang == "python" and not why_not_run(b)]
    endpoint = None
    if any("s3" in b.needs for b in todo):
        endpoint = request.getfixturevalue("s3_server").endpoint_url
    r = run_page(todo, tmp_path, endpoint)
    assert r.returncode == 0, f"{page}: a python block failed:\n{r.stderr[-6000:]}"
    assert r.stdout.rstrip().endswith("docs: ran ok"), r.stdout[-2000:]


@pytest.mark.parametrize("block", NOT_RUN, ids=[b.where for b in NOT_RUN])
def test_blocks_not_run_say_why(block: Block) -> None:
    pytest.skip(f"{block.where}: {why_not_run(block)}")


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_console_output_is_real(cmd, tmp_path: Path) -> None:
    r = run_command(cmd.command, tmp_path)
    actual = (r.stdout + r.stderr).splitlines()
    shown = "\n".join(cmd.expected)
    assert output_matches(cmd.expected, actual), (
        f"{cmd.where}: `{cmd.command}` printed\n" + "\n".join(actual) + f"\n--- the page shows\n{shown}"
    )


@pytest.mark.parametrize("block", JSON, ids=[b.where for b in JSON])
def test_json_blocks_are_valid(block: Block) -> None:
    check_json(block)


def test_a_broken_example_fails(tmp_path: Path) -> None:
    """The harness is not a rubber stamp: each kind of drift is caught."""
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n```python\nimport kvtiers\nx = kvtiers.Lookup.HIT\n```\n\n"
        "<!-- docs: skip needs a GPU -->\n```python\nraise SystemExit(3)\n```\n\n"
        "```python\nassert x is kvtiers.Lookup.HIT\nkvtiers.no_such_name\n```\n\n"
        "```console\n$ kvtiers --help   # all commands\nUsage: kvtiers [OPTIONS] COMMAND [ARGS]...\n...\n"
        "$ kvtiers tiers\nmemory kvtiers 9.9.9 ...\n```\n\n"
        '```json\n{"tiers": [{"type": "memory", "max_byte": 1}]}\n```\n'
    )
    bs = blocks(page, tmp_path)
    assert [b.lang for b in bs] == ["python", "python", "python", "console", "json"]
    assert bs[1].skip == "needs a GPU" and bs[0].line == 4

    r = run_page([b for b in bs if b.lang == "python" and not b.skip], tmp_path)
    assert r.returncode != 0
    assert 'File "page.md", line 15' in r.stderr and "no_such_name" in r.stderr, r.stderr

    help_cmd, tiers_cmd = commands(bs[3])
    assert help_cmd.command == "kvtiers --help"
    out = run_command(help_cmd.command, tmp_path).stdout.splitlines()
    assert output_matches(help_cmd.expected, out)
    assert not output_matches(tiers_cmd.expected, run_command(tiers_cmd.command, tmp_path).stdout.splitlines())

    with pytest.raises(ConfigError, match="unknown option .max_byte."):
        check_json(bs[4])


def test_directives_are_checked(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    for text, msg in [
        ("<!-- docs: skip -->\n```python\npass\n```\n", "needs a reason"),
        ("<!-- docs: needs tpu -->\n```python\npass\n```\n", "needs"),
        ("<!-- docs: skp x -->\n```python\npass\n```\n", "unknown docs directive"),
        ("<!-- docs: skip x -->\ntext\n```python\npass\n```\n", "just before a fence"),
        ("```py\npass\n```\n", "unknown fence language"),
        ("```python\npass\n", "never closed"),
    ]:
        page.write_text(text)
        with pytest.raises(DocsError, match=msg):
            blocks(page, tmp_path)


def test_output_matching() -> None:
    assert output_matches(["a  b", "...", "z"], ["a\tb", "x", "y", "z", ""])
    assert output_matches(["took ... s"], ["took 1.5 s"])
    assert not output_matches(["took ... s"], ["took 1.5 ms"])
    assert not output_matches(["a", "b"], ["a"])
    assert not output_matches(["a"], ["a", "b"])
    # "..." attached to a word is literal: click's cut of a help line must be the same cut
    assert output_matches(["  events  KV events: watch a..."], ["  events    KV events: watch a..."])
    assert not output_matches(["  events  KV events: watch a..."], ["  events  KV events: tail a..."])
    assert not output_matches(["  events  Watch a..."], ["  events  Watch a stream of KV events."])
    assert output_matches(["Usage: kvtiers [OPTIONS] ..."], ["Usage: kvtiers [OPTIONS] COMMAND [ARGS]..."])
    assert output_matches(["op  chunk ...atio"], ["op  chunk  size  ratio"])
