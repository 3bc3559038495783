"""``kvtiers new tier NAME`` (issue 11 item 9): the generated distribution's ``make test``
passes right after generation (the conformance suite on core and bounded), and its
pyproject's entry point registers the tier once installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    assert f"next: cd {root} && make test" in p.stdout
    assert {str(x.relative_to(root)) for x in root.rglob("*") if x.is_file()} == {
        "pyproject.toml", "Makefile", "README.md", "kvtiers_demo_tier/__init__.py", "tests/test_demo_tier.py"}
    tier_src = (root / "kvtiers_demo_tier" / "__init__.py").read_text()
    assert "class DemoTier(kvtiers.AsyncTier)" in tier_src and "self.evicted(victims)" in tier_src

    # make test, as a vendor runs it: the Makefile's default interpreter is the one that ran
    # `kvtiers new` (this one); no PYTHONPATH from the test run leaks in
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    m = subprocess.run(["make", "test"], cwd=root, capture_output=True, text=True, timeout=300,
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
