"""``kvtiers bench compress TYPE``: the same tier with and without ``"compress"``, on KV-like
bytes, in interleaved rounds: store and load GB/s of each, the ratio of chunk bytes to the
bytes the tier got (pieces), and each codec's GB/s against the uncompressed run
(docs/compression.md).

The chunks are bf16 values drawn per head from a normal distribution, each head scaled by its
own factor (the shape of K and V after a model's projections), or ``--data random``
(incompressible), or ``--from-fs ROOT``: the chunks an fs tier keeps under ROOT (e.g. what a
vLLM engine offloaded), at their own size. Lossless runs check every byte of every load; an fp8 run reports its
largest error over the stated bound (``max_err_over_bound``, at most 1).

numpy only (the KV bytes are made without torch); the ``compress`` extra for zstd and lz4.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ..bench.tier import Size

DEFAULT_CODECS = ('{"codec": "zstd"}', '{"codec": "lz4"}')


def kv_bf16(n_bytes: int, seed: int, head_dim: int = 128, heads: int = 8) -> Any:
    """``n_bytes`` of bf16 KV-like values (numpy uint8): normal per head dim, scaled per head."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n_bytes // 2, dtype=np.float32)
    x = x.reshape(-1, heads, head_dim) * np.exp(rng.standard_normal((1, heads, 1))).astype(np.float32)
    bits = x.ravel().view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)


def _fp8_error(orig: Any, got: Any, block: int = 128) -> float:
    """The largest |error| over the bound |x|/16 + |x|/256 + blockmax/2**18 (docs/compression.md)."""
    import numpy as np

    x = (orig.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    y = (got.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    m = np.repeat(np.abs(x).reshape(-1, block).max(axis=1), block)
    bound = np.abs(x) / 16 + np.abs(x) / 256 + m / 2 ** 18
    return float(np.max(np.abs(y - x) / np.where(bound > 0, bound, 1)))


def fs_chunks(root: str) -> tuple[int, Any, str]:
    """``(chunk bytes, the chunks as one numpy uint8 array, dtype)`` of the fs tier's namespace
    under ``root`` with the most chunk files (each file's first ``chunk_bytes`` from its
    ``config.json``: the chunk, without the tier's trailer)."""
    import numpy as np

    from ...errors import ConfigError

    best: tuple[int, Path] | None = None
    for cfg in Path(root).glob("*/config.json"):
        n = sum(1 for _ in cfg.parent.rglob("*.bin"))
        if n and (best is None or n > best[0]):
            best = (n, cfg)
    if best is None:
        raise ConfigError(f"--from-fs {root}: no fs namespace with chunk files under it")
    fields = json.loads(best[1].read_text())["fields"]
    size = int(fields.get("chunk_bytes") or fields.get("slot_bytes") or 0)
    if size <= 0 or size % 4096:
        raise ConfigError(f"--from-fs {root}: its config.json names no chunk size (chunk_bytes) of whole pages")
    files = sorted(best[1].parent.rglob("*.bin"))
    data = b"".join(f.read_bytes()[:size] for f in files)
    if len(data) != size * len(files):
        raise ConfigError(f"--from-fs {root}: a chunk file shorter than {size} bytes")
    return size, np.frombuffer(data, np.uint8), str(fields.get("dtype", "bfloat16")).removeprefix("torch.")


def run_compress_bench(tier_type: str, options: dict[str, Any] | None, codecs: list[dict[str, Any]], *,
                       chunk_bytes: int = 1 << 20, chunks: int = 64, rounds: int = 3, data: str = "kv",
                       keys_per_job: int = 16, from_fs: str | None = None) -> dict[str, Any]:
    """Measure ``tier_type`` with ``options`` plain and with each ``"compress"`` object of
    ``codecs``, in ``rounds`` interleaved rounds of ``chunks`` chunks; the report's
    ``results`` has one row per run: store/load GB/s (median), their ratio to the plain
    run's, ``ratio`` (chunk bytes over the bytes the tier got) and ``exact``."""
    import numpy as np

    from ...registry import open_tier
    from ...types import Arena, Namespace, TierContext
    from .harness import _forget, _tier_io, default_options

    scratch = None
    if not options:
        scratch = tempfile.TemporaryDirectory(prefix="kvtiers-bench-compress-")
        options = default_options(tier_type, scratch.name)
    dtype = "bfloat16"
    if from_fs is not None:
        chunk_bytes, src, dtype = fs_chunks(from_fs)
        chunks, data = len(src) // chunk_bytes, f"fs:{from_fs}"
    arena = Arena.allocate(chunks, chunk_bytes)
    flat = np.frombuffer(arena.buffer, np.uint8)
    if from_fs is None:
        src = kv_bf16(len(flat), 7) if data == "kv" else np.random.default_rng(7).integers(0, 256, len(flat), np.uint8)
    ctx = TierContext(arena, Namespace({"kvtiers_bench": "compress", "chunk_bytes": chunk_bytes, "data": data,
                                        "dtype": dtype, "run": time.time_ns()}))
    runs: dict[str, dict[str, Any]] = {"plain": {}}
    for c in codecs:
        name = c.get("codec", "zstd") + (f"-{c['level']}" if "level" in c else "")
        name = name if name not in runs else f"{name}#{len(runs)}"
        runs[name] = {"compress": c}
    ids = iter(range(1, 1 << 62))
    handles = {name: open_tier(tier_type, {**options, **over}, ctx) for name, over in runs.items()}
    times: dict[tuple[str, str], list[float]] = {}
    exact = dict.fromkeys(runs, True)
    worst: dict[str, float] = {}
    stored: dict[str, list[bytes]] = {name: [] for name in runs}
    try:
        for r in range(-1, rounds):  # round -1 warms up, unmeasured
            order = list(runs) if r % 2 else list(reversed(runs))
            for name in order:
                keys = [b"cmp-%s-%d-%d" % (name.encode(), r, i) for i in range(chunks)]
                stored[name] += keys
                flat[:] = src
                t0 = time.perf_counter()
                _tier_io(handles[name], keys, False, keys_per_job=keys_per_job, jobs=None, submit_us=None, ids=ids)
                t1 = time.perf_counter()
                flat[:] = 0
                t2 = time.perf_counter()
                _tier_io(handles[name], keys, True, keys_per_job=keys_per_job, jobs=None, submit_us=None, ids=ids)
                t3 = time.perf_counter()
                if r >= 0:
                    times.setdefault((name, "store"), []).append(t1 - t0)
                    times.setdefault((name, "load"), []).append(t3 - t2)
                lossy = runs[name].get("compress", {}).get("lossy", False)
                if lossy and data != "random" and dtype == "bfloat16":
                    worst[name] = max(worst.get(name, 0.0), _fp8_error(src, flat))
                elif not lossy and not np.array_equal(flat, src):
                    exact[name] = False
        nbytes = chunks * chunk_bytes
        results = []
        plain = {op: nbytes / statistics.median(times[("plain", op)]) / 1e9 for op in ("store", "load")}
        for name in runs:
            hooks = handles[name].hooks
            row: dict[str, Any] = {"run": name, "ratio": round(getattr(hooks, "ratio", 1.0), 3),
                                   "exact": exact[name]}
            for op in ("store", "load"):
                g = nbytes / statistics.median(times[(name, op)]) / 1e9
                row[f"{op}_gbps"] = round(g, 3)
                row[f"{op}_vs_plain"] = round(g / plain[op], 3)
            if name in worst:
                row["max_err_over_bound"] = round(worst[name], 3)
            results.append(row)
        return {"tier": tier_type, "chunk_bytes": chunk_bytes, "chunks": chunks, "rounds": rounds, "data": data,
                "results": results}
    finally:
        try:
            for name, h in handles.items():
                _forget([h], stored[name])
        finally:
            for h in handles.values():
                h.close()
            if scratch is not None:
                scratch.cleanup()


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of :func:`run_compress_bench`'s report."""
    lines = [f"kvtiers bench compress {report['tier']}: {report['chunks']} chunks of {report['chunk_bytes']} B "
             f"({report['data']}), median of {report['rounds']} interleaved rounds",
             f"{'run':<10} {'ratio':>6} {'store GB/s':>11} {'vs plain':>9} {'load GB/s':>10} {'vs plain':>9}  exact"]
    for r in report["results"]:
        ex = "yes" if r["exact"] and "max_err_over_bound" not in r else (
            f"fp8: max err/bound {r['max_err_over_bound']}" if "max_err_over_bound" in r else "NO")
        lines.append(f"{r['run']:<10} {r['ratio']:>5.2f}x {r['store_gbps']:>11.3f} {r['store_vs_plain']:>8.2f}x "
                     f"{r['load_gbps']:>10.3f} {r['load_vs_plain']:>8.2f}x  {ex}")
    return "\n".join(lines)


@click.command("compress")
@click.argument("tier_type", metavar="TYPE")
@click.option("--config", "config_text", default=None, metavar="JSON", help="The tier's options as JSON.")
@click.option("--config-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The tier's options from a JSON file.")
@click.option("--codec", "codecs", multiple=True, metavar="JSON",
              help="A \"compress\" object to measure (repeatable) [default: zstd and lz4].")
@click.option("--chunk-bytes", type=Size(), default="1MiB", show_default=True, help="Bytes per chunk.")
@click.option("--chunks", type=click.IntRange(1), default=64, show_default=True, help="Chunks per round.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True, help="Measured rounds.")
@click.option("--data", type=click.Choice(["kv", "random"]), default="kv", show_default=True,
              help="bf16 KV-like values, or random (incompressible) bytes.")
@click.option("--from-fs", "from_fs", type=click.Path(file_okay=False, exists=True), default=None,
              help="The chunks an fs tier keeps under this root (e.g. a vLLM engine's), instead of --data.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def compress(tier_type: str, config_text: str | None, config_file: str | None, codecs: tuple[str, ...],
             chunk_bytes: int, chunks: int, rounds: int, data: str, from_fs: str | None, as_json: bool) -> None:
    """The same tier with and without "compress" on KV-like bytes: ratio, store and load GB/s
    of each codec against the uncompressed run, in one run."""
    from ...config import parse_json_option
    from ...errors import ConfigError
    from ...registry import get_registry

    options = parse_json_option(config_text, config_file)
    options.pop("type", None)
    options.pop("compress", None)
    get_registry().tier_info(tier_type)
    specs = []
    for text in codecs or DEFAULT_CODECS:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--codec {text!r}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"--codec {text!r}: give a \"compress\" object, e.g. '{{\"codec\": \"zstd\"}}'")
        specs.append(spec)
    if chunk_bytes % 4096:
        raise ConfigError(f"--chunk-bytes must be a multiple of 4096, got {chunk_bytes}")
    report = run_compress_bench(tier_type, options, specs, chunk_bytes=chunk_bytes, chunks=chunks, rounds=rounds,
                                data=data, from_fs=from_fs)
    click.echo(json.dumps(report, indent=1) if as_json else format_report(report))
