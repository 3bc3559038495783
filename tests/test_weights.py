"""Model weights through the tiers (kvtiers.engine.weights) on a real small Llama-shaped model
made locally (random safetensors weights, loaded with transformers on CPU): sleep and wake give
the same logits and byte-exact tensors in the same tensor objects; a level-2 sleep gives the
memory back (RSS measured); a new process forks the model from the fs tier and from a p2p peer
and computes the same logits; mismatches name the tensor; a tier that loses chunks leaves the
model awake."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtiers.commands.tinymodel import make_tiny_model  # noqa: E402
from kvtiers.engine.weights import ModelWeights, WeightsIdentity, rss_bytes  # noqa: E402

CHUNK = 1 << 20
PROMPT = "the system is the user of the assistant, and you"


@pytest.fixture(scope="module")
def model_dir():
    # about 27 MB of bfloat16 weights: big enough for RSS to move visibly, small for a busy box
    return make_tiny_model(hidden_size=512, num_layers=4, intermediate_size=1408)


def load(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)


def prompt_ids(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return torch.tensor([tok(PROMPT)["input_ids"]])


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.clone()


def snapshot(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def same_tensors(model, ref):
    sd = model.state_dict()
    return sorted(n for n, t in ref.items() if not torch.equal(sd[n].view(torch.uint8), t.view(torch.uint8)))


def fs_config(root, **extra):
    return {"host_blocks_factor": 1.0, **extra, "tiers": [{"type": "fs", "root_dir": str(root)}]}


def test_sleep_wake_level1_same_logits_same_tensor_objects(model_dir):
    model, ids = load(model_dir), prompt_ids(model_dir)
    before, ref = logits(model, ids), snapshot(model)
    params = {n: p for n, p in model.named_parameters()}
    with ModelWeights(model, {"host_blocks_factor": 1.0}, name="tiny", revision="r1", chunk_bytes=CHUNK) as w:
        step = w.sleep(1)
        assert w.asleep == 1 and step.nbytes == w.plan.total_bytes > 20 << 20
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # the memory is freed
        woke = w.wake()
        assert woke.sources == {"host": w.plan.num_chunks}
    assert {n: p for n, p in model.named_parameters()} == params  # the same objects
    assert all(a is b for a, b in zip(model.parameters(), params.values(), strict=True))
    assert same_tensors(model, ref) == []
    assert torch.equal(logits(model, ids), before)


def test_sleep_level2_through_a_small_arena_frees_memory_and_wakes_from_fs(model_dir, tmp_path):
    model, ids = load(model_dir), prompt_ids(model_dir)
    before, ref = logits(model, ids), snapshot(model)  # the forward pass faults every weight in
    # an elastic arena of 3 chunks: the model streams through it, and its pages go back after
    cfg = {"host_bytes": 3 * CHUNK, "elastic": True, "elastic_reserve_bytes": 0,
           "tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}
    with ModelWeights(model, cfg, name="tiny", chunk_bytes=CHUNK) as w:
        assert len(w.host.arena) == 3 < w.plan.num_chunks
        with pytest.raises(ValueError, match="sleep\\(1\\) needs a host arena of"):
            w.sleep(1)
        step = w.sleep(2)
        freed = step.rss_before - step.rss_after
        assert freed > 0.6 * w.plan.total_bytes, (step.rss_before, step.rss_after, w.plan.total_bytes)
        assert w.host.resident_bytes() == 0
        assert w.identity.revision is None and len(w.identity.digest) == 32  # the bytes name themselves
        woke = w.wake()
        assert woke.sources == {"fs": w.plan.num_chunks}
        assert rss_bytes() > step.rss_after + 0.6 * w.plan.total_bytes
    assert same_tensors(model, ref) == []
    assert torch.equal(logits(model, ids), before)


def test_sleep_wake_again_after_weights_change_stores_the_new_bytes(model_dir, tmp_path):
    model, ids = load(model_dir), prompt_ids(model_dir)
    with ModelWeights(model, {"host_blocks_factor": 1.0}, name="tiny", revision="r1", chunk_bytes=CHUNK) as w:
        w.sleep(1)
        w.wake()
        with torch.no_grad():
            model.lm_head.weight.mul_(2)  # the engine updated its weights in place (an RL step)
        ref, changed = snapshot(model), logits(model, ids)
        w.sleep(1)
        w.wake()
    assert same_tensors(model, ref) == []
    assert torch.equal(logits(model, ids), changed)


def test_mapping_with_tied_views_stays_tied():
    base = torch.arange(3 * 4096, dtype=torch.float32)
    tensors = {"a": base, "b": base[4096:].view(2, 4096), "c": torch.ones(7, dtype=torch.int64),
               "empty": torch.empty(0)}
    with ModelWeights(tensors, {"host_blocks_factor": 2.0}, name="m", revision="1", chunk_bytes=8192) as w:
        assert len(w.plan.storages) == 2 and w.plan.total_bytes == 3 * 4096 * 4 + 56
        w.sleep(1)
        w.wake()
    assert torch.equal(tensors["a"], torch.arange(3 * 4096, dtype=torch.float32))
    assert tensors["b"].untyped_storage().data_ptr() == tensors["a"].untyped_storage().data_ptr()
    tensors["a"][4096] = -1
    assert tensors["b"][0, 0] == -1 and tensors["c"].sum() == 7


def test_bad_input_is_named(model_dir, tmp_path):
    cfg = {"host_blocks_factor": 1.0}
    with pytest.raises(TypeError, match="expected an nn.Module or a mapping"):
        ModelWeights([torch.ones(2)], cfg, name="x")
    with pytest.raises(TypeError, match="'w' is a list, not a tensor"):
        ModelWeights({"w": [1, 2]}, cfg, name="x")
    with pytest.raises(ValueError, match="tensor 'w' is on the meta device"):
        ModelWeights({"w": torch.empty(4, device="meta")}, cfg, name="x")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096"):
        ModelWeights({"w": torch.ones(4)}, cfg, name="x", chunk_bytes=1000)
    with ModelWeights({"w": torch.ones(4)}, cfg, name="x", revision="1") as w:
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            w.sleep(3)
        with pytest.raises(ValueError, match="sleep\\(2\\) needs a tier"):
            w.sleep(2)
        with pytest.raises(RuntimeError, match="the model is awake"):
            w.wake()
        w.sleep(1)
        with pytest.raises(RuntimeError, match="already sleeps"):
            w.sleep(1)
        w.wake()
    with pytest.raises(ValueError, match="unknown key 'rev'"):
        WeightsIdentity.from_dict({"name": "x", "rev": "1"})


# -- fork in a new process -------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, sys, torch, transformers
    from kvtiers.engine.weights import ModelWeights
    cfg_dir, forks, ids, out = sys.argv[1:5]
    mc = transformers.AutoConfig.from_pretrained(cfg_dir)  # config.json only: no checkpoint here
    results = []
    for config, identity in json.loads(forks):  # one new model per fork
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16)
        model.to_empty(device="cpu")
        with ModelWeights.fork(model, config, identity) as w:
            step = w.last_step
        with torch.no_grad():
            results.append({"logits": model(torch.tensor(json.loads(ids))).logits, "sources": step.sources})
    torch.save(results, out)
""")


def fork_in_child(tmp_path, model_dir, forks, ids):
    """Fork the model in one new process once per ``(config, identity)``; what each computed."""
    cfg_dir = tmp_path / "config-only"
    cfg_dir.mkdir(exist_ok=True)
    shutil.copy(model_dir / "config.json", cfg_dir / "config.json")
    out = tmp_path / "child.pt"
    todo = json.dumps([(cfg, ident.to_dict()) for cfg, ident in forks])
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cfg_dir), todo, json.dumps(ids.tolist()), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_fork_in_a_new_process_through_the_fs_tier_and_a_p2p_peer(model_dir, tmp_path):
    pytest.importorskip("zmq")
    from kvtiers_p2p.spawn import start_server

    model, ids = load(model_dir), prompt_ids(model_dir)
    before = logits(model, ids)
    fs_cfg = fs_config(tmp_path / "fs")
    with ModelWeights(model, fs_cfg, name="tiny", chunk_bytes=CHUNK) as w:
        fs_ident = w.publish()  # revision: the digest of the bytes
        n = w.plan.num_chunks
    srv = start_server(capacity=128 << 20)
    try:
        p2p_cfg = {"host_blocks_factor": 1.0, "tiers": [{"type": "p2p", "host": "127.0.0.1", "port": srv.port}]}
        with ModelWeights(model, p2p_cfg, name="tiny", revision="p2p-1", chunk_bytes=CHUNK) as w:
            w.sleep(2)  # published to the peer, and this model's memory freed
            p2p_ident = w.identity
            via_fs, via_p2p = fork_in_child(tmp_path, model_dir, [(fs_cfg, fs_ident), (p2p_cfg, p2p_ident)], ids)
            assert w.wake().sources == {"p2p": n}
        assert torch.equal(logits(model, ids), before)
    finally:
        srv.stop()
    assert via_fs["sources"] == {"fs": n} and via_p2p["sources"] == {"p2p": n}
    assert torch.equal(via_fs["logits"], before)
    assert torch.equal(via_p2p["logits"], before)


def test_fork_mismatches_name_the_tensor(model_dir, tmp_path):
    model = load(model_dir)
    cfg = fs_config(tmp_path / "fs")
    with ModelWeights(model, cfg, name="tiny", revision="r1", chunk_bytes=CHUNK) as w:
        ident = w.publish()
    mc = transformers.AutoConfig.from_pretrained(model_dir)

    def empty(**changes):
        c = mc.__class__.from_dict({**mc.to_dict(), **changes})
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
        return m.to_empty(device="cpu")

    with pytest.raises(ValueError, match="tensor 'model.layers.0.mlp.gate_proj.weight' has shape"):
        ModelWeights.fork(empty(intermediate_size=1024), cfg, ident)
    with pytest.raises(ValueError, match="tensor 'model.layers.4.self_attn.q_proj.weight' is not in the weights"):
        ModelWeights.fork(empty(num_hidden_layers=5), cfg, ident)
    m32 = empty().float()
    with pytest.raises(ValueError, match="tensor 'model.embed_tokens.weight' has dtype float32"):
        ModelWeights.fork(m32, cfg, ident)
    other = WeightsIdentity(ident.name, "r2", chunk_bytes=ident.chunk_bytes)
    with pytest.raises(LookupError, match="no tier holds the weights of model 'tiny' revision 'r2'"):
        ModelWeights.fork(empty(), cfg, other)
    good = empty()
    with ModelWeights.fork(good, cfg, ident) as w:
        assert w.last_step.sources == {"fs": w.plan.num_chunks}
    assert same_tensors(good, snapshot(model)) == []


def test_a_tier_that_loses_chunks_leaves_the_model_awake(tmp_path):
    tensors = {"w": torch.arange(64 * 1024, dtype=torch.float32)}
    cfg = {"host_blocks_factor": 1.0, "tiers": [{"type": "broken_tiers:DropEveryThirdTier"}]}
    with ModelWeights(tensors, cfg, name="lossy", revision="1", chunk_bytes=16384) as w:
        with pytest.raises(RuntimeError, match="were stored by no tier .* the model stays awake"):
            w.sleep(2)
        assert w.asleep == 0
    assert torch.equal(tensors["w"], torch.arange(64 * 1024, dtype=torch.float32))
