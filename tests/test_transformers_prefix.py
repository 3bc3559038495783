"""kvtiers.integrations.transformers.PrefixCache with a real transformers model on CPU (the
shared tiny Llama/Qwen2/Mistral-shaped models of kvtiers.commands.tinymodel): a prefix stored in
one process and loaded in another gives the same greedy tokens as a full prefill, through the fs
tier; the same in one process through the memory tier with an arena smaller than the prompt; a
corrupted chunk in the middle ends the loaded prefix there, tokens still identical; GQA shapes,
bf16 and fp32; the cache classes it cannot copy are errors naming them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from test_transformers_helpers import cached_vs_full, greedy, prefill, prompt, tiny_model  # noqa: E402

from kvtiers import prefix_chunk_keys  # noqa: E402
from kvtiers.integrations.transformers import PrefixCache  # noqa: E402

TPC = 16
HELPERS = Path(__file__).with_name("test_transformers_helpers.py")
ROOT = Path(__file__).resolve().parents[1]


def run_helper(*args: str) -> dict:
    p = subprocess.run([sys.executable, str(HELPERS), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def shared_prompts(prefix: int = 260, seed: int = 1) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first ``prefix`` tokens, then different."""
    a, b = prompt(300, seed), prompt(300, seed + 100)
    return a, a[:prefix] + b[prefix : prefix + 30]


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("qwen2", "float32")])
def test_a_prefix_stored_in_one_process_loads_in_another(tmp_path, arch, dtype) -> None:
    first, second = shared_prompts()
    config = json.dumps({"host_bytes": 4 << 20, "tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}]})
    stored = run_helper("store", arch, dtype, config, json.dumps(first))
    assert stored == {"stored": 300 // TPC}
    got = run_helper("load", arch, dtype, config, json.dumps(second))
    assert got["n"] == 260 // TPC * TPC  # the shared full chunks: 256 tokens
    assert got["cached"] == got["full"]
    assert got["max_logit_diff"] <= 1e-2  # same KV bytes: the logits agree too


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_memory_tier_and_an_arena_smaller_than_the_prompt(arch, dtype) -> None:
    model = tiny_model(arch, dtype)
    first, second = shared_prompts()
    chunk = 2 * 4 * 2 * TPC * 64 * torch.empty((), dtype=getattr(torch, dtype)).element_size()  # GQA: 2 KV heads
    config = {"host_bytes": 4 * chunk, "tiers": [{"type": "memory"}]}  # 4 slots for an 18-chunk prompt
    with PrefixCache.from_config(config, model, tokens_per_chunk=TPC) as pc:
        assert pc.manager.chunk_bytes == chunk and len(pc.manager.arena) == 4
        assert pc.geometry.kv_heads == 2 and pc.geometry.dtype == getattr(torch, dtype)
        assert pc.store(first, prefill(model, first)) == 18  # in waves: every chunk accepted
        assert pc.store(first, prefill(model, first)) == 0  # already cached
        got = cached_vs_full(pc, model, second)
        assert got["n"] == 256 and got["cached"] == got["full"]
        assert pc.manager.stats.hits["memory"] >= 12  # most of the prefix came back from the tier


def test_a_corrupt_chunk_in_the_middle_ends_the_prefix_there(tmp_path) -> None:
    from kvtiers_fs import FsTier

    model = tiny_model("llama", "bfloat16")
    first, second = shared_prompts()
    config = {"host_bytes": 4 << 20, "tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}
    with PrefixCache.from_config(config, model, tokens_per_chunk=TPC) as pc:
        assert pc.store(first, prefill(model, first)) == 18
        namespace = pc.manager.namespace
    keys = prefix_chunk_keys(first, TPC)
    FsTier.conformance_corrupt({"root_dir": str(tmp_path)}, namespace, keys[7])
    with PrefixCache.from_config(config, model, tokens_per_chunk=TPC) as pc:
        got = cached_vs_full(pc, model, second)
        assert got["n"] == 7 * TPC  # chunks 0-6; chunk 7 failed its checksum, the rest is recomputed
        assert got["cached"] == got["full"]
        assert pc.manager.stats.failed_loads == 1


def test_the_loaded_cache_is_what_a_prefill_makes(tmp_path) -> None:
    model = tiny_model("qwen2", "float32")
    ids = prompt(100, 3)
    with PrefixCache.from_config({"host_bytes": 1 << 20}, model, tokens_per_chunk=TPC) as pc:
        full = prefill(model, ids)
        legacy = tuple((layer.keys, layer.values) for layer in full.layers)  # the legacy tuple form
        assert pc.store(ids, legacy) == 6
        cache, n = pc.load(ids + [5])
        assert n == 96 and type(cache).__name__ == "DynamicCache" and cache.get_seq_length() == 96
        for mine, theirs in zip(cache.layers, full.layers, strict=True):
            assert torch.equal(mine.keys, theirs.keys[:, :, :96]) and torch.equal(mine.values, theirs.values[:, :, :96])
        # at least one token is left to compute: a prompt of exactly 6 chunks loads 5
        assert pc.load(ids[:96])[1] == 80
        assert pc.load(ids[:10]) == (None, 0) and pc.load(prompt(100, 4)) == (None, 0)


def test_a_sliding_window_bounds_the_prefix() -> None:
    model = tiny_model("mistral", "float32")
    model.config.sliding_window = 64  # a window the test prompt passes
    ids = prompt(100, 5)
    with PrefixCache.from_config({"host_bytes": 1 << 20}, model, tokens_per_chunk=TPC) as pc:
        assert pc.geometry.window == 64
        with pytest.raises(ValueError, match="DynamicSlidingWindowLayer that kept only the last 63 of 100"):
            pc.store(ids, prefill(model, ids))
        assert pc.store(ids[:60], prefill(model, ids[:60])) == 3
        cache, n = pc.load(ids)
        assert n == 48  # below the window
        assert greedy(model, ids[n:], cache)[0] == greedy(model, ids)[0]


def test_caches_it_cannot_copy_are_errors_naming_them() -> None:
    from transformers import DynamicCache, StaticCache

    model = tiny_model("llama", "float32")
    ids = prompt(40, 6)
    with PrefixCache.from_config({"host_bytes": 1 << 20}, model, tokens_per_chunk=TPC) as pc:
        static = StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), past_key_values=static, use_cache=True)
        with pytest.raises(TypeError, match="got StaticCache"):
            pc.store(ids, static)
        with torch.no_grad():
            two = model(input_ids=torch.tensor([ids, ids]), use_cache=True).past_key_values
        with pytest.raises(ValueError, match="batch size 2"):
            pc.store(ids, two)
        with pytest.raises(ValueError, match="holds 32 tokens, fewer than the 48"):
            pc.store(ids + ids[:10], prefill(model, ids[:32]))
        with pytest.raises(ValueError, match="an empty cache"):
            pc.store(ids, DynamicCache(config=model.config))
    with pytest.raises(RuntimeError, match="closed"):
        pc.load(ids)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        PrefixCache.from_config({"host_bytes": 1 << 20, "blocks_per_chunk": 4}, model, tokens_per_chunk=TPC)
