"""The PNG of ``kvtiers bench tier --soak --plot FILE``: each row of the soak against time."""

from __future__ import annotations

from typing import Any

from ..plot import _pyplot

__all__ = ["plot_soak"]


def plot_soak(report: dict[str, Any], path: str) -> None:
    """Three panels against time: store, load and eviction rates (lookups on their own
    axis); RSS per process (open fds and threads on their own axis); bytes on the backend
    against the bound."""
    plt = _pyplot()
    rows = report["intervals"]
    t = [r["t"] for r in rows]
    fig, (rates, proc, back) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rates.plot(t, [r["store_keys_per_s"] for r in rows], "o-", color="tab:blue", label="stores/s")
    rates.plot(t, [r["load_keys_per_s"] for r in rows], "s-", color="tab:orange", label="loads/s")
    rates.plot(t, [r["evictions_per_s"] for r in rows], "^--", color="tab:red", label="evictions/s")
    rates.set_ylabel("keys/s")
    rates.set_ylim(bottom=0)
    lk = rates.twinx()
    lk.plot(t, [(r["lookup_keys_per_s"] or 0) / 1e6 for r in rows], ":", color="tab:green", label="lookups (M/s)")
    lk.set_ylabel("lookups, M keys/s")
    lk.set_ylim(bottom=0)
    h1, l1 = rates.get_legend_handles_labels()
    h2, l2 = lk.get_legend_handles_labels()
    rates.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower left")
    rates.set_title(f"{report['tier']}: soak of {report['duration_s']:g} s, {report['processes']} process(es), "
                    f"{report['chunk_bytes'] >> 10} KiB chunks, bound {report['bound_bytes'] / (1 << 20):.1f} MiB")
    n = len(rows[0]["rss"]) if rows else 0
    other = proc.twinx()
    for p in range(n):
        color = f"C{p % 10}"  # one color per process: RSS solid, fds dashed, threads dotted
        proc.plot(t, [(r["rss"][p] or 0) / (1 << 20) for r in rows], "o-", color=color, label=f"RSS, process {p}")
        other.plot(t, [r["fds"][p] or 0 for r in rows], "--", color=color, alpha=0.7, label=f"fds, process {p}")
        other.plot(t, [r["threads"][p] or 0 for r in rows], ":", color=color, alpha=0.7,
                   label=f"threads, process {p}")
    proc.set_ylabel("RSS, MiB")
    proc.set_ylim(bottom=0)
    other.set_ylabel("open fds, threads")
    other.set_ylim(bottom=0)
    h1, l1 = proc.get_legend_handles_labels()
    h2, l2 = other.get_legend_handles_labels()
    proc.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left", ncol=2)
    back.plot(t, [r["backend_bytes"] / (1 << 20) for r in rows], "o-", color="tab:brown", label="on the backend")
    back.axhline(report["bound_bytes"] / (1 << 20), color="black", ls="--", label="bound (max_bytes)")
    back.set_ylabel("MiB")
    back.set_ylim(bottom=0)
    back.set_xlabel("seconds")
    back.legend(fontsize=8, loc="lower left")
    for ax in (rates, proc, back):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
