"""``kvtiers bench serve``'s table and figure, from its report (also a saved ``--json`` one)."""

from __future__ import annotations

from typing import Any

from ..plot import _pyplot, require_plot

__all__ = ["plot", "render", "require_plot"]


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f}"


def _tiers_text(tiers: dict[str, Any]) -> str:
    parts = []
    for name, t in tiers.items():
        hits = t.get("hits", 0.0)
        q = t.get("queries", 0.0)
        ceiling = t.get("reuse_ceiling", {}).get("15m")  # what an unbounded cache would hit (kvtiers_reuse_ceiling)
        # written: the tier's own count where exported (vLLM counts a store job's every chunk,
        # also those a tier's "admit" kept back)
        out = t.get("kvtiers", {}).get("write_bytes", t.get("write_bytes", 0.0))
        parts.append(f"{name}: {hits:.0f}/{q:.0f} hits, {_mib(t.get('read_bytes', 0.0))} MiB in, "
                     f"{_mib(out)} MiB out"
                     + (f", reuse ceiling {ceiling:.0%} (15 min)" if ceiling is not None else ""))
    return "; ".join(parts) or "-"


def render(rep: dict[str, Any]) -> str:
    """The report as text: one table per concurrency, then per cell where prompt tokens came
    from and what each tier did, the identity check and the machine's load."""
    s = rep["settings"]
    fit = rep.get("fit", {})
    ref = "no offloading's" if fit.get("reference") == "none" else "the same configuration's"
    workloads = rep.get("workloads", ["prefix"])
    lines = [f"kvtiers bench serve: {rep['engine']} ({rep['model']}); device cache {s['gpu_blocks']} blocks, "
             f"host arena {_mib(s['cpu_bytes'])} MiB alone, {_mib(s.get('tier_cpu_bytes', s['cpu_bytes']))} MiB "
             f"in front of a tier; {rep['repeats']} interleaved repeat(s), medians"]
    if "prefix" in workloads:
        lines.append(f"prefix: vLLM's `vllm bench serve` prefix_repetition: {s['prefix_len']}-token prefixes, "
                     f"{s['suffix_len']}-token suffixes, {s['output_len']} output tokens, "
                     f"{s['requests_per_prefix']} requests per prefix")
    mt = s.get("multi_turn")
    if "multi-turn" in workloads and mt:
        lines.append(f"multi-turn: vLLM's multi-turn client (benchmark_serving_multi_turn.py): per conversation a "
                     f"{mt['prefix_len']}-token context, {mt['turns']} user turns of {mt['turn_len']} tokens, "
                     f"{mt['output_len']} output tokens each; all conversations active, cycled through by "
                     f"`concurrency` clients")
    for name, v in (rep.get("variants") or {}).items():
        lines.append(f"variant {name}: {v['base']} with {v['kv_connector_extra_config'] or ''}"
                     + (f" tier {v['tier']}" if v.get("tier") else ""))
    by = fit.get("by_workload") or {"prefix": fit.get("prefixes")}
    lines.append(f"fit = req/s over {ref} req/s at the smallest working set ("
                 + ", ".join(f"{w}: {n}" for w, n in by.items()) + ")")
    for w, conc in ((w, c) for w in workloads for c in rep["concurrency"]):
        rows = [r for r in rep["cells"] if r["concurrency"] == conc and r.get("workload", "prefix") == w]
        if not rows:
            continue
        size = "convs" if w == "multi-turn" else "prefixes"
        lines += ["", f"{w}, concurrency {conc}" if len(workloads) > 1 or w != "prefix" else f"concurrency {conc}",
                  f"  {'config':<10}{size:>9}{'req/s':>8}{'range':>13}{'fit':>6}{'tok/s':>8}"
                  f"{'TTFT mean':>10}{'median':>8}{'p99':>8}{'failed':>7}{'load':>6}"]
        for r in rows:
            lo, hi = r["req_s_range"]
            frac = f"{r['fraction_of_fit']:.2f}" if r.get("fraction_of_fit") is not None else "-"
            lines.append(f"  {r['config']:<10}{r['prefixes']:>9}{r['req_s']:>8.2f}{f'{lo:.2f}-{hi:.2f}':>13}"
                         f"{frac:>6}{r['output_throughput']:>8.1f}{r['mean_ttft_ms']:>10.0f}"
                         f"{r['median_ttft_ms']:>8.0f}{r['p99_ttft_ms']:>8.0f}{r['failed']:>7}{r['load']:>6.1f}")
        ratios = [r for r in rows if any(r.get(k) is not None for k in ("vs_none", "vs_ceiling", "vs_vllm_fs"))
                  and r["config"] not in ("none", "ceiling")]
        if ratios:
            lines += ["", f"  {'ratios':<10}{size:>9}{'/none':>8}{'/ceiling':>10}{'fs/vllm-fs':>12}"]
            for r in ratios:
                f = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("vs_none", "vs_ceiling", "vs_vllm_fs")]
                lines.append(f"  {r['config']:<10}{r['prefixes']:>9}{f[0]:>8}{f[1]:>10}{f[2]:>12}")
        lines += ["", "  prompt tokens by source (computed / cached: device, host, disk, ...), tiers, lookups:"]
        for r in rows:
            pt = r["prompt_tokens"]
            cached = ", ".join(f"{k} {v:.0f}" for k, v in r["cached_by_source"].items() if v) or "none"
            lookups = (f"lookup waits {r['lookup_async_waits']:.0f} ({r['lookup_async_delay_s']:.1f} s)"
                       if r["lookup_async_waits"] else "")
            alloc = f"promotion alloc failures {r['promotion_alloc_failures']:.0f}" \
                if r["promotion_alloc_failures"] else ""
            extra = "; ".join(x for x in (lookups, alloc) if x)
            lines.append(f"  {r['config']:<10}{r['prefixes']:>4}: computed {pt.get('local_compute', 0):.0f}, cached "
                         f"{cached}; {_tiers_text(r['tiers'])}" + (f"; {extra}" if extra else ""))
    ident = rep["identity"]
    lines.append("")
    lines.extend(identity_lines(ident))
    for run in rep["runs"]:
        if run.get("error"):
            lines.append(f"FAILED: {run['error']}")
    m = rep["machine"]
    lines.append(f"machine: {m['cpus']} CPUs, load average {m['load_at_start'][0]:.1f} at start, "
                 f"{m.get('load_at_end', [0.0])[0]:.1f} at end")
    left = [p for run in rep["runs"] for p in run.get("shm_left", [])]
    if left:
        lines.append(f"/dev/shm: {len(left)} offload region(s) left behind by stopped servers (removed): "
                     + ", ".join(left))
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: str) -> None:
    """req/s against working set (prefixes), one line per configuration (a panel per concurrency);
    the prefix workload's cells."""
    plt = _pyplot()
    concs = rep["concurrency"]
    fig, axes = plt.subplots(1, len(concs), figsize=(5.5 * len(concs), 4), squeeze=False)
    for ax, conc in zip(axes[0], concs, strict=True):
        for name in rep["configs"]:
            rows = sorted((r for r in rep["cells"] if r["config"] == name and r["concurrency"] == conc
                           and r.get("workload", "prefix") == "prefix"),
                          key=lambda r: r["prefixes"])
            xs = [r["prefixes"] for r in rows]
            ax.plot(xs, [r["req_s"] for r in rows], marker="o", label=name)
            if rep["repeats"] > 1:
                ax.fill_between(xs, [r["req_s_range"][0] for r in rows], [r["req_s_range"][1] for r in rows],
                                alpha=0.15)
        ax.set_xlabel(f"working set: prefixes of {rep['settings']['prefix_len']} tokens")
        ax.set_ylabel("requests/s")
        ax.set_title(f"vllm serve, concurrency {conc}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def identity_lines(ident: dict[str, Any]) -> list[str]:
    """The correctness check's lines: token ids, and top-k logprobs where they were compared."""
    lp = ident.get("logprobs")
    what = "greedy tokens and top-k logprobs" if lp else "greedy tokens"
    if ident["identical"]:
        lines = [f"{what}: identical across every configuration ({ident['prompts']} prompts, "
                 f"reference {ident['reference']})"]
    else:
        lines = [f"{what}: DIFFER from {ident['reference']} in {', '.join(ident['differ'])}"]
    if lp:
        worst = max(lp["max_diff"].values(), default=0.0)
        lines.append(f"  top-{lp['top_k']} logprobs: largest difference from the reference {worst:.4g}, "
                     f"tolerance {lp['tolerance']:.4g} (the plain configuration's repeats; 0 with one: exact)")
    return lines
