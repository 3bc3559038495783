"""``kvtiers bench arena``: DMA-engine chunk copies against a raw copy of the same bytes.

Flat layout, 32 layers, K and V; each chunk is 64 contiguous pieces (one per layer and K/V)
of ``chunk_bytes / 64`` bytes (16 KiB for 1 MiB chunks). One round moves ``--chunks`` chunks
device -> arena (``store``) and back (``load``) through :class:`kvtiers.engine.dma.DmaEngine`, and
the same total bytes with one raw copy between the same two buffers: ``np.copyto`` on CPU,
``Tensor.copy_(non_blocking=True)`` + synchronize on an accelerator. Rounds interleave ours
and the baseline (alternating which goes first); the figures are medians.

``--clock cpu`` (CPU only) times the CPU time of the calling thread instead of the wall clock,
with the engine on that one thread (``cpu_threads=1``): on a shared machine whose load is
above its core count the wall clock mostly measures waits for a core; CPU time does not
(memory and cache contention still show, on both sides alike).

The device cache is either one allocation per model with per-layer views (``pooled``, the
default, as engines that allocate one KV pool do) or one allocation per layer tensor
(``separate``, as vLLM allocates): on CPU one strided copy per tensor per run of chunks.

``--model hybrid-swa`` / ``hybrid-ssm`` run the same rounds on a hybrid layout (half the
layers sliding-window with a window of a quarter of the transfer; or a quarter attention,
the rest Mamba layers with a conv and a recurrent state): stores copy whole chunks, loads
only the window's blocks / the last chunk's state. The baseline copies as many bytes as
ours moves, and the table shows what a load copies against whole chunks.

torch is imported inside functions only: ``kvtiers`` imports without it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

MiB = 1 << 20
LAYERS = 32
PIECES = LAYERS * 2
SAMPLE_S = 0.02  # seconds one timed sample of the baseline lasts at least


@dataclass
class Setup:
    """One chunk size's device cache, arena and engine."""

    chunk_bytes: int
    chunks: int
    tensors: str
    device: Any
    host: Any
    engine: Any
    pool_flat: Any  # the device cache's bytes, flat (the baseline's source/destination)
    arena_flat: Any  # the arena's bytes the round covers, flat
    model: str = "dense"
    plans: dict[str, list[Any]] | None = None  # op -> chunks (hybrids); None: every block of every chunk
    op_bytes: dict[str, int] | None = None  # op -> bytes one round moves (hybrids)

    def close(self) -> None:
        self.engine.close()
        self.host.close()


def make_setup(chunk_bytes: int, chunks: int, tensors: str = "pooled", device: str = "cpu",
               **engine_options: Any) -> Setup:
    """Build a flat 32-layer KV cache of ``chunks`` chunks, an arena of as many slots, an engine
    (``engine_options`` go to :class:`~kvtiers.engine.dma.DmaEngine`)."""
    import numpy as np
    import torch

    from ...engine.arena import create_host_arena, slot_bytes_for
    from ...engine.dma import DmaEngine
    from ...engine.layout import KVLayout

    if chunk_bytes % (PIECES * 4096):
        raise click.BadParameter(f"chunk size must be a multiple of {PIECES * 4096} (64 pieces of 4 KiB pages)")
    piece = chunk_bytes // PIECES
    block_bytes = min(piece, 16 * 1024)  # 16 KiB blocks; chunks of several blocks
    bpc = piece // block_bytes
    dev = torch.device(device)
    nblocks = chunks * bpc
    layout = KVLayout.flat(LAYERS, block_bytes)
    gen = torch.Generator().manual_seed(chunk_bytes)
    if tensors == "pooled":
        pool = torch.randint(0, 256, (LAYERS, 2, nblocks, block_bytes), dtype=torch.uint8, generator=gen).to(dev)
        caches = {"kv": [[pool[li, 0], pool[li, 1]] for li in range(LAYERS)]}
        pool_flat = pool.view(-1)
    else:
        caches = {"kv": [[torch.randint(0, 256, (nblocks, block_bytes), dtype=torch.uint8, generator=gen).to(dev)
                          for _ in range(2)] for _ in range(LAYERS)]}
        # the same number of bytes in one buffer, filled: untouched pages would read as the zero page
        pool_flat = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8, generator=gen).to(dev)
    host = create_host_arena(chunks, slot_bytes_for(layout.chunk_bytes(bpc)))
    engine = DmaEngine(layout, caches, host, bpc, **engine_options)
    if dev.type == "cpu":
        arena_flat = np.asarray(host.ndarray()).reshape(-1)[: chunks * chunk_bytes]
    else:
        arena_flat = host.tensor().view(-1)[: chunks * chunk_bytes]
    return Setup(chunk_bytes, chunks, tensors, dev, host, engine, pool_flat, arena_flat)


def make_hybrid_setup(model: str, chunk_bytes: int, chunks: int, device: str = "cpu", **engine_options: Any) -> Setup:
    """A hybrid layout (separate tensors per layer, 16 KiB blocks of 16 tokens) of about
    ``chunk_bytes`` per chunk, with store and load plans as the manager builds them
    (``engine_options`` go to :class:`~kvtiers.engine.dma.DmaEngine`)."""
    import numpy as np
    import torch

    from ...engine.arena import create_host_arena, slot_bytes_for
    from ...engine.dma import DmaEngine
    from ...engine.hybrid import chunk_specs, copied_bytes
    from ...engine.layout import KVGroup, KVLayout

    block, tpb = 16 * 1024, 16
    dev = torch.device(device)
    if model == "hybrid-swa":
        bpc = max(1, chunk_bytes // (PIECES * block))
        window = max(tpb, chunks * bpc * tpb // 4)
        groups = [KVGroup("full", LAYERS // 2, 2, block), KVGroup("swa", LAYERS // 2, 2, block, kind="sliding",
                                                                   window=window)]
    elif model == "hybrid-ssm":
        bpc = max(1, chunk_bytes // (LAYERS // 2 * block))
        groups = [KVGroup("attn", LAYERS // 4, 2, block), KVGroup("conv", LAYERS * 3 // 4, 1, 4096, kind="ssm"),
                  KVGroup("ssm", LAYERS * 3 // 4, 1, 64 * 1024, kind="ssm")]
    else:
        raise click.BadParameter(f"unknown model {model!r}")
    layout = KVLayout(groups)
    nblocks = chunks * bpc
    gen = torch.Generator().manual_seed(chunk_bytes)
    caches = {g.name: [[torch.randint(0, 256, (chunks if g.is_state else nblocks, g.block_bytes), dtype=torch.uint8,
                                      generator=gen).to(dev) for _ in range(g.tensors_per_layer)]
                       for _ in range(g.num_layers)] for g in groups}
    cb = layout.chunk_bytes(bpc)
    host = create_host_arena(chunks, slot_bytes_for(cb))
    engine = DmaEngine(layout, caches, host, bpc, **engine_options)
    keys = tuple(c.to_bytes(8, "little") for c in range(chunks))
    blocks = list(range(nblocks))
    states = list(range(chunks)) if layout.groups[-1].is_state else None
    store = chunk_specs(layout, keys, blocks, bpc, load=False, state_slots=states, tokens_per_block=tpb)
    load = chunk_specs(layout, keys, blocks, bpc, load=True, state_slot=0 if states else None, tokens_per_block=tpb)
    op_bytes = {"store": sum(copied_bytes(layout, bpc, x) for x in store),
                "load": sum(copied_bytes(layout, bpc, x) for x in load)}
    pool_flat = torch.randint(0, 256, (chunks * cb,), dtype=torch.uint8, generator=gen).to(dev)
    if dev.type == "cpu":
        arena_flat = np.asarray(host.ndarray()).reshape(-1)[: chunks * cb]
    else:
        arena_flat = host.tensor().view(-1)[: chunks * cb]
    return Setup(cb, chunks, "separate", dev, host, engine, pool_flat, arena_flat, model,
                 {"store": [(x, c) for c, x in enumerate(store)], "load": [(x, c) for c, x in enumerate(load)]},
                 op_bytes)


def _timers(s: Setup) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """op -> (ours, baseline), each moving chunks * chunk_bytes bytes and returning when done."""
    import numpy as np

    eng = s.engine
    bpc = eng.blocks_per_chunk
    plan = [(list(range(c * bpc, (c + 1) * bpc)), c) for c in range(s.chunks)]
    counter = iter(range(1 << 62))

    plans = s.plans or {"store": plan, "load": plan}
    nb = s.op_bytes or {"store": s.chunks * s.chunk_bytes, "load": s.chunks * s.chunk_bytes}

    def run(submit: Callable[[int, Any], None], op: str) -> None:
        tid = next(counter)
        submit(tid, plans[op])
        eng.wait(tid)
        done = eng.poll()
        assert tid in done, (tid, done)

    if s.device.type == "cpu":
        pool_np = s.pool_flat.numpy()

        def base_store() -> None:
            np.copyto(s.arena_flat[: nb["store"]], pool_np[: nb["store"]])

        def base_load() -> None:
            np.copyto(pool_np[: nb["load"]], s.arena_flat[: nb["load"]])
    else:
        import torch

        def base_store() -> None:
            s.arena_flat[: nb["store"]].copy_(s.pool_flat[: nb["store"]], non_blocking=True)
            torch.accelerator.synchronize(s.device)

        def base_load() -> None:
            s.pool_flat[: nb["load"]].copy_(s.arena_flat[: nb["load"]], non_blocking=True)
            torch.accelerator.synchronize(s.device)

    return {
        "store": (lambda: run(eng.submit_store, "store"), base_store),
        "load": (lambda: run(eng.submit_load, "load"), base_load),
    }


def measure(s: Setup, rounds: int, clock: str = "wall") -> list[dict[str, Any]]:
    """Interleaved rounds (plus one warm-up) of ours vs the baseline; medians. ``clock``:
    ``wall``, or ``cpu`` (the calling thread's CPU time)."""
    total = s.chunks * s.chunk_bytes
    now = time.thread_time if clock == "cpu" else time.perf_counter
    timers = _timers(s)
    # One transfer of a few MiB takes ~1 ms, shorter than the scheduling noise of a busy
    # machine: each sample repeats the same transfer (same bytes, same buffers) `reps`
    # times, enough for the baseline to run >= SAMPLE_S; ours and the baseline alike.
    _, probe = timers["store"]
    probe()
    t0 = time.perf_counter()
    probe()
    reps = max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, tuple[list[float], list[float]]] = {op: ([], []) for op in timers}
    for r in range(rounds + 1):
        for op, (ours, base) in timers.items():
            order = [(0, ours), (1, base)] if r % 2 else [(1, base), (0, ours)]
            for which, fn in order:
                t0 = now()
                for _ in range(reps):
                    fn()
                dt = (now() - t0) / reps
                if r:  # round 0 warms up
                    times[op][which].append(dt)
    out = []
    for op, (ours_t, base_t) in times.items():
        moved = s.op_bytes[op] if s.op_bytes else total
        gbps = moved / statistics.median(ours_t) / 1e9
        bgbps = moved / statistics.median(base_t) / 1e9
        out.append({
            "op": op, "chunk_bytes": s.chunk_bytes, "gbps": round(gbps, 3), "baseline_gbps": round(bgbps, 3),
            "ratio": round(gbps / bgbps, 3), "tensors": s.tensors, "chunks": s.chunks, "bytes": moved,
            "full_bytes": total, "model": s.model,
            "rounds": rounds, "reps": reps, "device": str(s.device), "clock": clock,
            "baseline": "np.copyto" if s.device.type == "cpu" else "torch copy_ (pinned, non_blocking) + sync",
        })
    return out


def run_bench(chunk_sizes: list[int], chunks: int, rounds: int, tensors: list[str], device: str,
              model: str = "dense", clock: str = "wall") -> list[dict]:
    results = []
    opts = {"cpu_threads": 1} if clock == "cpu" else {}
    for t in tensors if model == "dense" else ["separate"]:
        for cb in chunk_sizes:
            s = (make_setup(cb, chunks, t, device, **opts) if model == "dense"
                 else make_hybrid_setup(model, cb, chunks, device, **opts))
            try:
                results.extend(measure(s, rounds, clock))
            finally:
                s.close()
    return results


@click.command("arena")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--rounds", type=click.IntRange(3, None), default=5, show_default=True,
              help="Timed rounds (the median is reported); at least 3.")
@click.option("--chunk-mib", "chunk_mib", type=click.IntRange(1, None), multiple=True, default=(1, 4),
              show_default=True, help="Chunk size in MiB (repeatable).")
@click.option("--chunks", type=click.IntRange(1, None), default=16, show_default=True,
              help="Chunks per transfer (one round moves chunks x chunk size each way).")
@click.option("--tensors", type=click.Choice(["pooled", "separate", "both"]), default="both", show_default=True,
              help="Device cache: one allocation with per-layer views, one per layer tensor, or both.")
@click.option("--device", default="cpu", show_default=True,
              help="Where the KV cache lives: cpu, or an accelerator (cuda, xpu, ...).")
@click.option("--model", type=click.Choice(["dense", "hybrid-swa", "hybrid-ssm"]), default="dense",
              show_default=True, help="KV layout (hybrids: separate tensors, window-only / last-state loads).")
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="cpu: time the calling thread's CPU time, the engine on that one thread (CPU only; for a "
                   "machine loaded past its cores).")
def arena(as_json: bool, rounds: int, chunk_mib: tuple[int, ...], chunks: int, tensors: str, device: str,
          model: str, clock: str) -> None:
    """Device<->arena chunk copies (flat, 32 layers, K and V) against one raw copy of the same bytes."""
    from ..requires import require

    require("kvtiers bench arena", "torch")
    if clock == "cpu" and device != "cpu":
        raise click.BadParameter("--clock cpu times CPU copies only; use --device cpu", param_hint="--clock")
    kinds = ["pooled", "separate"] if tensors == "both" else [tensors]
    results = run_bench([m * MiB for m in chunk_mib], chunks, rounds, kinds, device, model, clock)
    if as_json:
        click.echo(json.dumps({"results": results}, indent=1))
        return
    base = results[0]["baseline"] if results else ""
    click.echo(f"kvtiers bench arena: {LAYERS} layers x K,V, {chunks} chunks per transfer, "
               f"median of {rounds} rounds, baseline {base}"
               + (", CPU time of one thread" if clock == "cpu" else ""))
    if model != "dense":
        click.echo(f"model {model}: per round, what each op copies of {results[0]['full_bytes'] / MiB:.1f} MiB "
                   "in whole chunks (the baseline copies as many bytes)")
        click.echo(f"{'op':<6} {'chunk':>9} {'copied MiB':>11} {'GB/s':>8} {'base GB/s':>10} {'ratio':>6}")
        for r in results:
            click.echo(f"{r['op']:<6} {r['chunk_bytes'] / MiB:>7.2f}Mi {r['bytes'] / MiB:>11.1f} {r['gbps']:>8.2f} "
                       f"{r['baseline_gbps']:>10.2f} {r['ratio']:>5.2f}x")
        return
    click.echo(f"{'op':<6} {'tensors':<9} {'chunk':>7} {'piece':>7} {'GB/s':>8} {'base GB/s':>10} {'ratio':>6}")
    for r in results:
        mib, kib = r["chunk_bytes"] // MiB, r["chunk_bytes"] // PIECES // 1024
        click.echo(f"{r['op']:<6} {r['tensors']:<9} {mib:>5}Mi {kib:>5}Ki "
                   f"{r['gbps']:>8.2f} {r['baseline_gbps']:>10.2f} {r['ratio']:>5.2f}x")
