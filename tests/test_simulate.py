"""``kvtiers simulate``: the three regimes (ordering of policies, not exact numbers) at a small
scale, through the real data path (TieringManager, host arena, fs tier, obj tier on the
fixture's SeaweedFS, p2p tier on a peer it starts), and the model's pieces."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from s3_fixture import options_for

from kvtiers.commands.simulate.model import Accelerator, Tally, break_even_gbps, modelled_seconds
from kvtiers.commands.simulate.run import GpuCache, chunk_keys

pytest_plugins = ["s3_fixture"]

# 4096 tokens of context + 3 turns of 768 -> 7 chunks of 1024 tokens per conversation:
# the GPU holds 4 conversations, the host 8.
SMALL = ["--context-tokens", "4096", "--turns", "4", "--gpu-chunks", "28", "--host-chunks", "56",
         "--concurrency", "2,4,6,8,12,16",
         # a decode batch of 4 would make reading the weights each step dominate; at full scale the
         # batch is 64 and this is the amortised cost per token
         "--decode-step-us", "0", "--decode-us", "400"]


def test_three_regimes_through_the_real_data_path(s3_server, tmp_path):
    png = tmp_path / "sim.png"
    obj = json.dumps(options_for(s3_server))
    cmd = [sys.executable, "-m", "kvtiers.commands", "simulate", *SMALL, "--gbps", "obj=3/3", "--gbps", "fs=3/3",
           "--tier-config", f"obj={obj}", "--policy", "recompute", "--policy", "host", "--policy", "host+fs",
           "--policy", "host+obj", "--policy", "host+p2p", "--gbps", "p2p=3/3", "--json", "--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # --json: no progress
    rep = json.loads(r.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep["model"]["gpu_conversations"] == 4 and rep["model"]["host_conversations"] == 8
    assert rep["links"]["obj"]["source"] == rep["links"]["fs"]["source"] == "given"  # (measured: next test)
    tput = {(x["policy"], x["concurrency"]): x for x in rep["results"]}
    assert rep["skipped"] == {}  # p2p: a peer started through its conformance_config
    assert len(tput) == 5 * 6
    assert all(x["mismatches"] == 0 for x in rep["results"])  # every loaded chunk held its bytes

    def t(p: str, n: int) -> float:
        return tput[(p, n)]["tokens_per_s"]

    offload = ("host", "host+fs", "host+obj", "host+p2p")
    for n in (2, 4):  # the GPU holds the working set: every policy alike
        for p in offload:
            assert t(p, n) == pytest.approx(t("recompute", n), rel=0.05), (p, n)
        assert tput[("host", n)]["prefill_saved"] == 0
    for n in (6, 8):  # GPU full: recompute collapses, host memory holds
        for p in offload:
            assert t(p, n) > 1.4 * t("recompute", n), (p, n)
        assert t("host+fs", n) == pytest.approx(t("host", n), rel=0.05)
        assert tput[("host", n)]["loaded_tokens"].get("host", 0) > 0
    for n in (12, 16):  # host full too: only storage holds, above 2x recompute here (3 GB/s vs 2.62 break-even)
        assert t("host", n) < 1.3 * t("recompute", n)
        for p in ("host+fs", "host+obj", "host+p2p"):
            assert t(p, n) > 1.8 * t("recompute", n), (p, n)
            assert t(p, n) > 1.5 * t("host", n), (p, n)
        assert tput[("host+fs", n)]["chunks_loaded"]["fs"] > 0
        assert tput[("host+obj", n)]["chunks_loaded"]["obj"] > 0
        assert tput[("host+p2p", n)]["chunks_loaded"]["p2p"] > 0
    assert t("recompute", 16) < 0.6 * t("recompute", 2)


def test_table_and_progress_lines(tmp_path):
    cmd = [sys.executable, "-m", "kvtiers.commands", "simulate", "--context-tokens", "2048", "--turns", "2",
           "--gpu-chunks", "8", "--host-chunks", "16", "--concurrency", "2,8", "--policy", "recompute",
           "--policy", "host+fs", "--measured"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Llama-3.1-8B" in r.stdout and "x recompute" in r.stdout
    assert "decode 6000 us/step + 300 us/sequence" in r.stdout
    assert re.search(r"fs: load [\d.]+ GB/s, store [\d.]+ GB/s \(measured here", r.stdout)  # the tier bench
    lines = r.stderr.splitlines()
    assert lines[0] == "simulate: measuring the fs tier on this machine"
    assert lines[1].startswith("simulate 1/4: 2 conversations, recompute:") and lines[-1].startswith("simulate 4/4")
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "simulate", "--gbps", "fs=fast"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "TIER=LOAD[/STORE]" in r.stderr


def test_model_pieces():
    acc = Accelerator()
    assert acc.kv_bytes_per_token == 32 * 8 * 128 * 2  # Llama-3.1-8B, FP8 KV
    assert break_even_gbps(acc) == pytest.approx(2 * 65536 / 50e-6 / 1e9)
    t = Tally(computed_tokens=1000, output_tokens=10, loaded_tokens={"host": 2048}, chunks_loaded={"fs": 2},
              chunks_stored={"host": 1, "fs": 1})
    from kvtiers.commands.simulate.model import Link

    s = modelled_seconds(t, acc, 1 << 26, {"fs": Link(2.0, 1.0, "given")})
    assert s["gpu"] == pytest.approx((1000 * 50 + 10 * (300 + 6000)) / 1e6)  # a decode batch of 1
    t.decode_batch = 64
    s = modelled_seconds(t, acc, 1 << 26, {"fs": Link(2.0, 1.0, "given")})
    assert s["gpu"] == pytest.approx((1000 * 50 + 10 * (300 + 6000 / 64)) / 1e6)
    assert s["fs"] == pytest.approx(2 * (1 << 26) / 2e9) and s["fs_store"] == pytest.approx((1 << 26) / 1e9)
    gpu = GpuCache(3)
    keys = chunk_keys(list(range(4096)), 1024, b"s")
    assert len(keys) == 4 and len(set(keys)) == 4
    assert chunk_keys(list(range(4096)), 1024, b"s", keys[:2]) == keys  # extends a known prefix
    gpu.use(keys)
    assert gpu.prefix(keys) == 0  # the first key was evicted (LRU, room for 3)
    gpu.use(keys[:1])
    assert gpu.prefix(keys) == 1


def test_fs_is_modelled_on_the_named_drive_times_its_measured_efficiency(tmp_path):
    """By default the fs tier's link is the drive's datasheet speed scaled by the fs tier's
    efficiency against raw I/O measured here: never faster than the drive, never zero."""
    from kvtiers.commands.simulate.run import DRIVES, drive_link

    drive, read, write = DRIVES["fs"]
    link = drive_link("fs", {"root_dir": str(tmp_path / "fs")}, chunks=4, rounds=2)
    assert 0 < link.load_gbps <= read and 0 < link.store_gbps <= write
    assert drive in link.source and "efficiency measured here" in link.source
    with pytest.raises(ValueError, match="no raw baseline"):
        drive_link("memory", {}, drive=("any drive", 1.0, 1.0), chunks=2, rounds=1)
