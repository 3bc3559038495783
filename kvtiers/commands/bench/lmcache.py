"""``kvtiers bench lmcache``: LMCache's own server bench through the kvtiers fs adapter and
through LMCache's built-in fs L2 adapter, on the same directory kind, interleaved.

Run it where LMCache is installed (``make .venv-lmcache/.installed``;
``.venv-lmcache/bin/kvtiers bench lmcache``). One trial, for each adapter in turn, ``--rounds``
times: a fresh directory under ``--dir``; ``lmcache server`` on 127.0.0.1 with that one L2
adapter (kvtiers: ``{"type": "fs", "root_dir": DIR}`` through the plugin seam; LMCache's:
``{"type": "fs", "base_path": DIR}``; ``--io direct|buffered`` puts both in that mode, its
``direct`` and LMCache's ``use_odirect``, else each keeps its own default); LMCache's
``lmcache bench server --mode cpu`` over
``--requests`` sequences of ``--num-tokens`` tokens (the store pass: L1, then every chunk to
L2); once L2 holds them all, ``lmcache kvcache clear`` empties L1 and the same bench runs
again (the load pass: every chunk comes back from L2, checksums compared by LMCache's
bench). ``--cold`` first writes back and drops from the page cache every file under both
directories (``posix_fadvise(DONTNEED)``), so both load passes read from the device: without
it LMCache's buffered adapter reads the files it has just written from memory, while the fs
tier's default O_DIRECT reads always go to the device. Store and load GB/s are LMCache's own
measure, its ``lmcache_mp.l2_store_throughput`` and ``l2_load_throughput`` histograms
(bytes over submit-to-complete time of each L2 task), averaged over the tasks of a trial; the
table gives each trial, the median per adapter and kvtiers' ratio to LMCache's. Integrity:
the kvtiers fs tier checks each chunk's xxh3 trailer; LMCache's bench compares checksums, and
a trial with any mismatch fails the run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import click

from ...launcher import ChildProcess, free_port, http_answers

__all__ = ["lmcache", "run_bench_lmcache"]

ADAPTERS = ("kvtiers", "lmcache")
KVTIERS_PLUGIN = {"type": "plugin", "module_path": "kvtiers.integrations.lmcache", "class_name": "KvtiersL2Adapter",
                  "config_class_name": "KvtiersL2AdapterConfig"}


#: ``--io``: the option that puts each side's file I/O in that mode
#: (the fs tier's options, LMCache's fs adapter's)
IO_MODES = {"direct": ({"direct": True}, {"use_odirect": True}),
            "buffered": ({"direct": False}, {"use_odirect": False})}


def adapter_spec(kind: str, root: Path, tier_options: dict[str, Any] | None = None,
                 io: str | None = None) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of one side over ``root`` (``tier_options``: more fs tier
    options; ``io``: ``direct`` or ``buffered`` for both sides, None for each side's default:
    O_DIRECT for the fs tier, buffered for LMCache's adapter)."""
    ours, theirs = IO_MODES[io] if io else ({}, {})
    if kind == "kvtiers":
        tier = {"type": "fs", **(tier_options or {}), **ours, "root_dir": str(root)}
        return {**KVTIERS_PLUGIN, "adapter_params": {"tier": tier}}
    return {"type": "fs", "base_path": str(root), **theirs}


def lmcache_bin() -> str:
    """The ``lmcache`` command beside this Python, or on PATH; a one-line error where neither is."""
    here = Path(sys.executable).parent / "lmcache"
    found = str(here) if here.exists() else shutil.which("lmcache")
    if not found:
        raise click.ClickException("LMCache is not installed here: run this in .venv-lmcache "
                                   "(make .venv-lmcache/.installed) or pip install lmcache==0.5.6 'torch==2.13.0'")
    return found


class _Server:
    def __init__(self, exe: str, spec: dict[str, Any], l1_gb: float, log: Path) -> None:
        self.port, self.http = free_port(), free_port()
        argv = [exe, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                "--http-port", str(self.http), "--l1-size-gb", str(l1_gb),
                "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--l2-adapter", json.dumps(spec)]
        http = http_answers(f"http://127.0.0.1:{self.http}/healthcheck")
        # its own listeners: a free port another process took first would answer as well
        self.proc = ChildProcess(argv, name="lmcache server",
                                 ready=lambda: (self.proc.listens("127.0.0.1", self.port)
                                                and self.proc.listens("127.0.0.1", self.http) and http()),
                                 log=log, new_session=True, die_with_parent=True)

    def get(self, path: str, port: int | None = None) -> str:
        url = f"http://127.0.0.1:{port or self.http}{path}"
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode()

    def l2_idle(self) -> bool:
        sm = json.loads(self.get("/status"))["storage_manager"]
        sc = sm.get("store_controller") or {}
        return not sc.get("pending_keys_count") and not sc.get("in_flight_task_count")

    def histogram_mean(self, name: str) -> tuple[float, int]:
        """The mean and count of LMCache's Prometheus histogram ``name`` (sum / count)."""
        total = count = 0.0
        for line in self.get("/metrics").splitlines():
            metric = line.split("{", 1)[0].split(" ", 1)[0]
            if not line.startswith(name) or line.startswith("#"):
                continue
            if metric.endswith("_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif metric.endswith("_count"):
                count += float(line.rsplit(" ", 1)[1])
        return (total / count if count else 0.0), int(count)


def _bench(exe: str, srv: _Server, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    cmd = [exe, "bench", "server", "--mode", "cpu", "--rpc-url", f"tcp://127.0.0.1:{srv.port}", "--url",
           f"http://127.0.0.1:{srv.http}", "--interval", "0", "--format", "json", "--output", str(out), "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    if proc.returncode != 0 or not out.exists():
        raise click.ClickException(f"lmcache bench server exited {proc.returncode}: "
                                   f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.read_text())


def drop_page_cache(root: Path) -> int:
    """Write back and drop from the page cache every regular file under ``root`` (the
    caller's own files only: no root needed, nothing else evicted); returns how many."""
    n = 0
    for p in root.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile (an eviction, a temporary file published)
        try:
            os.fdatasync(fd)  # dirty pages are not dropped: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _results(report: dict[str, Any]) -> dict[str, Any]:
    """The ``results`` section of LMCache's JSON report, whatever its nesting."""
    if "results" in report and isinstance(report["results"], dict):
        return report["results"]
    for v in report.values():
        if isinstance(v, dict):
            found = _results(v)
            if found:
                return found
    return {}


def trial(exe: str, kind: str, root: Path, *, requests: int, num_tokens: int, l1_gb: float, shape: str | None,
          tier_options: dict[str, Any] | None = None, io: str | None = None, cold: bool = False,
          timeout: float = 600.0) -> dict[str, Any]:
    """One adapter's store pass and load pass on a fresh ``root``; LMCache's GB/s and checks
    (``cold``: the files dropped from the page cache between the passes)."""
    root.mkdir(parents=True)
    srv = _Server(exe, adapter_spec(kind, root, tier_options, io), l1_gb, root.parent / f"{root.name}.log")
    args = ["--start", "0", "--end", str(requests), "--num-tokens", str(num_tokens)]
    if shape:
        args += ["--kvcache-shape-spec", shape]
    srv.proc.start(timeout=240)
    try:
        store = _results(_bench(exe, srv, args, root.parent / f"{root.name}-store.json", timeout))
        deadline = time.monotonic() + timeout
        while not srv.l2_idle():
            if time.monotonic() > deadline:
                raise click.ClickException(f"{kind}: L2 stores still running after {timeout:g} s")
            time.sleep(0.2)
        store_gbps, store_tasks = srv.histogram_mean("lmcache_mp_l2_store_throughput")
        subprocess.run([exe, "kvcache", "clear", "--url", f"http://127.0.0.1:{srv.http}"], capture_output=True,
                       timeout=120, check=True, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
        if cold:
            drop_page_cache(root)
        load = _results(_bench(exe, srv, args, root.parent / f"{root.name}-load.json", timeout))
        load_gbps, load_tasks = srv.histogram_mean("lmcache_mp_l2_load_throughput")
    finally:
        srv.proc.stop(timeout=30)
    files = sum(1 for p in root.rglob("*") if p.is_file() and p.suffix in (".bin", ".data"))
    return {"adapter": kind, "store_gbps": store_gbps, "store_tasks": store_tasks, "load_gbps": load_gbps,
            "load_tasks": load_tasks, "files": files,
            "checksum_ok": int(store.get("checksum_ok", 0)) + int(load.get("checksum_ok", 0)),
            "checksum_fail": int(store.get("checksum_fail", 0)) + int(load.get("checksum_fail", 0)),
            "requests": int(store.get("total_requests", 0)) + int(load.get("total_requests", 0))}


def run_bench_lmcache(*, dir: str | None, rounds: int, requests: int, num_tokens: int, l1_gb: float,
                      shape: str | None, tier_options: dict[str, Any] | None = None, io: str | None = None,
                      cold: bool = False, echo: Any = click.echo) -> dict[str, Any]:
    """Interleaved trials (kvtiers, LMCache's fs, ...) and their summary."""
    exe = lmcache_bin()
    base = Path(tempfile.mkdtemp(prefix="kvtiers-bench-lmcache-", dir=dir))
    trials: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            for kind in ADAPTERS:
                t = trial(exe, kind, base / f"{kind}-{r}", requests=requests, num_tokens=num_tokens, l1_gb=l1_gb,
                          shape=shape, tier_options=tier_options, io=io, cold=cold)
                trials.append(t)
                echo(f"round {r} {kind:8s} store {t['store_gbps']:.3f} GB/s ({t['store_tasks']} tasks)  "
                     f"load {t['load_gbps']:.3f} GB/s ({t['load_tasks']} tasks)  files {t['files']}  "
                     f"checksums ok {t['checksum_ok']} fail {t['checksum_fail']}")
                shutil.rmtree(base / f"{kind}-{r}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary: dict[str, Any] = {"trials": trials}
    for what in ("store_gbps", "load_gbps"):
        med = {k: statistics.median(t[what] for t in trials if t["adapter"] == k) for k in ADAPTERS}
        summary[what] = med
        summary[what.replace("gbps", "ratio")] = med["kvtiers"] / med["lmcache"] if med["lmcache"] else None
    bad = sum(t["checksum_fail"] for t in trials)
    echo(f"median store GB/s: kvtiers {summary['store_gbps']['kvtiers']:.3f}, LMCache fs "
         f"{summary['store_gbps']['lmcache']:.3f} (ratio {summary['store_ratio'] or 0:.2f}x); load GB/s: kvtiers "
         f"{summary['load_gbps']['kvtiers']:.3f}, LMCache fs {summary['load_gbps']['lmcache']:.3f} "
         f"(ratio {summary['load_ratio'] or 0:.2f}x); checksum mismatches {bad}")
    if bad:
        raise click.ClickException(f"{bad} checksum mismatches: bytes came back wrong")
    return summary


@click.command()
@click.option("--dir", "dir_", default=None, help="Parent of the trial directories (default: the temp dir).")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(1), help="Interleaved rounds.")
@click.option("--requests", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences per pass of LMCache's server bench.")
@click.option("--num-tokens", default=512, show_default=True, type=click.IntRange(256),
              help="Tokens per sequence (LMCache's bench default).")
@click.option("--l1-size-gb", default=1.0, show_default=True, type=click.FloatRange(0.1),
              help="The server's L1 (must hold one pass).")
@click.option("--kvcache-shape-spec", "shape", default=None,
              help="LMCache's KV shape spec (default: its bench default, (2,1024,16,8,128):float16:32).")
@click.option("--tier-options", default=None,
              help='More options of the kvtiers fs tier, as JSON (e.g. \'{"direct": false}\': buffered I/O).')
@click.option("--io", type=click.Choice(sorted(IO_MODES)), default=None,
              help="Both sides' file I/O: direct (O_DIRECT: the fs tier's direct, LMCache's use_odirect) or "
                   "buffered; default: each side's own (the fs tier O_DIRECT, LMCache's adapter buffered).")
@click.option("--cold", is_flag=True,
              help="Drop both sides' files from the page cache before the load pass (loads from the device).")
@click.option("--json", "json_out", default=None, help="Also write the trials and summary to this file.")
def lmcache(dir_: str | None, rounds: int, requests: int, num_tokens: int, l1_size_gb: float, shape: str | None,
            tier_options: str | None, io: str | None, cold: bool, json_out: str | None) -> None:
    """LMCache's server bench through the kvtiers fs adapter vs LMCache's fs L2 adapter."""
    opts = None
    if tier_options:
        try:
            opts = json.loads(tier_options)
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"not JSON: {e}", param_hint="--tier-options") from None
        if not isinstance(opts, dict):
            raise click.BadParameter("expected a JSON object", param_hint="--tier-options")
        if io and "direct" in opts:
            raise click.BadParameter(f"sets \"direct\", which --io {io} sets for both sides: give one of them",
                                     param_hint="--tier-options")
    summary = run_bench_lmcache(dir=dir_, rounds=rounds, requests=requests, num_tokens=num_tokens,
                                l1_gb=l1_size_gb, shape=shape, tier_options=opts, io=io, cold=cold)
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=1))
