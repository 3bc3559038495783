"""``kvtiers new tier NAME`` (issue 11 item 9, issue 27): the generated distribution's
``make test`` passes right after generation (the conformance suite on core and bounded,
strict), also with an interpreter that has kvtiers but no pytest (it installs pytest), no
path of this machine is baked into it, it has a .gitignore, and its pyproject's entry point
registers the tier once installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

KVTIERS = [sys.executable, "-c", "import sys; from kvtiers.commands.cli import main; sys.exit(main())"]


def kvtiers(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTIERS, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_new_tier_make_test_passes_and_the_entry_point_registers_it(tmp_path: Path) -> None:
    p = kvtiers("new", "tier", "demo_tier", "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    root = tmp_path / "kvtiers-demo-tier"
    hint = p.stdout.split("next: ", 1)[1].strip()
    assert hint.startswith(f"cd {root} && make test"), p.stdout
    assert {str(x.relative_to(root)) for x in root.rglob("*") if x.is_file()} == {
        "pyproject.toml", "Makefile", "README.md", ".gitignore", "kvtiers_demo_tier/__init__.py",
        "tests/test_demo_tier.py"}
    tier_src = (root / "kvtiers_demo_tier" / "__init__.py").read_text()
    assert "class DemoTier(kvtiers.AsyncTier)" in tier_src and "self.evicted(victims)" in tier_src
    assert "def conformance_cleanup(cls, config: dict)" in tier_src
    assert "strict = True" in (root / "tests" / "test_demo_tier.py").read_text()
    makefile = (root / "Makefile").read_text()
    assert sys.executable not in makefile and "PYTHON ?= python3\n" in makefile  # nothing of this machine
    assert {".hypothesis/", "build/", "*.egg-info/"} <= set((root / ".gitignore").read_text().split())

    # make test, as the hint says (with PYTHON= this interpreter when python3 on PATH is
    # another one); no PYTHONPATH from the test run leaks in
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    m = subprocess.run(["bash", "-c", hint], capture_output=True, text=True, timeout=600,
                       env={**env, "PYTEST_ADDOPTS": "-rA"})  # -rA: a line per test and outcome
    assert m.returncode == 0, m.stdout[-3000:] + m.stderr[-2000:]
    assert " passed" in m.stdout and "failed" not in m.stdout, m.stdout[-2000:]
    for name in ("rule11_bounded_capacity", "rule11_one_job_over_the_bound", "rule04_corrupt_chunks_fail",
                 "rule04_async_failing_coroutines", "rule03_stateful"):
        assert f"PASSED tests/test_demo_tier.py::TestDemoTier::test_{name}" in m.stdout, (name, m.stdout[-3000:])

    # installed (offline, into a throwaway directory), its entry point offers the tier
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(root)], capture_output=True, text=True, timeout=180)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvtiers.registry import get_registry; "
            "info = get_registry().tier_info('demo_tier'); print(info.distribution, info.cls.__name__, "
            "sorted(info.levels))")
    r = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=env)
    assert r.stdout.split() == ["kvtiers-demo-tier", "DemoTier", "['bounded',", "'core']"], r.stdout + r.stderr


def _python_without_pytest(tmp: Path) -> Path:
    """A venv holding everything this interpreter's site-packages holds but pytest (as one
    made by the README's `pip install -e .`): its own pip, the rest linked in."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    shadow = tmp / "shadow"
    shadow.mkdir()
    left_out = ("pytest", "_pytest", "py.py", "pip", "setuptools", "_distutils_hack", "distutils-precedence")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(left_out) or entry.name == "__pycache__":
            continue
        if entry.suffix == ".pth":  # editable installs: their finders are found on the shadow path
            (site / entry.name).write_text(entry.read_text())
        else:
            (shadow / entry.name).symlink_to(entry)
    (site / "00-shadow.pth").write_text(f"{shadow}\n")  # before the editable .pth files
    return python


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_installs_pytest_where_it_is_missing(tmp_path: Path) -> None:
    """Issue 27: in an environment with kvtiers but no pytest, `make test` installs pytest
    (from PyPI) and runs the suite, instead of failing with 'No module named pytest'."""
    python = _python_without_pytest(tmp_path)
    probe = subprocess.run([str(python), "-c", "import kvtiers, kvtiers_conformance; import pytest"],
                           capture_output=True, text=True)
    assert "No module named 'pytest'" in probe.stderr, probe.stderr
    assert kvtiers("new", "tier", "bare_tier", "--dir", str(tmp_path)).returncode == 0
    root = tmp_path / "kvtiers-bare-tier"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    m = subprocess.run(["make", "test", f"PYTHON={python}"], cwd=root, capture_output=True, text=True, timeout=600,
                       env={**env, "PYTEST_ADDOPTS": "-k rule04 -rA"})  # one rule: the point is the set-up
    assert m.returncode == 0, m.stdout[-3000:] + m.stderr[-2000:]
    assert "PASSED tests/test_bare_tier.py::TestBareTier::test_rule04_corrupt_chunks_fail" in m.stdout, m.stdout[-2000:]
    none = subprocess.run(["make", "test", "PYTHON=/bin/false"], cwd=root, capture_output=True, text=True, timeout=60)
    assert none.returncode != 0 and "has no kvtiers" in none.stderr, none.stderr


def test_new_tier_refuses_bad_names_and_non_empty_targets(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvtiers.commands.cli import main

    for bad in ("Demo", "9lives", "a-b", "x__y", "tier_"):
        assert main(["new", "tier", bad, "--dir", str(tmp_path)]) != 0
        err = capsys.readouterr().err
        assert "tier name" in err and "Traceback" not in err, (bad, err)
    (tmp_path / "kvtiers-taken").mkdir()
    (tmp_path / "kvtiers-taken" / "keep.txt").write_text("mine")
    assert main(["new", "tier", "taken", "--dir", str(tmp_path)]) != 0
    assert "not an empty directory" in capsys.readouterr().err
    assert os.listdir(tmp_path / "kvtiers-taken") == ["keep.txt"]
