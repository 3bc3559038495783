"""``kvtiers demo``: runs end to end in a subprocess, serves chunks from the secondary tier,
verifies every byte (a lying tier makes it exit 1), and finds its chunks again on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tier_helpers import InlineMemoryTier

from kvtiers import Job, hookimpl
from kvtiers.commands.demo.chat import merge_config
from kvtiers.commands.demo.engine import chunk_keys

TESTS = Path(__file__).resolve().parent
SMALL = ["--turns", "3", "--conversations", "4", "--json"]
HOST_8 = {"host_bytes": 8 << 20}  # 8 one-MiB slots: the host overflows


class LyingTier(InlineMemoryTier):
    """Breaks rule 3: flips one byte of every loaded chunk and reports success."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self._data:
                self.ctx.arena[slot][4097] ^= 0x5A


def run_demo(*args: str, config: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "kvtiers.commands", "demo", *args]
    if config is not None:
        cmd += ["--config", json.dumps(config)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def test_demo_serves_chunks_from_the_secondary_tier(tmp_path) -> None:
    p = run_demo(*SMALL, "--dir", str(tmp_path / "kv"), config=HOST_8)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    tier = out["tiers"][0]
    assert out["hits"].get(tier, 0) > 0
    assert out["mismatches"] == 0 and out["verified_chunks"] == sum(out["hits"].values())
    assert out["loaded_tokens"] > 0 and out["computed_tokens"] > 0
    assert out["paths"][f"{tier}->host"]["bytes"] > 0 and out["paths"][f"host->{tier}"]["bytes"] > 0
    assert out["host_evictions"] > 0
    if tier == "fs":  # the fs tier persisted its chunks: a second run finds them at once
        assert any((tmp_path / "kv").rglob("config.json"))
        again = json.loads(run_demo(*SMALL, "--dir", str(tmp_path / "kv"), config=HOST_8).stdout)
        assert again["namespace"] == out["namespace"]
        assert again["hits"].get("fs", 0) > out["hits"].get("fs", 0)
        assert again["computed_tokens"] < out["computed_tokens"]


def test_demo_exits_nonzero_on_a_byte_mismatch() -> None:
    p = run_demo(*SMALL, config={**HOST_8, "tiers": [{"type": "test_demo:LyingTier"}]})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "BYTE MISMATCH" in p.stderr
    out = json.loads(p.stdout)
    assert out["mismatches"] > 0 and "from test_demo:LyingTier" in out["first_mismatch"]


def test_demo_table_and_temp_dir_cleanup(tmp_path) -> None:
    env_tmp = tmp_path / "tmp"
    env_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(env_tmp))
    p = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--turns", "2", "--conversations", "2"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr
    for heading in ("chunks loaded from", "device->host", "host->device", "prefill tokens:", "0 mismatched"):
        assert heading in p.stdout
    assert "serving" in p.stderr  # the progress bar goes to stderr
    assert list(env_tmp.iterdir()) == []  # the temporary tier directory is gone


def test_bad_config_is_a_one_line_error() -> None:
    p = run_demo("--turns", "1", config={"eviction_policy": "nope"})
    assert p.returncode == 2
    assert "kvtiers: error:" in p.stderr and "unknown eviction_policy 'nope'" in p.stderr


def test_chunk_keys_are_chained() -> None:
    tokens = list(range(300))
    keys = chunk_keys(tokens, 64, seed=0)
    assert len(keys) == 4 and len(set(keys)) == 4
    changed = chunk_keys([999] + tokens[1:], 64, seed=0)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # one early token changes every key
    assert chunk_keys(tokens[:128] + [7] * 172, 64, seed=0)[:2] == keys[:2]  # a shared prefix shares keys
    assert chunk_keys(tokens, 64, seed=1) != keys


def test_merge_config_replaces_aliases() -> None:
    base = {"host_bytes": 1, "tiers": [{"type": "fs"}], "blocks_per_chunk": 4}
    assert merge_config(base, {"cpu_bytes_to_use": 2}) == {"cpu_bytes_to_use": 2, "tiers": [{"type": "fs"}],
                                                           "blocks_per_chunk": 4}
    assert merge_config(base, {"secondary_tiers": []})["secondary_tiers"] == []
    assert "tiers" not in merge_config(base, {"secondary_tiers": []})
