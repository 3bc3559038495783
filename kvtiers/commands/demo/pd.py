"""``kvtiers demo --scenario pd``: prefill/decode disaggregation over the p2p tier.

Two real processes on loopback. The *prefill* process computes the KV of every prompt (a
simulated engine, bytes derived from the chunk keys as in ``kvtiers demo``), stores it into
its host arena and serves that arena to peers (the manager's ``serve`` block). The *decode*
process, whose only tier is ``p2p`` pointing at the prefill process, looks each prompt up,
loads its chunks into its own device blocks and checks every byte. Prompts share a system
prompt, so after the first one those chunks come from decode's own host cache. The parent
prints one row per path: chunks and GB/s. Exit 1 on any mismatch or failed load.
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


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Compute and store every prompt's chunks, then serve them until the stop file appears."""
    prompts = _prompts(args.prompts, args.seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    per_prompt = len(prompts[0]) // tpc
    engine = SimEngine(pick_device(args.device), per_prompt * BLOCKS_PER_CHUNK, args.seed)
    unique = per_prompt + (args.prompts - 1) * (UNIQUE_TOKENS // tpc)
    serve = {"bind": "tcp://127.0.0.1:0", "nixl": args.backend == "nixl"}
    mgr = _manager(engine, {"serve": serve}, unique + 8, args.seed)
    stored = 0
    seconds = 0.0
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
        port = int(mgr.serve.endpoint.rsplit(":", 1)[1])
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(args.ready_file + ".tmp", args.ready_file)
        deadline = time.monotonic() + args.serve_seconds
        while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
            mgr.poll()  # an engine step: answers the peers' lookups and pins
            time.sleep(0.0005)
        served = mgr.serve.served
        path = "nixl" if mgr.serve.nixl is not None else "zmq"  # zmq also where NIXL's canary failed
    finally:
        mgr.close()
    return {"chunks": stored, "bytes": stored * mgr.chunk_bytes, "seconds": seconds, "served": served,
            "data_path": path}


def decode(args: argparse.Namespace) -> dict[str, Any]:
    """Pull every prompt's chunks from the prefill process and check each byte."""
    prompts = _prompts(args.prompts, args.seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    per_prompt = len(prompts[0]) // tpc
    engine = SimEngine(pick_device(args.device), per_prompt * BLOCKS_PER_CHUNK, args.seed)
    tier = {"type": "p2p", "host": "127.0.0.1", "port": args.port, "backend": args.backend}
    mgr = _manager(engine, {"tiers": [tier]}, 2 * per_prompt, args.seed)
    out: dict[str, Any] = {"sources": {}, "bytes": {}, "seconds": {}, "mismatches": 0, "failed": 0, "chunks": 0,
                           "data_path": mgr.tiers[0].handle.tier.data_path}
    try:
        for tokens in prompts:
            keys = chunk_keys(tokens, tpc, args.seed)
            deadline = time.monotonic() + 30
            while (found := mgr.lookup(keys)).num_chunks < len(keys):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"decode: only {found.num_chunks} of {len(keys)} chunks found on the peer")
                mgr.poll()
                time.sleep(0.001)
            blocks = engine.alloc(len(keys) * BLOCKS_PER_CHUNK)
            t0 = time.perf_counter()
            (res,) = mgr.wait([mgr.load(keys, blocks)], timeout=60)
            dt = time.perf_counter() - t0
            out["failed"] += len(res.failed_keys)
            good = [k for k in keys if k not in res.failed_keys]
            idx = [i for i, k in enumerate(keys) if k not in res.failed_keys]
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


def run_pd(*, prompts: int, seed: int, device: str | None, timeout: float = 300.0,
           backend: str = "zmq") -> dict[str, Any]:
    """Start the prefill and decode processes, wait for both, return what they measured.
    ``backend``: the p2p data path, ``zmq`` or ``nixl`` (nixl-cu12 on both sides)."""
    tmp = tempfile.mkdtemp(prefix="kvtiers-pd-")
    ready, stop = os.path.join(tmp, "ready"), os.path.join(tmp, "stop")
    common = ["--prompts", str(prompts), "--seed", str(seed), "--backend", backend]
    common += ["--device", device] if device else []
    me = [sys.executable, "-m", "kvtiers.commands.demo.pd"]
    procs: list[subprocess.Popen] = []
    try:
        pre = subprocess.Popen([*me, "prefill", *common, "--ready-file", ready, "--stop-file", stop,
                                "--out", os.path.join(tmp, "prefill.json")], stdin=subprocess.DEVNULL)
        procs.append(pre)
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if pre.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the prefill process did not get ready")
            time.sleep(0.02)
        with open(ready) as f:
            port = int(f.read())
        dec = subprocess.Popen([*me, "decode", *common, "--port", str(port), "--out", os.path.join(tmp, "decode.json")],
                               stdin=subprocess.DEVNULL)
        procs.append(dec)
        if dec.wait(timeout) != 0:
            raise RuntimeError(f"the decode process failed (exit {dec.returncode})")
        open(stop, "w").close()
        if pre.wait(60) != 0:
            raise RuntimeError(f"the prefill process failed (exit {pre.returncode})")
        with open(os.path.join(tmp, "prefill.json")) as f:
            pre_out = json.load(f)
        with open(os.path.join(tmp, "decode.json")) as f:
            dec_out = json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"prompts": prompts, "seed": seed, "backend": backend, "prefill": pre_out, "decode": dec_out}


def render(report: dict[str, Any]) -> str:
    """The table ``kvtiers demo --scenario pd`` prints."""
    pre, dec = report["prefill"], report["decode"]
    lines = [f"{'path':<47} {'chunks':>7} {'GB/s':>8}",
             f"{'prefill: device -> host arena (stored)':<47} {pre['chunks']:>7} "
             f"{pre['bytes'] / max(pre['seconds'], 1e-9) / 1e9:>8.3f}"]
    via = "p2p (nixl)" if dec.get("data_path", report.get("backend")) == "nixl" else "p2p"
    names = {"p2p": f"decode: prefill's arena -> {via} -> device", "host": "decode: own host cache -> device"}
    for src, n in sorted(dec["sources"].items()):
        secs = dec["seconds"].get(src)
        rate = f"{dec['bytes'][src] / secs / 1e9:>8.3f}" if secs else f"{'-':>8}"
        lines.append(f"{names.get(src, 'decode: ' + src):<47} {n:>7} {rate}")
    lines.append(f"{report['prompts']} prompts; prefill served {pre['served']} chunks over p2p; decode verified "
                 f"{dec['chunks']} chunks: {dec['mismatches']} mismatches, {dec['failed']} failed loads")
    return "\n".join(lines)


def pd_command(*, prompts: int, seed: int, device: str | None, as_json: bool, backend: str = "zmq") -> None:
    """What ``kvtiers demo --scenario pd`` does: run, print, exit 1 on any bad byte."""
    import click

    if backend == "nixl":
        from kvtiers_p2p.nixl_path import available

        why = available()
        if why is not None:
            raise click.ClickException(f"--p2p-backend nixl: {why}")
    report_pd(lambda: run_pd(prompts=prompts, seed=seed, device=device, backend=backend), as_json)


def report_pd(run: Any, as_json: bool, table: Any = None) -> None:
    """Run a PD scenario (``run()`` returns its report), print it as JSON or as ``table(report)``
    (default: this scenario's :func:`render`), exit 1 on any bad byte."""
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
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device")
    ap.add_argument("--port", type=int)
    ap.add_argument("--ready-file")
    ap.add_argument("--stop-file")
    ap.add_argument("--serve-seconds", type=float, default=600.0)
    ap.add_argument("--backend", choices=["zmq", "nixl"], default="zmq")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = (prefill if args.role == "prefill" else decode)(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
