"""``kvtiers demo --scenario pd --tier mooncake``: prefill/decode over one Mooncake Store pool.

Two real processes share one pool: a ``mooncake_master`` on loopback and a ``kvtiers mooncake
serve`` process holding its memory (started here, or ``--master`` names a pool of your own).
The *prefill* process computes the KV of every prompt (the simulated engine of ``kvtiers
demo``, bytes derived from the chunk keys), stores it, and its manager cascades every chunk
to the ``mooncake`` tier (``global_segment_size: 0``: the engine contributes no memory, so its
exit loses nothing). The *decode* process, whose only tier is the same pool, looks each
prompt up, loads its chunks into its own device blocks and checks every byte. Prompts share a
system prompt, so after the first one those chunks come from decode's own host cache. The
parent prints one row per path; exit 1 on any mismatch or failed load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .engine import BLOCKS_PER_CHUNK, TOKENS_PER_BLOCK, SimEngine, chunk_keys, pick_device
from .pd import UNIQUE_TOKENS, _manager, _prompts, report_pd

POOL_SEGMENT = 256 << 20  #: memory of the serve process the demo starts


def _tier(master: str) -> dict[str, Any]:
    return {"type": "mooncake", "master_server_address": master, "global_segment_size": 0, "timeout": 30.0}


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Compute and store every prompt's chunks; return once the pool holds them all."""
    prompts = _prompts(args.prompts, args.seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    per_prompt = len(prompts[0]) // tpc
    engine = SimEngine(pick_device(args.device), per_prompt * BLOCKS_PER_CHUNK, args.seed)
    unique = per_prompt + (args.prompts - 1) * (UNIQUE_TOKENS // tpc)
    mgr = _manager(engine, {"tiers": [_tier(args.master)]}, unique + 8, args.seed)
    stored = 0
    arena_s = drain_s = 0.0
    try:
        for tokens in prompts:
            keys = chunk_keys(tokens, tpc, args.seed)
            blocks = engine.alloc(len(keys) * BLOCKS_PER_CHUNK)
            engine.compute(keys, blocks)
            t1 = time.perf_counter()
            (res,) = mgr.wait([mgr.store(keys, blocks)])
            arena_s += time.perf_counter() - t1
            stored += len(keys) - len(res.skipped_keys)
            engine.release(blocks)
        chunk_bytes = mgr.chunk_bytes
    finally:
        t1 = time.perf_counter()
        mgr.close()  # waits for the cascade of every chunk to the pool
        drain_s = time.perf_counter() - t1
    # the cascade overlaps the next prompt's compute: what the engine waited for is the stores
    # into the arena and the drain of the cascade at the end
    return {"chunks": stored, "bytes": stored * chunk_bytes, "arena_seconds": arena_s, "drain_seconds": drain_s}


def decode(args: argparse.Namespace) -> dict[str, Any]:
    """Load every prompt's chunks from the pool and check each byte."""
    prompts = _prompts(args.prompts, args.seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    per_prompt = len(prompts[0]) // tpc
    engine = SimEngine(pick_device(args.device), per_prompt * BLOCKS_PER_CHUNK, args.seed)
    mgr = _manager(engine, {"tiers": [_tier(args.master)]}, 2 * per_prompt, args.seed)
    out: dict[str, Any] = {"sources": {}, "bytes": {}, "seconds": {}, "mismatches": 0, "failed": 0, "chunks": 0}
    try:
        for tokens in prompts:
            keys = chunk_keys(tokens, tpc, args.seed)
            deadline = time.monotonic() + 30
            while (found := mgr.lookup(keys)).num_chunks < len(keys):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"decode: only {found.num_chunks} of {len(keys)} chunks found in the pool")
                mgr.poll()
                time.sleep(0.001)
            blocks = engine.alloc(len(keys) * BLOCKS_PER_CHUNK)
            t0 = time.perf_counter()
            (res,) = mgr.wait([mgr.load(keys, blocks)], timeout=60)
            dt = time.perf_counter() - t0
            out["failed"] += len(res.failed_keys)
            idx = [i for i, k in enumerate(keys) if k not in res.failed_keys]
            good = [keys[i] for i in idx]
            good_blocks = [blocks[i * BLOCKS_PER_CHUNK + j] for i in idx for j in range(BLOCKS_PER_CHUNK)]
            out["mismatches"] += len(engine.verify(good, good_blocks))
            out["chunks"] += len(good)
            path = max(set(found.sources), key=found.sources.count)  # one load: its time to its main path
            for src in found.sources:
                out["sources"][src] = out["sources"].get(src, 0) + 1
                out["bytes"][src] = out["bytes"].get(src, 0) + mgr.chunk_bytes
            out["seconds"][path] = out["seconds"].get(path, 0.0) + dt
            engine.release(blocks)
    finally:
        mgr.close()
    return out


def run_pd_mooncake(*, prompts: int, seed: int, device: str | None, master: str | None = None,
                    timeout: float = 300.0) -> dict[str, Any]:
    """Start a pool (unless ``master`` names one), then the prefill process, then the decode
    process; return what they measured. The pool started here is killed at the end."""
    pool = None
    if master is None:
        from kvtiers_mooncake.pool import start_test_pool

        pool = start_test_pool(POOL_SEGMENT)
        master = pool.address
    tmp = tempfile.mkdtemp(prefix="kvtiers-pd-mooncake-")
    common = ["--prompts", str(prompts), "--seed", str(seed), "--master", master]
    common += ["--device", device] if device else []
    me = [sys.executable, "-m", "kvtiers.commands.demo.pd_mooncake"]
    procs: list[subprocess.Popen] = []
    try:
        results = {}
        for role in ("prefill", "decode"):
            out = os.path.join(tmp, f"{role}.json")
            p = subprocess.Popen([*me, role, *common, "--out", out], stdin=subprocess.DEVNULL)
            procs.append(p)
            if p.wait(timeout) != 0:
                raise RuntimeError(f"the {role} process failed (exit {p.returncode})")
            with open(out) as f:
                results[role] = json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if pool is not None:
            pool.stop()
    return {"prompts": prompts, "seed": seed, "tier": "mooncake", "master": master, **results}


def render(report: dict[str, Any]) -> str:
    """The table ``kvtiers demo --scenario pd --tier mooncake`` prints."""
    pre, dec = report["prefill"], report["decode"]
    lines = [f"{'path':<50} {'chunks':>7} {'GB/s':>8}",
             f"{'prefill: device -> host arena -> mooncake pool':<50} {pre['chunks']:>7} "
             f"{pre['bytes'] / max(pre['arena_seconds'] + pre['drain_seconds'], 1e-9) / 1e9:>8.3f}"]
    names = {"host": "decode: own host cache -> device"}
    for src, n in sorted(dec["sources"].items()):
        secs = dec["seconds"].get(src)
        rate = f"{dec['bytes'][src] / secs / 1e9:>8.3f}" if secs else f"{'-':>8}"
        lines.append(f"{names.get(src, f'decode: {src} pool -> device'):<50} {n:>7} {rate}")
    lines.append(f"{report['prompts']} prompts over one Mooncake pool (master {report['master']}); decode verified "
                 f"{dec['chunks']} chunks: {dec['mismatches']} mismatches, {dec['failed']} failed loads")
    return "\n".join(lines)


def pd_mooncake_command(*, prompts: int, seed: int, device: str | None, as_json: bool,
                        master: str | None = None) -> None:
    """What ``kvtiers demo --scenario pd --tier mooncake`` does: run, print, exit 1 on any bad byte."""
    import click
    from kvtiers_mooncake.client import missing

    why = missing()
    if why is not None:
        raise click.ClickException(f"--tier mooncake: {why}")
    report_pd(lambda: run_pd_mooncake(prompts=prompts, seed=seed, device=device, master=master), as_json,
              render)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtiers.commands.demo.pd_mooncake")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device")
    ap.add_argument("--master", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = (prefill if args.role == "prefill" else decode)(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
