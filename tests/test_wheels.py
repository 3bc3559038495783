"""Wheels: kvtiers and the example tier build with ``python -m build``, pass ``twine check``,
ship only their own top-level packages, and work installed from the wheels alone (no source
tree, no editable install): a tier author can depend on kvtiers from a wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

pytest.importorskip("build", reason="needs the build package: pip install -e '.[test]'")


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=600, env=env)
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    for src in (ROOT, ROOT / "examples" / "kvtiers-sqlite"):
        run(sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(src))
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"kvtiers", "kvtiers_sqlite"}, sorted(out.iterdir())
    return found


def test_twine_check_passes(wheels) -> None:
    r = run(sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels.values()))
    assert r.stdout.count("PASSED") == 2, r.stdout


def test_wheel_holds_only_its_own_packages(wheels) -> None:
    names = zipfile.ZipFile(wheels["kvtiers"]).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # generic names such as `plugins`, `conformance` or `tests` must never land in site-packages
    assert top == {"kvtiers", "kvtiers_fs", "kvtiers_obj", "kvtiers_p2p", "kvtiers_mooncake", "kvtiers_nixl",
                   "kvtiers_conformance"}, top
    assert "kvtiers/engine/manager.py" in names and "kvtiers/hookspecs.py" in names
    entry_points = zipfile.ZipFile(wheels["kvtiers"]).read("kvtiers-0.1.0.dist-info/entry_points.txt").decode()
    for line in ("memory = kvtiers.memory", "fs = kvtiers_fs", "obj = kvtiers_obj", "p2p = kvtiers_p2p",
                 "kvtiers = kvtiers.commands.cli:main"):
        assert line in entry_points, entry_points


def test_installed_from_wheels_alone(wheels, tmp_path: Path) -> None:
    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--target", str(target), *map(str, wheels.values()))
    # -S: no site-packages (so not the editable install); -I: no cwd, no PYTHON* variables
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import kvtiers, kvtiers_sqlite; "
        "assert kvtiers.__file__.startswith(sys.path[0]), kvtiers.__file__; "
        "from kvtiers.commands.cli import main; raise SystemExit(main(['tiers']))"
    )
    r = run(sys.executable, "-I", "-S", "-c", code, cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
    tiers = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines()}
    assert tiers == {"fs": "kvtiers", "memory": "kvtiers", "mooncake": "kvtiers", "obj": "kvtiers", "p2p": "kvtiers",
                     "sqlite": "kvtiers-sqlite"}, r.stdout
