"""``kvtiers demo`` (the chat scenario): the simulated engine serves multi-turn conversations
through the tiers.

The host arena is small on purpose, so it overflows into the secondary tier (the ``fs`` tier
in a local directory when installed, else the ``memory`` tier), and later turns of a
conversation come back from there; every loaded chunk is checked byte for byte.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from .engine import (
    ASSISTANT_TOKENS,
    BLOCKS_PER_CHUNK,
    HOST_CHUNKS,
    LOOKUP_DEADLINE,
    SYSTEM_TOKENS,
    TOKENS_PER_BLOCK,
    USER_TOKENS,
    Conversation,
    SimEngine,
    Tally,
    chunk_keys,
    pick_device,
)


def default_config(tier_dir: str, slot_bytes: int) -> dict[str, Any]:
    from ...registry import get_registry

    have_fs = any(t.name == "fs" for t in get_registry().tiers())
    tier = {"type": "fs", "root_dir": tier_dir} if have_fs else {"type": "memory"}
    return {
        "host_bytes": HOST_CHUNKS * slot_bytes,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "eviction_policy": "lru",
        "tiers": [tier],
    }


def merge_config(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys of ``override`` replace ours (an alias replaces its target too)."""
    from ...config import VLLM_ALIASES

    out = dict(base)
    for k in override:
        out.pop(VLLM_ALIASES.get(k, k), None)
        for alias, target in VLLM_ALIASES.items():
            if target == k:
                out.pop(alias, None)
    out.update(override)
    return out


def run_demo(*, turns: int, conversations: int, tier_dir: str, override: dict[str, Any], seed: int,
             device_name: str | None, quiet: bool, model: str = "dense") -> tuple[Tally, Any, dict[str, Any]]:
    import random

    from ...engine.arena import slot_bytes_for
    from ...engine.manager import Request, TieringManager

    device = pick_device(device_name)
    rng = random.Random(seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    max_prompt = SYSTEM_TOKENS + turns * (USER_TOKENS[1] + ASSISTANT_TOKENS[1])
    req_blocks = -(-max_prompt // TOKENS_PER_BLOCK)
    if model == "dense":
        engine: Any = SimEngine(device, 3 * req_blocks, seed)
    else:
        from .hybrid import HybridSimEngine

        engine = HybridSimEngine(model, device, 3 * req_blocks, 4 * (req_blocks // BLOCKS_PER_CHUNK + 2),
                                 BLOCKS_PER_CHUNK, TOKENS_PER_BLOCK, seed)
    layout = engine.layout
    cfg = merge_config(default_config(tier_dir, slot_bytes_for(layout.chunk_bytes(BLOCKS_PER_CHUNK))), override)
    mgr = TieringManager.from_config(
        cfg, engine.kv, layout=layout, tokens_per_block=TOKENS_PER_BLOCK,
        namespace_fields={"model": "kvtiers-demo" if model == "dense" else f"kvtiers-demo-{model}",
                          "dtype": "float16", "seed": seed},
    )
    info = {
        "device": str(device), "chunk_bytes": mgr.chunk_bytes, "tokens_per_chunk": tpc,
        "host_slots": len(mgr.arena), "tiers": [t.name for t in mgr.tiers],
        "tier_dir": tier_dir, "namespace": mgr.namespace.digest, "model": model,
    }
    tally = Tally()
    system = [rng.randrange(1, 50_000) for _ in range(SYSTEM_TOKENS)]
    convs = [Conversation(list(system)) for _ in range(conversations)]
    in_flight: dict[int, tuple[list[int], list[int]]] = {}  # store transfer -> blocks, state slots to free

    def reap(results) -> None:
        for r in results:
            held = in_flight.pop(r.transfer_id, None)
            if held is not None:
                blocks, states = held
                engine.release(blocks)
                engine.release_states(states)

    total = turns * conversations
    try:
        with click.progressbar(length=total, label="serving", file=sys.stderr, show_pos=True,
                               hidden=quiet) as bar:
            for turn in range(turns):
                for c, conv in enumerate(convs):
                    conv.history += [rng.randrange(1, 50_000) for _ in range(rng.randint(*USER_TOKENS))]
                    serve(engine, mgr, tally, conv.history, chunk_keys(conv.history, tpc, seed), f"c{c}t{turn}",
                          in_flight, reap, Request)
                    # decode: the reply joins the history (its KV is computed at the next prefill)
                    conv.history += [rng.randrange(1, 50_000) for _ in range(rng.randint(*ASSISTANT_TOKENS))]
                    bar.update(1)
            reap(mgr.wait(list(in_flight), timeout=60))
            deadline = time.monotonic() + 60
            while mgr.pending() and time.monotonic() < deadline:
                mgr.poll()
                time.sleep(0.001)
    finally:
        mgr.close()
    return tally, mgr, info


def serve(engine: Any, mgr: Any, tally: Tally, tokens: list[int], keys: list[bytes], rid: str,
          in_flight: dict[int, tuple[list[int], list[int]]], reap: Any, request_cls: Any) -> None:
    """One request: look up the prefix, load it, verify it, compute the rest, store."""
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    reap(mgr.get_finished())
    deadline = time.monotonic() + LOOKUP_DEADLINE
    look = mgr.lookup(keys)
    while look.retry and time.monotonic() < deadline:
        tally.retries += 1
        time.sleep(0.0005)
        reap(mgr.get_finished())
        look = mgr.lookup(keys)
    nblocks = -(-len(tokens) // TOKENS_PER_BLOCK)
    blocks = engine.alloc(nblocks)
    while blocks is None:  # wait for stores still reading our blocks
        reap(mgr.wait([next(iter(in_flight))], timeout=60))
        blocks = engine.alloc(nblocks)
    req = request_cls(rid, num_prompt_tokens=len(tokens))
    n = look.num_chunks
    valid = 0
    if n:
        load_kw, load_states = engine.load_kwargs()
        (res,) = mgr.wait([mgr.load(keys[:n], blocks[: n * BLOCKS_PER_CHUNK], req, **load_kw)], timeout=60)
        failed = set(res.failed_keys)
        while valid < n and keys[valid] not in failed:
            valid += 1
        tally.failed_loads += len(failed)
        bad = engine.verify_load(keys[:valid], blocks[: valid * BLOCKS_PER_CHUNK], n, load_kw)
        copied, full = engine.load_bytes(keys[:n], blocks[: n * BLOCKS_PER_CHUNK], load_kw)
        engine.release_states(load_states)
        tally.device_bytes += copied
        tally.full_bytes += full
        tally.verified_chunks += valid
        tally.verified_bytes += copied * valid // n
        if bad:
            tally.mismatches += len(bad)
            if tally.first_mismatch is None:
                tally.first_mismatch = f"request {rid}: chunk {keys.index(bad[0])} ({bad[0].hex()}) " \
                                       f"from {res.sources.get(bad[0], '?')}"
            valid = keys.index(bad[0])  # recompute from the first bad chunk
        for k in keys[:valid]:
            src = res.sources.get(k, "?")
            tally.sources[src] = tally.sources.get(src, 0) + 1
    engine.compute(keys[valid:], blocks[valid * BLOCKS_PER_CHUNK : len(keys) * BLOCKS_PER_CHUNK])
    tally.requests += 1
    tally.prompt_tokens += len(tokens)
    tally.loaded_tokens += valid * tpc
    tally.computed_tokens += len(tokens) - valid * tpc
    if engine.layout.is_hybrid:  # store what was computed: a loaded prefix lacks blocks and states
        store_kw, states = engine.store_kwargs(keys[valid:])
        tid = mgr.store(keys[valid:], blocks[valid * BLOCKS_PER_CHUNK : len(keys) * BLOCKS_PER_CHUNK], req,
                        first_chunk=valid, **store_kw)
    else:
        tid, states = mgr.store(keys, blocks[: len(keys) * BLOCKS_PER_CHUNK], req), []
    in_flight[tid] = (blocks, states)


def render(tally: Tally, mgr: Any, info: dict[str, Any], seconds: float) -> str:
    mib = 1 << 20
    lines = [
        f"kvtiers demo: {tally.requests} requests on {info['device']}, chunk {mgr.chunk_bytes / mib:.1f} MiB "
        f"({info['tokens_per_chunk']} tokens), host arena {info['host_slots']} slots, "
        f"tiers {', '.join(info['tiers']) or 'none'} (namespace {info['namespace']}), {seconds:.1f} s",
        "",
        f"{'chunks loaded from':<22}{'chunks':>8}",
    ]
    for src in ["host", *info["tiers"]]:
        lines.append(f"  {src:<20}{tally.sources.get(src, 0):>8}")
    lines.append(f"  {'(failed, recomputed)':<20}{tally.failed_loads:>8}")
    lines += ["", f"{'path':<22}{'chunks':>8}{'MiB':>10}{'GB/s':>9}"]
    paths = ["device->host", *[f"host->{t}" for t in info["tiers"]], *[f"{t}->host" for t in info["tiers"]],
             "host->device"]
    for p in paths:
        st = mgr.stats.paths.get(p)
        chunks, nbytes, gbps = (st.chunks, st.nbytes, st.gbps) if st else (0, 0, 0.0)
        lines.append(f"  {p:<20}{chunks:>8}{nbytes / mib:>10.1f}{gbps:>9.2f}")
    pct = 100.0 * tally.loaded_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    lines += [
        "",
        f"prefill tokens: {tally.prompt_tokens} in prompts, {tally.loaded_tokens} loaded instead of recomputed "
        f"({pct:.1f}%), {tally.computed_tokens} computed",
        f"verified: {tally.verified_chunks} chunks, {tally.verified_bytes / mib:.1f} MiB, "
        f"{tally.mismatches} mismatched",
    ]
    if tally.full_bytes and tally.device_bytes != tally.full_bytes:
        saved = 100.0 * (1 - tally.device_bytes / tally.full_bytes)
        lines.append(f"copied to the device: {tally.device_bytes / mib:.1f} MiB of {tally.full_bytes / mib:.1f} MiB "
                     f"in whole chunks ({saved:.1f}% saved: window-only blocks, last state only)")
    from .observe import observe_lines

    lines += observe_lines(mgr)
    return "\n".join(lines)


def summary(tally: Tally, mgr: Any, info: dict[str, Any], seconds: float) -> dict[str, Any]:
    from .observe import observe_summary

    return {
        **info,
        "seconds": seconds,
        "requests": tally.requests,
        "hits": dict(tally.sources),
        "failed_loads": tally.failed_loads,
        "paths": {p: {"chunks": s.chunks, "bytes": s.nbytes, "gbps": s.gbps} for p, s in mgr.stats.paths.items()},
        "prompt_tokens": tally.prompt_tokens,
        "loaded_tokens": tally.loaded_tokens,
        "computed_tokens": tally.computed_tokens,
        "verified_chunks": tally.verified_chunks,
        "verified_bytes": tally.verified_bytes,
        "mismatches": tally.mismatches,
        "first_mismatch": tally.first_mismatch,
        "host_evictions": mgr.cache.evictions,
        **observe_summary(mgr),
        "device_bytes": tally.device_bytes,
        "full_copy_bytes": tally.full_bytes,
    }
