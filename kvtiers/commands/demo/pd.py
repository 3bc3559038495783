"""``kvtiers demo --scenario pd``: prefill/decode disaggregation, the transport a parameter.

Two real processes. The *prefill* process computes the KV of every prompt (a simulated engine,
bytes derived from the chunk keys as in ``kvtiers demo``) and stores it into its host arena;
the *decode* process looks each prompt up, loads its chunks into its own device blocks and
checks every byte. Prompts share a system prompt, so after the first one those chunks come from
decode's own host cache. The parent prints one row per path: chunks and GB/s. Exit 1 on any
mismatch or failed load. The transport (``--tier``):

- ``p2p`` (docs/p2p.md): prefill serves its arena to peers (the manager's ``serve`` block) on
  loopback until told to stop; decode's only tier is ``p2p`` pointing at it (ZMQ or NIXL).
- ``mooncake`` (docs/mooncake.md): both share one Mooncake Store pool, a ``mooncake_master`` and
  a ``kvtiers mooncake serve`` process holding its memory (started here, or ``--master`` names a
  pool of your own). Prefill's manager cascades every chunk to the ``mooncake`` tier
  (``global_segment_size: 0``: the engine contributes no memory, so its exit loses nothing) and
  exits; decode's only tier is the same pool.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .engine import BLOCKS_PER_CHUNK, SYSTEM_TOKENS, TOKENS_PER_BLOCK, SimEngine, chunk_keys, pick_device

UNIQUE_TOKENS = 768  #: per prompt, after the shared system prompt
TRANSPORTS = ("p2p", "mooncake")
POOL_SEGMENT = 256 << 20  #: memory of the Mooncake serve process the demo starts


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(SYSTEM_TOKENS)]
    return [system + [rng.randrange(1, 50_000) for _ in range(UNIQUE_TOKENS)] for _ in range(n)]


def _manager(engine: Any, extra: dict[str, Any], chunks: int, seed: int) -> Any:
    from ...engine.arena import slot_bytes_for
    from ...engine.manager import TieringManager

    slot = slot_bytes_for(engine.layout.chunk_bytes(BLOCKS_PER_CHUNK))
    cfg = {"host_bytes": chunks * slot, "blocks_per_chunk": BLOCKS_PER_CHUNK, **extra}
    return TieringManager.from_config(cfg, engine.kv, layout=engine.layout, tokens_per_block=TOKENS_PER_BLOCK,
                                      namespace_fields={"model": "kvtiers-demo-pd", "dtype": "float16", "seed": seed})


def _mooncake_tier(master: str) -> dict[str, Any]:
    return {"type": "mooncake", "master_server_address": master, "global_segment_size": 0, "timeout": 30.0}


def _setup(args: argparse.Namespace) -> tuple[list[list[int]], int, int, SimEngine]:
    """The prompts, tokens per chunk, chunks per prompt and the simulated engine of either role."""
    prompts = _prompts(args.prompts, args.seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    per_prompt = len(prompts[0]) // tpc
    return prompts, tpc, per_prompt, SimEngine(pick_device(args.device), per_prompt * BLOCKS_PER_CHUNK, args.seed)


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Compute and store every prompt's chunks; over p2p, then serve them until the stop file
    appears; over mooncake, return once the pool holds them all."""
    prompts, tpc, per_prompt, engine = _setup(args)
    unique = per_prompt + (args.prompts - 1) * (UNIQUE_TOKENS // tpc)
    if args.tier == "p2p":
        extra = {"serve": {"bind": "tcp://127.0.0.1:0", "nixl": args.backend == "nixl"}}
    else:
        extra = {"tiers": [_mooncake_tier(args.master)]}
    mgr = _manager(engine, extra, unique + 8, args.seed)
    stored = 0
    seconds = 0.0
    out: dict[str, Any] = {}
    try:
        for tokens in prompts:
            keys = chunk_keys(tokens, tpc, args.seed)
            blocks = engine.alloc(len(keys) * BLOCKS_PER_CHUNK)
            engine.compute(keys, blocks)
            t0 = time.perf_counter()
            (res,) = mgr.wait([mgr.store(keys, blocks)])
            seconds += time.perf_counter() - t0
            stored += len(keys) - len(res.skipped_keys)
            engine.release(blocks)
        if args.tier == "p2p":
            port = int(mgr.serve.endpoint.rsplit(":", 1)[1])
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(str(port))
            os.replace(args.ready_file + ".tmp", args.ready_file)
            deadline = time.monotonic() + args.serve_seconds
            while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
                mgr.poll()  # an engine step: answers the peers' lookups and pins
                time.sleep(0.0005)
            # zmq also where NIXL's canary failed
            out = {"served": mgr.serve.served, "data_path": "nixl" if mgr.serve.nixl is not None else "zmq"}
    finally:
        t1 = time.perf_counter()
        mgr.close()  # over mooncake: waits for the cascade of every chunk to the pool
        drain_s = time.perf_counter() - t1
    if args.tier == "p2p":
        return {"chunks": stored, "bytes": stored * mgr.chunk_bytes, "seconds": seconds, **out}
    # the cascade overlaps the next prompt's compute: what the engine waited for is the stores
    # into the arena and the drain of the cascade at the end
    return {"chunks": stored, "bytes": stored * mgr.chunk_bytes, "arena_seconds": seconds, "drain_seconds": drain_s}


def decode(args: argparse.Namespace) -> dict[str, Any]:
    """Load every prompt's chunks from the other side (the prefill process or the pool) and
    check each byte."""
    prompts, tpc, per_prompt, engine = _setup(args)
    if args.tier == "p2p":
        tier, where = {"type": "p2p", "host": "127.0.0.1", "port": args.port, "backend": args.backend}, "on the peer"
    else:
        tier, where = _mooncake_tier(args.master), "in the pool"
    mgr = _manager(engine, {"tiers": [tier]}, 2 * per_prompt, args.seed)
    out: dict[str, Any] = {"sources": {}, "bytes": {}, "seconds": {}, "mismatches": 0, "failed": 0, "chunks": 0}
    if args.tier == "p2p":
        out["data_path"] = mgr.tiers[0].handle.tier.data_path
    try:
        for tokens in prompts:
            keys = chunk_keys(tokens, tpc, args.seed)
            deadline = time.monotonic() + 30
            while (found := mgr.lookup(keys)).num_chunks < len(keys):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"decode: only {found.num_chunks} of {len(keys)} chunks found {where}")
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
            # one load per prompt: its time goes to the path most of its chunks took
            path = max(set(found.sources), key=found.sources.count)
            for src in found.sources:
                out["sources"][src] = out["sources"].get(src, 0) + 1
                out["bytes"][src] = out["bytes"].get(src, 0) + mgr.chunk_bytes
            out["seconds"][path] = out["seconds"].get(path, 0.0) + dt
            engine.release(blocks)
    finally:
        mgr.close()
    return out


def _role(role: str, common: list[str], tmp: str, procs: list[subprocess.Popen], *extra: str) -> subprocess.Popen:
    """Start this module as the ``role`` process (its report goes to ``tmp/role.json``)."""
    p = subprocess.Popen([sys.executable, "-m", "kvtiers.commands.demo.pd", role, *common, *extra,
                          "--out", os.path.join(tmp, f"{role}.json")], stdin=subprocess.DEVNULL)
    procs.append(p)
    return p


def _finished(p: subprocess.Popen, role: str, tmp: str, timeout: float) -> dict[str, Any]:
    """Wait for the ``role`` process; its report (a RuntimeError naming it if it failed)."""
    if p.wait(timeout) != 0:
        raise RuntimeError(f"the {role} process failed (exit {p.returncode})")
    with open(os.path.join(tmp, f"{role}.json")) as f:
        return json.load(f)


def run_pd(*, prompts: int, seed: int, device: str | None, timeout: float = 300.0, backend: str = "zmq",
           tier: str = "p2p", master: str | None = None) -> dict[str, Any]:
    """Run the prefill and decode processes over ``tier`` (one of :data:`TRANSPORTS`), return
    what they measured. ``backend``: p2p's data path, ``zmq`` or ``nixl`` (nixl-cu12 on both
    sides). ``master``: mooncake's pool; ``None`` starts one here and kills it at the end."""
    if tier not in TRANSPORTS:
        raise ValueError(f"tier {tier!r}: expected one of {', '.join(TRANSPORTS)}")
    pool = None
    if tier == "mooncake" and master is None:
        from kvtiers_mooncake.pool import start_test_pool

        pool = start_test_pool(POOL_SEGMENT)
        master = pool.address
    tmp = tempfile.mkdtemp(prefix=f"kvtiers-pd-{tier}-")
    common = ["--tier", tier, "--prompts", str(prompts), "--seed", str(seed)]
    common += ["--backend", backend] if tier == "p2p" else ["--master", str(master)]
    common += ["--device", device] if device else []
    procs: list[subprocess.Popen] = []
    try:
        if tier == "mooncake":  # prefill fills the pool and exits, then decode reads it
            pre_out = _finished(_role("prefill", common, tmp, procs), "prefill", tmp, timeout)
            dec_out = _finished(_role("decode", common, tmp, procs), "decode", tmp, timeout)
            return {"prompts": prompts, "seed": seed, "tier": tier, "master": master, "prefill": pre_out,
                    "decode": dec_out}
        ready, stop = os.path.join(tmp, "ready"), os.path.join(tmp, "stop")
        pre = _role("prefill", common, tmp, procs, "--ready-file", ready, "--stop-file", stop)
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if pre.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the prefill process did not get ready")
            time.sleep(0.02)
        with open(ready) as f:
            port = f.read()
        dec_out = _finished(_role("decode", common, tmp, procs, "--port", port), "decode", tmp, timeout)
        open(stop, "w").close()
        pre_out = _finished(pre, "prefill", tmp, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if pool is not None:
            pool.stop()
    return {"prompts": prompts, "seed": seed, "tier": tier, "backend": backend, "prefill": pre_out, "decode": dec_out}


def render(report: dict[str, Any]) -> str:
    """The table ``kvtiers demo --scenario pd`` prints."""
    pre, dec = report["prefill"], report["decode"]
    if report.get("tier") == "mooncake":
        first = "prefill: device -> host arena -> mooncake pool"
        seconds = pre["arena_seconds"] + pre["drain_seconds"]
        names = {"host": "decode: own host cache -> device", "mooncake": "decode: mooncake pool -> device"}
        summary = f"{report['prompts']} prompts over one Mooncake pool (master {report['master']});"
    else:
        first, seconds = "prefill: device -> host arena (stored)", pre["seconds"]
        via = "p2p (nixl)" if dec.get("data_path", report.get("backend")) == "nixl" else "p2p"
        names = {"p2p": f"decode: prefill's arena -> {via} -> device", "host": "decode: own host cache -> device"}
        summary = f"{report['prompts']} prompts; prefill served {pre['served']} chunks over p2p;"
    width = max(47, len(first))
    lines = [f"{'path':<{width}} {'chunks':>7} {'GB/s':>8}",
             f"{first:<{width}} {pre['chunks']:>7} {pre['bytes'] / max(seconds, 1e-9) / 1e9:>8.3f}"]
    for src, n in sorted(dec["sources"].items()):
        secs = dec["seconds"].get(src)
        rate = f"{dec['bytes'][src] / secs / 1e9:>8.3f}" if secs else f"{'-':>8}"
        lines.append(f"{names.get(src, 'decode: ' + src):<{width}} {n:>7} {rate}")
    lines.append(f"{summary} decode verified "
                 f"{dec['chunks']} chunks: {dec['mismatches']} mismatches, {dec['failed']} failed loads")
    return "\n".join(lines)


def pd_command(*, prompts: int, seed: int, device: str | None, as_json: bool, backend: str = "zmq",
               tier: str = "p2p", master: str | None = None) -> None:
    """What ``kvtiers demo --scenario pd [--tier mooncake]`` does: run, print, exit 1 on any bad byte."""
    import click

    if tier == "mooncake":
        from kvtiers_mooncake.client import missing

        why = missing()
        if why is not None:
            raise click.ClickException(f"--tier mooncake: {why}")
    elif backend == "nixl":
        from kvtiers_p2p.nixl_path import available

        why = available()
        if why is not None:
            raise click.ClickException(f"--p2p-backend nixl: {why}")
    report_pd(lambda: run_pd(prompts=prompts, seed=seed, device=device, backend=backend, tier=tier, master=master),
              as_json)


def report_pd(run: Any, as_json: bool, table: Any = None) -> None:
    """Run a PD scenario (``run()`` returns its report), print it as JSON or as ``table(report)``
    (default: :func:`render`), exit 1 on any bad byte."""
    import click

    try:
        report = run()
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report) if as_json else (table or render)(report))
    dec = report["decode"]
    if dec["mismatches"] or dec["failed"]:
        click.echo(f"kvtiers demo: {dec['mismatches']} mismatched and {dec['failed']} failed chunk(s)", err=True)
        raise click.exceptions.Exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtiers.commands.demo.pd")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--tier", choices=TRANSPORTS, default="p2p")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device")
    ap.add_argument("--port", type=int)
    ap.add_argument("--master")
    ap.add_argument("--ready-file")
    ap.add_argument("--stop-file")
    ap.add_argument("--serve-seconds", type=float, default=600.0)
    ap.add_argument("--backend", choices=["zmq", "nixl"], default="zmq")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.tier == "mooncake" and not args.master:
        ap.error("--tier mooncake needs --master")
    result = (prefill if args.role == "prefill" else decode)(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
