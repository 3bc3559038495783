"""Admission on a serving trace, through the manager (docs/admission.md#what-it-saves).

A synthetic trace of requests, each a prompt of chunk keys: a share starts with one of a few
shared prefixes (system prompts, few-shot headers) followed by a tail of its own, the rest are
one-shot prompts no later request repeats. Each request asks the manager how much of its
prompt it can load, loads that, "computes" the rest (a sleep per chunk: the accelerator's
time, not this machine's CPU) and stores the computed chunks, as an engine does. Run once per
``"admit"`` option on the same trace, against a real fs tier on a host arena smaller than the
trace: bytes written to the tier, hit rate and requests per second.

Torch only inside functions (CPU tensors stand in for the device KV cache); no vLLM.
``python -m kvtiers.commands.bench.admission`` prints a JSON line per run.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Trace", "make_trace", "run_trace"]


@dataclass(frozen=True)
class Trace:
    """Requests, each a tuple of chunk keys."""

    requests: tuple[tuple[bytes, ...], ...]

    @property
    def offers(self) -> int:
        return sum(len(r) for r in self.requests)


def make_trace(*, requests: int = 400, chunks: int = 8, prefixes: int = 16, prefix_chunks: int = 6,
               shared: float = 0.5, seed: int = 0) -> Trace:
    """``requests`` prompts of ``chunks`` chunks; a ``shared`` share starts with one of
    ``prefixes`` prefixes of ``prefix_chunks`` chunks (chosen with a Zipf-like skew)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(prefixes)]
    out = []
    for r in range(requests):
        if rng.random() < shared:
            p = rng.choices(range(prefixes), weights)[0]
            head = [b"prefix-%d-%d" % (p, i) for i in range(prefix_chunks)]
        else:
            head = []
        tail = [b"req-%d-%d" % (r, i) for i in range(chunks - len(head))]
        out.append(tuple(head + tail))
    return Trace(tuple(out))


def run_trace(trace: Trace, *, admit: dict[str, Any] | None, root: Path, host_chunks: int = 48,
              blocks_per_chunk: int = 4, compute_s_per_chunk: float = 0.002) -> dict[str, Any]:
    """Serve ``trace`` through a :class:`~kvtiers.engine.manager.TieringManager` with one fs tier
    under ``root`` (``admit``: its ``"admit"`` option). Returns the bytes written to fs, the
    chunks loaded by source, the hit rate, the reuse ceiling and requests per second."""
    import torch

    from ...engine.manager import Request, TieringManager

    layers, block_shape = 4, (16, 8, 64)  # 16 tokens x 8 heads x 64 dims, fp16: 16 KiB a block per tensor
    device_chunks = 16  # a request's worth of chunks at a time
    kv = {"kv": [[torch.zeros((device_chunks * blocks_per_chunk, *block_shape), dtype=torch.float16)
                  for _ in range(2)] for _ in range(layers)]}
    for layer in kv["kv"]:
        for t in layer:
            t.normal_()
    chunk_bytes = layers * 2 * blocks_per_chunk * 16 * 8 * 64 * 2
    tier: dict[str, Any] = {"type": "fs", "root_dir": str(root)}
    if admit is not None:
        tier["admit"] = admit
    config = {"host_bytes": host_chunks * chunk_bytes, "blocks_per_chunk": blocks_per_chunk, "tiers": [tier],
              "metrics": {"enable": False}}
    mgr = TieringManager.from_config(config, kv, tokens_per_block=16)
    try:
        computed = loaded = 0
        t0 = time.perf_counter()
        for i, keys in enumerate(trace.requests):
            req = Request(f"r{i}")
            look = mgr.lookup(keys)
            while look.retry:
                mgr.poll()
                time.sleep(0.0005)
                look = mgr.lookup(keys)
            n = look.num_chunks
            blocks = [list(range(j * blocks_per_chunk, (j + 1) * blocks_per_chunk)) for j in range(len(keys))]
            if n:
                (res,) = mgr.wait([mgr.load(keys[:n], blocks[:n], req)])
                n = len(keys[:n]) if res.ok else next(j for j, k in enumerate(keys) if k in res.failed_keys)
            loaded += n
            computed += len(keys) - n
            time.sleep(compute_s_per_chunk * (len(keys) - n))  # the accelerator computes the rest
            if n < len(keys):
                mgr.wait([mgr.store(keys[n:], blocks[n:], req)])
        while mgr.pending():
            mgr.poll()
            time.sleep(0.001)
        seconds = time.perf_counter() - t0
        stats = mgr.stats
        written = stats.paths["host->fs"].nbytes if "host->fs" in stats.paths else 0
        adm = mgr.tiers[0].admission
        return {
            "admit": admit, "requests": len(trace.requests), "offers": trace.offers,
            "fs_write_bytes": written, "fs_write_chunks": written // chunk_bytes,
            "loaded_chunks": loaded, "computed_chunks": computed, "hits_by_source": dict(stats.hits),
            "hit_rate": loaded / trace.offers, "reuse_ceiling": mgr.reuse.ceiling("1h"),
            "seconds": seconds, "req_per_s": len(trace.requests) / seconds,
            "admission": adm.describe() if adm is not None else None,
        }
    finally:
        mgr.close()


def main(argv: list[str] | None = None) -> int:
    """Each admission option on the same trace, ``rounds`` times interleaved (a busy machine's
    noise hits every option alike); one JSON line per run, then each option's median against
    admitting everything. Arguments: ``[requests [rounds]]`` (default 400 3)."""
    args = argv if argv is not None else sys.argv[1:]
    requests = int(args[0]) if args else 400
    rounds = int(args[1]) if len(args) > 1 else 3
    trace = make_trace(requests=requests)
    options: list[dict[str, Any] | None] = [None, {"min_offers": 2}, {"when": "evicted"},
                                            {"min_offers": 2, "when": "evicted"}]
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(options))}
    for _ in range(rounds):
        for i, admit in enumerate(options):
            root = Path(tempfile.mkdtemp(prefix="kvtiers-admit-"))
            try:
                r = run_trace(trace, admit=admit, root=root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs[i].append(r)
            print(json.dumps(r), flush=True)
    med = {i: statistics.median(r["req_per_s"] for r in rs) for i, rs in runs.items()}
    base = runs[0][0]
    for i, admit in enumerate(options[1:], 1):
        r = runs[i][0]
        print(json.dumps({"admit": admit, "fs_bytes_vs_all": r["fs_write_bytes"] / max(1, base["fs_write_bytes"]),
                          "hit_rate": r["hit_rate"], "hit_rate_all": base["hit_rate"],
                          "req_per_s_vs_all": med[i] / med[0], "rounds": rounds}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
