#!/usr/bin/env python3
"""GPU check for the engine side: DMA round trips through every layout, and GB/s.

    python3 scripts/gpu_check.py                 # the current accelerator (CUDA, ROCm, XPU, ...)
    python3 scripts/gpu_check.py --device cpu    # the same script on CPU tensors (self-test)

1. Correctness: a pinned host arena; flat K/V, MLA and a two-group (target + draft) layout;
   device tensors pooled (one allocation), separate (one per layer tensor) and unaligned
   (separate, at small odd offsets: the engine's span rows shrink to a few bytes); staged
   batches of many chunks and of one chunk. Each case stores
   full, partial, non-consecutive and reversed chunks into a poisoned arena, checks every
   byte of the slots, poisons the device, loads into other blocks and checks every byte of
   every block. One more case writes the cache on the compute stream and stores at once (the
   store stream must wait for it). A hybrid case puts every group kind in one chunk (full
   attention fp8, sliding window bf16, MLA + indexer, Mamba conv and recurrent states fp32,
   blocks per group), stores whole chunks and loads with skipped window blocks and the last
   state only, checking the copied bytes and that nothing skipped was written.
2. Throughput: flat, 32 layers, K and V, 1 and 4 MiB chunks (16 and 64 KiB pieces), 64 chunks
   per transfer: DmaEngine store/load GB/s against one raw pinned copy of the same bytes
   (``dst.copy_(src, non_blocking=True)`` + synchronize), interleaved, median of 5.

Prints a table and exits non-zero on any mismatch. Needs only torch and numpy beside this
repository (it puts the repository root on sys.path). Well under 3 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtiers.commands.bench.arena import make_setup  # noqa: E402
from kvtiers.engine.arena import create_host_arena, slot_bytes_for  # noqa: E402
from kvtiers.engine.dma import DmaEngine  # noqa: E402
from kvtiers.engine.layout import KVGroup, KVLayout  # noqa: E402

POISON = 0xA5
NUM_BLOCKS = 96
BPC = 4
LAYOUTS = {
    "flat": (KVLayout.flat(4, 16 * 8 * 128 * 2), torch.bfloat16),
    "mla": (KVLayout.mla(3, 16 * 576 * 2), torch.float16),
    "multi": (KVLayout.multi([KVGroup("target", 4, 2, 8192), KVGroup("draft", 1, 2, 2048)]), torch.float8_e4m3fn
              if hasattr(torch, "float8_e4m3fn") else torch.int8),
}
STORE = [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 1), ([10, 11, 12], 2), ([20, 7, 30, 5], 3), ([43, 42, 41, 40], 5),
         ([44], 6), ([50, 52, 54, 56], 7), ([60, 61, 62, 63], 8)]
LOAD = [([64, 65, 66, 67], 0), ([68, 69, 70, 71], 1), ([8, 9, 13], 2), ([72, 74, 76, 78], 3),
        ([14, 15, 16, 17], 5), ([95], 6), ([80, 81, 82, 83], 7), ([84, 86, 85, 87], 8)]


def make_caches(layout: KVLayout, dtype: torch.dtype, pooled: bool | str, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    caches = {}
    for grp in layout.groups:
        shape = (grp.num_layers, grp.tensors_per_layer, NUM_BLOCKS, grp.block_bytes)
        if pooled == "unaligned":  # separate buffers, tensors at 0, 1, 2 elements from their starts
            esz = torch.empty(0, dtype=dtype).element_size()
            caches[grp.name] = []
            for li in range(grp.num_layers):
                layer = []
                for ti in range(grp.tensors_per_layer):
                    skip = esz * ((li * grp.tensors_per_layer + ti) % 3)
                    buf = torch.randint(0, 256, (skip + NUM_BLOCKS * grp.block_bytes,), dtype=torch.uint8,
                                        generator=g).to(device)
                    layer.append(buf[skip:].view(NUM_BLOCKS, grp.block_bytes).view(dtype))
                caches[grp.name].append(layer)
        elif pooled:
            pool = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device).view(dtype)
            caches[grp.name] = [[pool[li, ti] for ti in range(grp.tensors_per_layer)] for li in range(grp.num_layers)]
        else:
            caches[grp.name] = [
                [torch.randint(0, 256, shape[2:], dtype=torch.uint8, generator=g).to(device).view(dtype)
                 for _ in range(grp.tensors_per_layer)]
                for _ in range(grp.num_layers)]
    return caches


def host_bytes(caches: dict) -> dict:
    """name -> per layer -> per tensor -> uint8 numpy [blocks, block_bytes] on the host."""
    return {n: [[t.view(torch.uint8).cpu().numpy().copy() for t in layer] for layer in layers]
            for n, layers in caches.items()}


def check_case(layout: KVLayout, dtype: torch.dtype, pooled: bool | str, device: torch.device, opts: dict,
               seed: int) -> str | None:
    """One round trip; None if every byte is right, else what was wrong."""
    caches = make_caches(layout, dtype, pooled, device, seed)
    host = create_host_arena(10, slot_bytes_for(layout.chunk_bytes(BPC)), pin=None if device.type != "cpu" else False)
    try:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, BPC, **opts)
        before = host_bytes(caches)
        eng.submit_store(1, STORE)
        eng.wait(1, timeout=60)
        if eng.poll() != [1]:
            return "store not reported exactly once"
        arena = host.ndarray()
        off = 0
        for grp in layout.groups:
            bb = grp.block_bytes
            for li in range(grp.num_layers):
                for ti in range(grp.tensors_per_layer):
                    src = before[grp.name][li][ti]
                    for ids, slot in STORE:
                        for pos, b in enumerate(ids):
                            got = arena[slot, off + pos * bb : off + (pos + 1) * bb]
                            if not np.array_equal(got, src[b]):
                                return f"store: slot {slot} {grp.name} layer {li} tensor {ti} block {b}"
                    off += BPC * bb
        if not ((arena[4] == POISON).all() and (arena[9] == POISON).all()):
            return "store wrote a slot it was not given"
        for layers in caches.values():
            for layer in layers:
                for t in layer:
                    t.view(torch.uint8).fill_(POISON)
        eng.submit_load(2, LOAD)
        eng.wait(2, timeout=60)
        if eng.poll() != [2]:
            return "load not reported exactly once"
        after = host_bytes(caches)
        moved = {}
        for (s_ids, _), (d_ids, _) in zip(STORE, LOAD, strict=True):
            moved.update(zip(d_ids, s_ids, strict=True))
        for grp in layout.groups:
            for li in range(grp.num_layers):
                for ti in range(grp.tensors_per_layer):
                    got = after[grp.name][li][ti]
                    for b in range(NUM_BLOCKS):
                        want = before[grp.name][li][ti][moved[b]] if b in moved else POISON
                        if not np.array_equal(got[b], np.broadcast_to(np.asarray(want, np.uint8), got[b].shape)):
                            return f"load: {grp.name} layer {li} tensor {ti} block {b}"
        eng.close()
        return None
    finally:
        host.close()


def check_stream_order(device: torch.device) -> str | None:
    """Write the cache on the compute stream and store at once: the store must see the write."""
    layout = KVLayout.flat(8, 1 << 20)
    pool = torch.zeros((8, 2, 8, 1 << 20), dtype=torch.uint8, device=device)
    caches = {"kv": [[pool[li, 0], pool[li, 1]] for li in range(8)]}
    host = create_host_arena(2, layout.chunk_bytes(2), pin=None if device.type != "cpu" else False)
    try:
        eng = DmaEngine(layout, caches, host, 2)
        big = torch.full((8, 2, 8, 1 << 20), 7, dtype=torch.uint8, device=device)
        for _ in range(3):  # keep the compute stream busy, then write what the store must see
            big.add_(1).sub_(1)
        pool.copy_(big)
        eng.submit_store(1, [([0, 1], 0)])
        eng.wait(1)
        eng.poll()
        if not (host.ndarray()[0] == 7).all():
            return "store did not wait for the compute stream"
        return None
    finally:
        host.close()


def check_hybrid(device: torch.device, opts: dict, seed: int) -> str | None:
    """Every group kind in one chunk, per-group blocks, skipped positions; None when exact."""
    nb, ns = 48, 12
    f8 = getattr(torch, "float8_e4m3fn", torch.int8)
    spec = {"full": (2, 2, (nb, 16, 2, 8), f8, "full"), "swa": (3, 2, (nb, 16, 2, 8), torch.bfloat16,
                                                                   {"kind": "sliding", "window": 40}),
            "mla": (2, 1, (nb, 16, 36), torch.float16, "mla"), "idx": (2, 1, (nb, 16, 8), torch.int8, "mla_indexer"),
            "conv": (2, 1, (ns, 3, 40), torch.float32, "ssm"), "ssm": (2, 1, (ns, 4, 16, 8), torch.float32, "ssm")}
    g = torch.Generator().manual_seed(seed)

    def caches() -> dict:
        out = {}
        for name, (layers, tpl, shape, dt, _) in spec.items():
            out[name] = [[torch.randint(0, 256, shape[:1] + (int(np.prod(shape[1:])) * torch.empty(0, dtype=dt)
                                                             .element_size(),), generator=g, dtype=torch.uint8)
                          .view(dt).view(shape).to(device) for _ in range(tpl)] for _ in range(layers)]
        return out

    src, dst = caches(), caches()
    layout = KVLayout.from_tensors(src, kinds={n: k for n, (*_, k) in spec.items() if k != "full"})
    attn = ["full", "swa", "mla", "idx"]

    def blk(kv: dict, name: str, b: int) -> bytes:
        return b"".join(t[b].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                        for layer in kv[name] for t in layer)

    host = create_host_arena(8, slot_bytes_for(layout.chunk_bytes(BPC)))
    try:
        a = DmaEngine(layout, src, host, BPC, **opts)
        b = DmaEngine(layout, dst, host, BPC, **opts)
        st, ld = [], []
        for c in range(3):
            n = BPC if c < 2 else 2
            d = {x: [(5 * c + 3 * i + j) % nb for j in range(n)] for i, x in enumerate(attn)}
            d["conv"] = d["ssm"] = [c + 1]
            st.append(d)
            e = {x: [(7 * c + 11 * i + j + 20) % nb for j in range(n)] for i, x in enumerate(attn)}
            if c == 0:
                e["swa"] = [-1, -1] + e["swa"][2:]
            e["conv"] = e["ssm"] = [9] if c == 2 else [-1]
            ld.append(e)
        a.submit_store(1, [(x, i) for i, x in enumerate(st)])
        a.wait(1)
        before = {x: [blk(dst, x, i) for i in range(ns if x in ("conv", "ssm") else nb)] for x in dst}
        b.submit_load(2, [(x, i) for i, x in enumerate(ld)])
        b.wait(2)
        sync(device)
        written: dict[str, set] = {x: set() for x in dst}
        for c in range(3):
            for x in dst:
                for p, i in enumerate(ld[c][x]):
                    if i >= 0:
                        if blk(dst, x, i) != blk(src, x, st[c][x][p]):
                            return f"group {x} chunk {c} position {p}: wrong bytes"
                        written[x].add(i)
        for x in dst:
            for i, old in enumerate(before[x]):
                if i not in written[x] and blk(dst, x, i) != old:
                    return f"group {x} block {i}: written though skipped"
        return None
    finally:
        host.close()


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure(s, device: torch.device, rounds: int, chunks: int) -> dict[str, tuple[float, float]]:
    """op -> (ours GB/s, raw GB/s) for one setup, interleaved, medians."""
    eng = s.engine
    bpc = eng.blocks_per_chunk
    plan = [(list(range(c * bpc, (c + 1) * bpc)), c) for c in range(chunks)]
    src = s.pool_flat
    dst = s.host.tensor().view(-1)[: chunks * s.chunk_bytes]
    tids = iter(range(1 << 40))

    def ours(submit) -> None:
        t = next(tids)
        submit(t, plan)
        eng.wait(t)
        eng.poll()

    def raw(a, b) -> None:
        a.copy_(b, non_blocking=True)
        sync(device)

    out = {}
    for op, mine, base in (("store", lambda: ours(eng.submit_store), lambda: raw(dst, src)),
                           ("load", lambda: ours(eng.submit_load), lambda: raw(src, dst))):
        tm, tr = [], []
        for r in range(rounds + 1):
            for which, fn in ((0, mine), (1, base)) if r % 2 else ((1, base), (0, mine)):
                sync(device)
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if r:  # round 0 warms up
                    (tm if which == 0 else tr).append(dt)
        total = chunks * s.chunk_bytes
        out[op] = (total / statistics.median(tm) / 1e9, total / statistics.median(tr) / 1e9)
    return out


def bench(device: torch.device, rounds: int, chunks: int) -> list[dict]:
    """DmaEngine store/load against one raw pinned copy of the same bytes."""
    rows = []
    strategies = ["staged"] if device.type != "cpu" else ["cpu"]
    for tensors in ("pooled", "separate"):
        for mib in (1, 4):
            for strat in strategies:
                opts: dict = {}
                s = make_setup(mib << 20, chunks, tensors, str(device), **opts)
                try:
                    for op, (g, b) in measure(s, device, rounds, chunks).items():
                        rows.append({"op": op, "tensors": tensors, "chunk_mib": mib, "strategy": strat,
                                     "gbps": g, "raw_gbps": b, "ratio": g / b, "pinned": s.host.pinned})
                finally:
                    s.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, xpu, ... (default: the current accelerator)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=64, help="chunks per transfer in the throughput part")
    args = ap.parse_args()
    if args.device:
        device = torch.device(args.device)
    else:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = acc if acc is not None else torch.device("cpu")
    t_start = time.time()
    print(f"kvtiers gpu_check: torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    failures = 0
    if device.type == "cpu":
        paths = {"cpu": {}, "torch-staged": {"_torch_path_on_cpu": True},
                 "torch-staged-1": {"_torch_path_on_cpu": True, "staging_bytes": 1}}
    else:
        paths = {"staged": {}, "staged-1": {"staging_bytes": 1}}
    print(f"\n{'layout':<7} {'tensors':<9} {'path':<15} result")
    seed = 0
    for name, (layout, dtype) in LAYOUTS.items():
        for pooled in (True, False, "unaligned"):
            for pname, opts in paths.items():
                seed += 1
                try:
                    err = check_case(layout, dtype, pooled, device, opts, seed)
                except Exception:  # noqa: BLE001 - report and go on
                    err = "exception: " + traceback.format_exc().strip().splitlines()[-1]
                    traceback.print_exc()
                failures += err is not None
                kind = pooled if isinstance(pooled, str) else "pooled" if pooled else "separate"
                print(f"{name:<7} {kind:<9} {pname:<15} {'ok' if err is None else 'FAIL ' + err}")
    for pname, opts in paths.items():
        seed += 1
        try:
            err = check_hybrid(device, opts, seed)
        except Exception:  # noqa: BLE001
            err = "exception: " + traceback.format_exc().strip().splitlines()[-1]
            traceback.print_exc()
        failures += err is not None
        print(f"{'hybrid':<7} {'separate':<9} {pname:<15} {'ok' if err is None else 'FAIL ' + err}")
    try:
        err = check_stream_order(device)
    except Exception:  # noqa: BLE001
        err = "exception: " + traceback.format_exc().strip().splitlines()[-1]
        traceback.print_exc()
    failures += err is not None
    print(f"{'stream order (store after a compute-stream write)':<33} {'ok' if err is None else 'FAIL ' + err}")

    print(f"\nthroughput: flat, 32 layers x K,V, {args.chunks} chunks per transfer, median of {args.rounds}; "
          "raw = one pinned copy_(non_blocking) + sync of the same bytes")
    print(f"{'op':<6} {'tensors':<9} {'chunk':>5} {'strategy':<8} {'GB/s':>8} {'raw GB/s':>9} {'ratio':>6}  pinned")
    try:
        for r in bench(device, args.rounds, args.chunks):
            print(f"{r['op']:<6} {r['tensors']:<9} {r['chunk_mib']:>3}Mi {r['strategy']:<8} {r['gbps']:>8.2f} "
                  f"{r['raw_gbps']:>9.2f} {r['ratio']:>5.2f}x  {r['pinned']}")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("throughput part failed (see above)")
    print(f"\n{'FAILED' if failures else 'PASSED'}: {failures} mismatch(es); {time.time() - t_start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
