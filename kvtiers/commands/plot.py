"""PNG plots of ``kvtiers bench tier`` and ``kvtiers simulate`` reports (matplotlib, the
``plot`` extra: ``pip install 'kvtiers[plot]'``), drawn off-screen."""

from __future__ import annotations

from typing import Any

from .requires import require


def require_plot() -> None:
    """Raise a one-line error unless matplotlib is installed: a command with ``--plot`` calls
    this before its run, not after it."""
    require("--plot", "matplotlib")


def _pyplot() -> Any:
    require_plot()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def plot_bench(report: dict[str, Any], path: str) -> None:
    """GB/s against chunk size (left) and against requests in flight (right), store and
    load, the tier solid and its raw baseline dashed."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"store": "tab:blue", "load": "tab:orange"}
    for op in ("store", "load"):
        first = report["results"][0].get("variant") if report["results"] else None  # variants: the first one
        rows = [r for r in report["results"] if r["op"] == op and r.get("variant") == first]
        xs = [r["chunk_bytes"] / (1 << 20) for r in rows]
        left.plot(xs, [r["gbps"] for r in rows], "o-", color=colors[op], label=f"{op}, tier")
        if any(r["baseline_gbps"] is not None for r in rows):
            left.plot(xs, [r["baseline_gbps"] for r in rows], "s--", color=colors[op], alpha=0.6,
                      label=f"{op}, raw")
        conc = [r for r in report["concurrency"] if r["op"] == op]
        if conc:
            labels = [f"{r['jobs']}x{r['keys_per_job']}" for r in conc]
            xi = list(range(len(conc)))
            right.plot(xi, [r["gbps"] for r in conc], "o-", color=colors[op], label=f"{op}, tier")
            if any(r["baseline_gbps"] is not None for r in conc):
                right.plot(xi, [r["baseline_gbps"] for r in conc], "s--", color=colors[op], alpha=0.6,
                           label=f"{op}, raw")
            right.set_xticks(xi, labels)
    left.set_xscale("log", base=2)
    sizes = sorted({r["chunk_bytes"] for r in report["results"]})
    left.set_xticks([c / (1 << 20) for c in sizes], [_size(c) for c in sizes])
    left.minorticks_off()
    left.set_xlabel("chunk size")
    left.set_ylabel("GB/s")
    left.set_title(f"{report['tier']}: by chunk size")
    conc = report["concurrency"]
    right.set_xlabel("jobs in flight x keys per job" + (f" ({_size(conc[0]['chunk_bytes'])} chunks)" if conc else ""))
    right.set_ylabel("GB/s")
    right.set_title("by concurrency")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_simulation(report: dict[str, Any], path: str) -> None:
    """Throughput against concurrent conversations, one line per policy, with the GPU and
    host capacities (in conversations) marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["o-", "s--", "^-.", "v:", "D-"]  # distinct, so lines that coincide stay visible
    for i, pol in enumerate(report["policies"]):
        rows = [r for r in report["results"] if r["policy"] == pol]
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], styles[i % len(styles)],
                label=pol, markersize=9 - 1.5 * i, lw=1.5)
    model = report["model"]
    for x, what in ((model.get("gpu_conversations"), "GPU full"), (model.get("host_conversations"), "host full")):
        if x:
            ax.axvline(x, color="grey", ls=":", lw=1)
            ax.text(x, 0, f" {what}", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("concurrent conversations")
    ax.set_ylabel("output tokens/s (modelled)")
    links = ", ".join(f"{k} {v['load_gbps']:.1f} GB/s" for k, v in report.get("links", {}).items())
    ax.set_title(f"{model['name']}\n{links}" if links else model["name"], fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
