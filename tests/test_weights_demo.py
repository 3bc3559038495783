"""``kvtiers demo --scenario weights``: the real command on the project's tiny Llama (188 MiB of
bfloat16 weights) through the host arena and the fs tier: every step's figures, the baselines
measured in the same run, and 0 mismatched tensors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(1200)


def test_demo_weights_prints_every_step_against_its_baseline_with_0_mismatched(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--scenario", "weights", "--json",
                           "--dir", str(tmp_path / "fs")], capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["mismatched"] == 0 and res["logits_same"]
    assert res["checked"] % 7 == 0 and res["checked"] >= 7 * res["storages"] > 0  # 4 wakes and 3 forks
    assert res["total_bytes"] > 150 << 20 and res["tier"].startswith("fs")
    steps = {s["step"]: s for s in res["steps"]}
    assert list(steps) == ["sleep level 1 (host arena)", "wake from the host arena", "sleep level 2 (to fs)",
                           "wake from fs", "fork from fs (new model)"]
    for s in steps.values():
        assert s["nbytes"] == res["total_bytes"] and s["seconds"] > 0 and s["gbps"] > 0
    assert steps["wake from the host arena"]["baseline"] == "np.copyto"
    assert steps["fork from fs (new model)"]["baseline"] == "safetensors load"
    assert all(steps[k]["ratio"] > 0 for k in ("wake from the host arena", "fork from fs (new model)"))
    lvl2 = steps["sleep level 2 (to fs)"]  # the model's memory goes back (an elastic arena)
    assert lvl2["rss_before"] - lvl2["rss_after"] > 0.6 * res["total_bytes"]
