"""``kvtiers demo --engine vllm``: the table and the report from engine results, and the
command where vLLM cannot run. The engines themselves run in tests/test_vllm_engine_*.py
(the same runner, kvtiers.commands.vllm_engine) and in ``make demo-vllm``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtiers.commands.demo.vllm import render, report
from kvtiers.commands.vllm_engine import offload_config, prompt_family

ROW = 256 << 10


def run_of(prefill: list[float], tokens: list[list[int]], cached: list[int], **metrics: float) -> dict:
    reqs = [{"prompt_tokens": 1088 + i, "ttft_s": p + 0.01, "prefill_s": p, "tokens": t, "cached_tokens": c}
            for i, (p, t, c) in enumerate(zip(prefill, tokens, cached, strict=True))]
    return {"measured": reqs, "metrics": metrics, "engine_start_s": 30.0}


def test_report_gives_ratio_identity_chunks_and_bytes_per_tier_and_length():
    same = [[1, 2], [3, 4]]
    ref = run_of([0.5, 2.0], same, [0, 0])
    a = run_of([0.5, 2.0], same, [0, 0], **{"vllm:kv_offload_store_bytes": 40 * ROW,
                                           "vllm:kv_offload_cpu_allocation_size:sum": 40})
    fs = run_of([0.05, 0.1], same, [1024, 4096], **{"vllm:kv_offload_tiering_read_bytes{tier=1:kvtiers_fs}": 40 * ROW})
    p2p = run_of([0.1, 0.4], [[1, 2], [3, 5]], [1024, 4096])
    rep = report([1024, 4096], ref, a, {"fs": fs, "p2p": p2p})
    assert rep["row_bytes"] == ROW
    first, second = rep["lengths"]
    assert first["prefix_tokens"] == 1024 and second["prefix_tokens"] == 4096
    assert second["tiers"]["fs"]["ratio"] == 0.1 / 2.0
    assert second["tiers"]["fs"]["chunks"] == 32 and second["tiers"]["fs"]["bytes"] == 32 * ROW
    assert first["tiers"]["p2p"]["tokens_identical"] and not second["tiers"]["p2p"]["tokens_identical"]
    assert rep["identical"] is False
    assert rep["tiers"]["fs"]["read_bytes"] == 40 * ROW
    text = render(rep)
    assert "prefix 4096 tokens" in text and "DIFFER" in text and "identical" in text
    assert "fs hit" in text and "0.05" in text  # the 4096-token fs ratio


def test_offload_config_names_the_spec_and_each_tier_form():
    cfg = offload_config([{"type": "kvtiers_fs", "root_dir": "/kv"}], 1 << 20, module_path=True)
    extra = cfg["kv_connector_extra_config"]
    assert cfg["kv_connector"] == "OffloadingConnector"
    assert (extra["spec_name"], extra["spec_module_path"]) == ("KvtiersOffloadingSpec", "kvtiers.integrations.vllm")
    assert extra["secondary_tiers"] == [{"type": "kvtiers_fs", "root_dir": "/kv",
                                         "module_path": "kvtiers.integrations.vllm"}]
    assert "module_path" not in offload_config([{"type": "kvtiers_fs"}])["kv_connector_extra_config"][
        "secondary_tiers"][0]


def test_prompt_families_share_exactly_their_prefix():
    a, b = prompt_family(300, 2, suffix_tokens=10, seed=4)
    assert a[:300] == b[:300] and a[300:] != b[300:] and len(a) == 310
    assert prompt_family(300, 1, seed=5)[0][:300] != a[:300]


def test_command_says_where_vllm_cannot_run_here():
    platforms = pytest.importorskip("vllm.platforms")
    if platforms.current_platform.device_type:
        pytest.skip("this vLLM runs here (the demo would start engines)")
    # the main environment's vLLM is the CUDA wheel: on a machine without a GPU it has no platform
    proc = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--engine", "vllm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "make demo-vllm" in proc.stderr, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--engine", "vllm", "--lengths", "1k"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--lengths" in bad.stderr
