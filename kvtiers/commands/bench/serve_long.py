"""``kvtiers bench serve --long``: time to first token of a long prompt whose prefix comes from a
kvtiers tier, against the same prompt recomputed, on real ``vllm serve`` servers.

Per repeat two fresh servers, started at once and measured one after the other: ``none`` (no
offloading) and the tier's configuration (the host arena in front of one kvtiers tier, ``fs`` by default). Per prefix
length (``--long 8192,16384``), ``--long-requests`` prompts, each with a prefix of its own and
sent one at a time:

- ``none`` computes each prompt (its TTFT is the **recompute**) and sends it again at once (its
  prefix from vLLM's device cache: the floor a load can reach).
- the tier's server computes every prompt once (**warm**: its KV is stored through the arena
  into the tier), then sends them all again in the same order (**tier**), ``--long-rounds``
  times over. Its device cache
  holds one longest prompt and its arena 1.25 of them, so by then each prompt's prefix has been
  pushed out of both by the prompts after it: it comes from the tier. That is checked per
  request from the server's /metrics (prompt tokens cached, by the cache that supplied them).

TTFT is the client's: a streamed completion, from sending to the first chunk that carries a
token. Every answer (greedy, ``--output-len`` tokens, top-k logprobs) goes through
:mod:`.serve_identity` against ``none``'s answer to the same prompt (its computed or its cached
one), to the tolerance measured between ``none``'s repeats.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..vllm_engine import prompt_family
from . import serve_identity
from . import serve_metrics as sm
from . import serve_run as sr

__all__ = ["LongSettings", "kv_bytes_per_token", "render", "run_long", "stream_answer"]

#: what a request of each phase is: computed without offloading, its prefix from none's device
#: cache, computed on the tier's server (stored), its prefix from the tier
PHASES = ("recompute", "device", "warm", "tier")
#: the arena in front of the tier, in longest prompts: more than one (a load pins a whole
#: prompt), fewer than two (so the prompts after a prompt push it out)
ARENA_PROMPTS = 1.25
#: vLLM stops an engine whose worker takes more than 300 s over one step: the steps of a 16K-token
#: prefill take minutes on a loaded CPU (TTFT 120 s at a load average of 18; an engine died at 80-90)
SERVER_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600"}
#: the longest warm-up prompt a server answers before its measured ones
WARM_UP_TOKENS = 4096


@dataclass
class LongSettings:
    """The long-prompt run: prefix lengths and prompts per length (each with its own prefix)."""

    lengths: list[int]
    requests: int = 16
    tier: str = "fs"
    #: times the tier's server sends every prompt again, cycling through them (each time its
    #: prefix pushed out of the device cache and the arena by the others): more requests from
    #: the tier for the same prefills
    rounds: int = 1

    def prompts(self, suffix_len: int) -> list[tuple[int, list[int]]]:
        """``(length, prompt)`` for every length, in order; the same in every run."""
        return [(n, prompt_family(n, 1, suffix_len, seed=n * 1000 + i)[0])
                for n in self.lengths for i in range(self.requests)]


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache per token of the model in ``model_dir`` (its ``config.json``; bf16)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def max_positions(model_dir: str) -> int | None:
    """The model's ``max_position_embeddings`` (None if its config has none)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg).get("max_position_embeddings")


def sized(settings: sr.ServeSettings, ls: LongSettings, gpu_blocks: int | None,
          tier_cpu_bytes: int | None) -> sr.ServeSettings:
    """``settings`` for the long prompts: the longest prompt's length, a device cache of one
    longest prompt (``gpu_blocks`` if given, at least that), an arena of :data:`ARENA_PROMPTS`
    of them (``tier_cpu_bytes`` if given), and the model's positions stretched to the longest
    prompt where its config has fewer (``--hf-overrides``: the shapes are random weights).
    ``ValueError`` (one line) where a given size cannot hold one longest prompt."""
    longest = max(ls.lengths)
    st = replace(settings, prefix_len=longest, per_prefix=1)
    need = -(-st.max_model_len // sr.BLOCK_TOKENS)
    if gpu_blocks is not None and gpu_blocks < need:
        raise ValueError(f"--gpu-blocks {gpu_blocks} cannot hold one {st.max_model_len}-token prompt "
                         f"({need} blocks of {sr.BLOCK_TOKENS} tokens)")
    prompt_bytes = (longest + settings.suffix_len) * kv_bytes_per_token(settings.model)
    if tier_cpu_bytes is not None and tier_cpu_bytes < prompt_bytes:
        raise ValueError(f"--tier-cpu-bytes {tier_cpu_bytes} cannot hold one {longest}-token prefix's KV "
                         f"({prompt_bytes} bytes): a load pins the whole prompt in the arena")
    arena = tier_cpu_bytes if tier_cpu_bytes is not None else -(-int(prompt_bytes * ARENA_PROMPTS) // (1 << 20)) << 20
    extra = list(settings.extra_serve_args)
    positions = max_positions(settings.model)
    if positions is not None and positions < st.max_model_len and "--hf-overrides" not in extra:
        extra += ["--hf-overrides", json.dumps({"max_position_embeddings": st.max_model_len})]
    return replace(st, gpu_blocks=gpu_blocks if gpu_blocks is not None else need + 2, tier_cpu_bytes=arena,
                   extra_serve_args=extra)


def stream_answer(base_url: str, model: str, prompt: list[int], max_tokens: int, top_k: int = serve_identity.TOP_K,
                  timeout: float = 3600.0) -> dict[str, Any]:
    """One greedy completion, streamed: ``ttft_s`` (sending to the first chunk carrying a
    token), ``e2e_s``, the token ids and, per generated token, its top-``top_k`` logprobs."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "logprobs": top_k, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    ttft = None
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise OSError(f"vllm serve answered an error: {msg['error']}")
            for choice in msg.get("choices", []):
                lp = choice.get("logprobs") or {}
                got = [sr._token_id(t) for t in lp.get("tokens") or []]
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += got
                tops += [{sr._token_id(t): float(v) for t, v in (pos or {}).items()}
                         for pos in lp.get("top_logprobs") or []]
    e2e = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "tokens": tokens, "tops": tops}


def _settled(base_url: str, before: dict[str, float], prompt_len: int, timeout: float = 10.0) -> dict[str, Any]:
    """The request's /metrics delta, once its prompt tokens are counted (vLLM's stats reach the
    API server with the engine's outputs; give up after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        d = sm.summarize(sm.delta(before, sm.scrape(base_url)))
        if sum(d["prompt_tokens"].values()) >= prompt_len or time.monotonic() > deadline:
            return d
        time.sleep(0.2)


def _request(base_url: str, settings: sr.ServeSettings, phase: str, length: int, i: int,
             prompt: list[int], k: int) -> dict[str, Any]:
    """Send one prompt; its timing, answer and where its prompt tokens came from."""
    before = sm.scrape(base_url)
    ans = stream_answer(base_url, settings.model, prompt, settings.output_len)
    d = _settled(base_url, before, len(prompt))
    cached = d["cached_by_source"]
    return {"phase": phase, "length": length, "i": i, "prompt_tokens": len(prompt), "ttft_s": ans["ttft_s"],
            "e2e_s": ans["e2e_s"], "computed": d["prompt_tokens"].get("local_compute", 0.0),
            "cached": cached, "from_tier": sum(v for k, v in cached.items() if k not in ("device", "host")),
            "prompt": k, "tokens": ans["tokens"], "tops": ans["tops"], "load": sr.load_now()}


def _measure(srv: sr.VllmServer, run: dict[str, Any], cfg: sr.Config, settings: sr.ServeSettings,
             ls: LongSettings, log: str, say: Any) -> None:
    """Wait for ``srv``, send its phases' prompts one at a time, stop it; into ``run``: the
    requests, every answer (``answers``: prompt, tokens, top-k) and, for ``none``, the identity
    check's ``greedy`` (each prompt's computed answer, then its cached one)."""
    t0 = time.monotonic()
    srv.wait_ready(timeout=settings.start_timeout)
    sr.warm_up(srv.base_url, settings.model)
    # a server's first long prompt pays one-time costs (seen: 7 s for 1024 tokens of the tiny
    # model, against 0.2 s for the next): one of its own, outside the measurement
    stream_answer(srv.base_url, settings.model,
                  prompt_family(min(min(ls.lengths), WARM_UP_TOKENS), 1, settings.suffix_len, seed=4243)[0], 2)
    run["ready_s"] = time.monotonic() - t0
    say(f"{cfg.name} r{run['repeat']}: ready ({run['ready_s']:.0f} s after the one before)")
    prompts = ls.prompts(settings.suffix_len)
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    try:
        if cfg.offloads:  # warm every prompt, then each again once the others pushed it out
            for phase, out, rounds in (("warm", first, 1), ("tier", second, ls.rounds)):
                for _ in range(rounds):
                    for k, (n, p) in enumerate(prompts):
                        out.append(_request(srv.base_url, settings, phase, n, k % ls.requests, p, k))
                        say(_line(cfg.name, run["repeat"], out[-1]))
        else:  # each prompt computed, then at once again from the device cache
            for k, (n, p) in enumerate(prompts):
                for phase, out in (("recompute", first), ("device", second)):
                    out.append(_request(srv.base_url, settings, phase, n, k % ls.requests, p, k))
                    say(_line(cfg.name, run["repeat"], out[-1]))
    except OSError as e:
        if srv.alive() and not sr.engine_error(log):
            raise
        run["error"] = f"vllm serve ({cfg.name}, repeat {run['repeat']}) died: {sr.engine_error(log) or e} (log {log})"
        say(run["error"])
    finally:
        srv.stop()
    reqs = first + second
    run["requests"] = [{k: v for k, v in r.items() if k not in ("tokens", "tops")} for r in reqs]
    run["answers"] = [[r["prompt"], r["tokens"], r["tops"]] for r in reqs]
    run["complete"] = len(reqs) == len(prompts) * (1 + (ls.rounds if cfg.offloads else 1))
    if not cfg.offloads and run["complete"]:
        run["greedy"] = [r["tokens"] for r in reqs]
        run["greedy_logprobs"] = [r["tops"] for r in reqs]


def _repeat(cfgs: list[sr.Config], repeat: int, settings: sr.ServeSettings, ls: LongSettings, workdir: str,
            tier_extra: dict[str, dict[str, Any]], say: Any) -> list[dict[str, Any]]:
    """One repeat: every configuration's server (and tier servers) started at once (a start is
    mostly importing vLLM, minutes on a loaded machine), then measured one after the other, each
    stopped when done (an idle server takes no CPU from the one measured)."""
    runs, todo = [], []
    with contextlib.ExitStack() as stack:
        for cfg in cfgs:
            wd = os.path.join(workdir, f"{cfg.name}-r{repeat}")
            os.makedirs(wd, exist_ok=True)
            log = os.path.join(wd, "server.log")
            ktc = sr.server_config(cfg, settings, wd, stack, tier_extra)
            srv = sr.VllmServer(settings, ktc, log, env=SERVER_ENV)
            sr.launch(srv)
            stack.callback(srv.stop)
            run: dict[str, Any] = {"config": cfg.name, "repeat": repeat, "kv_transfer_config": ktc, "requests": []}
            runs.append(run)
            todo.append((srv, run, cfg, log))
        for srv, run, cfg, log in todo:
            _measure(srv, run, cfg, settings, ls, log, say)
    for _srv, run, _cfg, log in todo:
        left = sr.wait_gone(sr.shm_regions(log))
        run["shm_left"] = sorted(left)
        if left:
            from ...integrations.vllm.shm_region import sweep_stale_regions

            for p in left:
                sweep_stale_regions(pattern=p)
    return runs


def _line(name: str, repeat: int, r: dict[str, Any]) -> str:
    return (f"{name} r{repeat} {r['phase']:<9} {r['length']:>6} #{r['i']:<2} TTFT {r['ttft_s']:8.3f} s  "
            f"computed {r['computed']:.0f}, from the tier {r['from_tier']:.0f}, load {r['load']:.1f}")


def aggregate(report: dict[str, Any]) -> None:
    """``report["cells"]``: per prefix length and phase, the TTFT median and range over every
    request of every repeat; per length the tier's median over the recompute's (the goal's
    ratio: <= 0.1 at 16K) and the device cache's; ``report["not_from_tier"]``: tier-phase
    requests that took less than half their prompt from the tier (then the ratio is not
    what it says)."""
    by: dict[tuple[int, str], list[float]] = {}
    bad = []
    for run in report["runs"]:
        for r in run["requests"]:
            by.setdefault((r["length"], r["phase"]), []).append(r["ttft_s"])
            if r["phase"] == "tier" and r["from_tier"] < r["prompt_tokens"] / 2:
                bad.append(f"{run['config']} r{run['repeat']} {r['length']} #{r['i']}: {r['from_tier']:.0f} of "
                           f"{r['prompt_tokens']} from the tier")
    cells = []
    for n in report["lengths"]:
        row: dict[str, Any] = {"length": n}
        for ph in PHASES:
            xs = by.get((n, ph), [])
            row[ph] = ({"median_s": statistics.median(xs), "range_s": [min(xs), max(xs)], "requests": len(xs)}
                       if xs else None)
        rec, tier, dev = row["recompute"], row["tier"], row["device"]
        row["tier_over_recompute"] = tier["median_s"] / rec["median_s"] if rec and tier else None
        row["device_over_recompute"] = dev["median_s"] / rec["median_s"] if rec and dev else None
        cells.append(row)
    report["cells"] = cells
    report["not_from_tier"] = bad


def run_long(cfgs: list[sr.Config], settings: sr.ServeSettings, ls: LongSettings, repeats: int, *,
             workdir: str | None = None, tier_extra: dict[str, dict[str, Any]] | None = None,
             say: Any = None) -> dict[str, Any]:
    """Run the long-prompt measurement (``cfgs``: ``none`` and the tier's configuration,
    interleaved over ``repeats``); the report (:func:`render`)."""
    say = say or (lambda _m: None)
    own = workdir is None
    wd = tempfile.mkdtemp(prefix="kvtiers-bench-serve-long-") if own else workdir
    os.makedirs(wd, exist_ok=True)
    report: dict[str, Any] = {
        "kind": "serve-long", "engine": "vllm serve", "model": settings.model, "configs": [c.name for c in cfgs],
        "lengths": ls.lengths, "requests": ls.requests, "rounds": ls.rounds, "repeats": repeats,
        "settings": {"suffix_len": settings.suffix_len, "output_len": settings.output_len,
                     "gpu_blocks": settings.gpu_blocks, "tier_cpu_bytes": settings.tier_cpu_bytes,
                     "max_model_len": settings.max_model_len,
                     "kv_bytes_per_token": kv_bytes_per_token(settings.model),
                     "serve_args": settings.extra_serve_args},
        "runs": []}
    with sr.measuring(wd, own, report):
        for r in range(repeats):
            for run in _repeat(cfgs, r, settings, ls, wd, tier_extra or {}, say):
                report["runs"].append(run)
                with open(os.path.join(wd, "runs.jsonl"), "a") as f:  # what a run cut short keeps
                    f.write(json.dumps({k: v for k, v in run.items()
                                        if k not in ("greedy", "greedy_logprobs", "answers")}) + "\n")
    aggregate(report)
    identity(report)
    return report


def identity(report: dict[str, Any]) -> None:
    """``report["identity"]``: every answer of every run against the first ``none`` run's
    answers to the same prompt (its computed or its cached one, matched by tokens,
    :func:`.serve_identity.answer_diff`), top-k logprobs within the noise between ``none``'s
    repeats (:func:`.serve_identity.plain_noise`; 0 with one: a tier's bytes are the device
    cache's bytes)."""
    plain = [r for r in report["runs"] if r["config"] == serve_identity.PLAIN and r.get("greedy")]
    out: dict[str, Any] = {"reference": f"{plain[0]['config']} r{plain[0]['repeat']}" if plain else None,
                           "prompts": len(plain[0]["greedy"]) // 2 if plain else 0}
    if not plain:
        report["identity"] = {**out, "identical": False, "differ": ["no complete run without offloading"]}
        return
    ref, tol = plain[0], serve_identity.plain_noise(plain) or 0.0
    differ, diffs = [], {}
    for run in report["runs"]:
        if run is ref:
            continue
        name = f"{run['config']} r{run['repeat']}"
        worst, same = 0.0, True
        for k, tokens, tops in run.get("answers", []):
            ok, d = serve_identity.answer_diff(ref, tokens, tops, k)
            same, worst = same and ok, max(worst, d)
        diffs[name] = worst if same else None
        if not same or worst > tol:
            differ.append(name)
    out["logprobs"] = {"top_k": serve_identity.TOP_K, "tolerance": tol, "max_diff": diffs}
    out.update(identical=not differ, differ=differ)
    report["identity"] = out


def ok(report: dict[str, Any]) -> bool:
    """No server died, every tier request took its prefix from the tier, the answers identical."""
    return (report["identity"]["identical"] and not report["not_from_tier"]
            and not any(r.get("error") or not r.get("complete") for r in report["runs"]))


def render(report: dict[str, Any]) -> str:
    """The report as text: per length the TTFT of each phase (median, range, requests) and the
    ratios, then the checks."""
    s = report["settings"]
    lines = [f"kvtiers bench serve --long: {report['engine']} ({report['model']}); {report['requests']} prompts per "
             f"length, each its own prefix, sent {report.get('rounds', 1)} time(s) from the tier, "
             f"{s['suffix_len']}-token suffix, {s['output_len']} output tokens, one "
             f"at a time; device cache {s['gpu_blocks']} blocks, arena {s['tier_cpu_bytes'] >> 20} MiB in front of "
             f"{report['configs'][-1]}; {report['repeats']} repeat(s)",
             "TTFT, client side, median (range) over every request of every repeat:",
             f"  {'prefix':>7}  {'recompute s':>22}  {'device cache s':>22}  {'warm (store) s':>22}  "
             f"{'from the tier s':>22}  {'tier/recompute':>14}"]

    def cell(c: dict[str, Any] | None) -> str:
        if not c:
            return f"{'-':>22}"
        return f"{c['median_s']:8.3f} ({c['range_s'][0]:.2f}-{c['range_s'][1]:.2f})".rjust(22)

    for row in report["cells"]:
        ratio = row["tier_over_recompute"]
        lines.append(f"  {row['length']:>7}  {cell(row['recompute'])}  {cell(row['device'])}  {cell(row['warm'])}  "
                     f"{cell(row['tier'])}  {(f'{ratio:.4f}' if ratio is not None else '-'):>14}")
    lines.append("")
    if report["not_from_tier"]:
        lines.append("NOT FROM THE TIER (the ratio does not measure a load): " + "; ".join(report["not_from_tier"]))
    else:
        lines.append("every request of the tier phase took its prefix from the tier (vLLM's /metrics)")
    ident = report["identity"]
    lp = ident.get("logprobs")
    tol = f", top-{lp['top_k']} logprobs within {lp['tolerance']:.3g} nats" if lp else ""
    lines.append(f"answers: {'identical' if ident['identical'] else 'DIFFER'} to {ident['reference']}'s "
                 f"(tokens{tol})" + (f" in {', '.join(ident['differ'])}" if ident["differ"] else ""))
    for r in report["runs"]:
        if r.get("error"):
            lines.append(f"FAILED: {r['error']}")
        if r.get("shm_left"):
            lines.append(f"left in /dev/shm by {r['config']} r{r['repeat']}: {', '.join(r['shm_left'])} (removed)")
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} CPUs, load {m['load_at_start'][0]:.1f} at start, "
                 f"{m.get('load_at_end', [0])[0]:.1f} at end")
    return "\n".join(lines)
