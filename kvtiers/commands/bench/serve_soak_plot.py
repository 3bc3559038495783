"""The PNG of ``kvtiers bench serve --soak --plot FILE``: each sampled series against time."""

from __future__ import annotations

from typing import Any

from ..plot import _pyplot
from .serve_soak import full_intervals

__all__ = ["plot_serve_soak"]


def _series(rows: list[dict[str, Any]], i: int, get: Any) -> list[float | None]:
    out = []
    for r in rows:
        s = r["servers"][i] if i < len(r["servers"]) else None
        try:
            out.append(get(s) if s is not None else None)
        except (KeyError, TypeError):
            out.append(None)
    return out


def plot_serve_soak(report: dict[str, Any], path: str) -> None:
    """Five panels against time, per server: req/s; TTFT p50 and p99; tier hit rate; RSS of the
    API process, engine core and workers (fds and threads on their own axis); bytes of the fs
    root against its bound, and /dev/shm."""
    plt = _pyplot()
    rows = full_intervals(report)
    soak = report["soak"]
    t = [r["t"] / 60 for r in rows]
    n = soak["servers"]
    fig, (rate, ttft, hit, proc, disk) = plt.subplots(5, 1, figsize=(9, 14), sharex=True)
    for i in range(n):
        c = f"C{i}"
        rate.plot(t, _series(rows, i, lambda s: s["req_s"]), "o-", color=c, label=f"server {i}")
        ttft.plot(t, _series(rows, i, lambda s: s["ttft_p50_s"]), "o-", color=c, label=f"p50, server {i}")
        ttft.plot(t, _series(rows, i, lambda s: s["ttft_p99_s"]), "^--", color=c, label=f"p99, server {i}")
        tiers = sorted({k for r in rows for s in r["servers"] if s for k in s["hit_rate"]})
        for j, tier in enumerate(tiers):
            hit.plot(t, _series(rows, i, lambda s, tier=tier: s["hit_rate"].get(tier)), ["o-", "s--", "^:"][j % 3],
                     color=c, label=f"{tier}, server {i}")
        for proc_name, style in (("api", "o-"), ("engine_core", "s-")):
            proc.plot(t, _series(rows, i, lambda s, p=proc_name: s[p]["rss"] / (1 << 20)), style, color=c,
                      label=f"RSS {proc_name}, server {i}")
        proc.plot(t, _series(rows, i, lambda s: sum(w["rss"] for w in s["workers"]) / (1 << 20)), "^-", color=c,
                  label=f"RSS workers, server {i}")
    other = proc.twinx()
    for i in range(n):
        other.plot(t, _series(rows, i, lambda s: s["api"]["fds"] + s["engine_core"]["fds"]), "--", color=f"C{i}",
                   alpha=0.6, label=f"fds api+core, server {i}")
        other.plot(t, _series(rows, i, lambda s: s["api"]["threads"] + s["engine_core"]["threads"]), ":",
                   color=f"C{i}", alpha=0.6, label=f"threads api+core, server {i}")
    disk.plot(t, [r["fs"]["chunk_bytes"] / (1 << 20) for r in rows], "o-", color="tab:brown", label="fs chunk bytes")
    disk.axhline(soak["fs_max_bytes"] / (1 << 20), color="black", ls="--", label="bound (max_bytes)")
    disk.plot(t, [r["shm"]["region_bytes"] / (1 << 20) for r in rows], "s:", color="tab:gray",
              label="/dev/shm offload regions")
    rate.set_ylabel("requests/s")
    ttft.set_ylabel("TTFT, s")
    hit.set_ylabel("tier hit rate (chunks)")
    proc.set_ylabel("RSS, MiB")
    other.set_ylabel("fds, threads")
    disk.set_ylabel("MiB")
    disk.set_xlabel("minutes")
    for ax in (rate, ttft, hit, proc, other, disk):
        ax.set_ylim(bottom=0)
    for ax in (rate, ttft, hit, disk):
        ax.legend(fontsize=7, loc="lower left")
    h1, l1 = proc.get_legend_handles_labels()
    h2, l2 = other.get_legend_handles_labels()
    proc.legend(h1 + h2, l1 + l2, fontsize=6, loc="lower left", ncol=2)
    for ax in (rate, ttft, hit, proc, disk):
        ax.grid(alpha=0.3)
    s = report.get("summary", {})
    rate.set_title(f"serve soak: {n} server(s), {soak['duration_s'] / 60:g} min, {soak['rate']:g} req/s each, "
                   f"{soak['prefixes']} prefixes; failed {s.get('failed', '?')}, greedy mismatches "
                   f"{s.get('greedy_mismatches', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
