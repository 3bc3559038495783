"""``kvtiers demo``: a simulated engine serves multi-turn conversations through the tiers.

No server, no model: the "engine" keeps a small KV cache (CPU tensors, or the accelerator
when ``torch.accelerator`` has one) and serves conversations whose prompts share prefixes
(a common system prompt, then each conversation's growing history). Chunk keys are chained
hashes of the prompt's token chunks, as prefix caches compute them. The bytes of every KV
block are derived from its chunk key, so every loaded chunk is checked byte for byte; a
mismatch makes the command exit 1.

The host arena is small on purpose, so it overflows into the secondary tier (the ``fs`` tier
in a local directory when installed, else the ``memory`` tier), and later turns of a
conversation come back from there. Torch is imported inside functions only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import click

TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 4
NUM_LAYERS = 8
HEADS, HEAD_DIM = 8, 64  # fp16: 16 tokens x 8 x 64 x 2 bytes = 16 KiB per block per tensor
SYSTEM_TOKENS = 256
USER_TOKENS = (64, 192)
ASSISTANT_TOKENS = (64, 192)
HOST_CHUNKS = 24
LOOKUP_DEADLINE = 10.0


def chunk_keys(tokens: list[int], tokens_per_chunk: int, seed: int) -> list[bytes]:
    """Chained hashes of the full token chunks: key i depends on every token before it."""
    keys, prev = [], seed.to_bytes(8, "little")
    for i in range(len(tokens) // tokens_per_chunk):
        chunk = tokens[i * tokens_per_chunk : (i + 1) * tokens_per_chunk]
        prev = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class Conversation:
    history: list[int]
    turn: int = 0


@dataclass
class Tally:
    """What the demo measures besides the manager's own stats."""

    requests: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    verified_chunks: int = 0
    verified_bytes: int = 0
    mismatches: int = 0
    failed_loads: int = 0
    retries: int = 0
    first_mismatch: str | None = None
    sources: dict[str, int] = field(default_factory=dict)
    device_bytes: int = 0  # bytes loads copied to the device (hybrids: window and last state only)
    full_bytes: int = 0  # what copying whole chunks would have moved


class SimEngine:
    """A KV cache of ``num_blocks`` blocks per layer and tensor, with block contents
    derived from chunk keys, and a free list of blocks (the dense model; hybrids are
    :class:`kvtiers.engine.hybrid_demo.HybridSimEngine`)."""

    def __init__(self, device: Any, num_blocks: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.num_blocks = num_blocks
        shape = (num_blocks, TOKENS_PER_BLOCK, HEADS, HEAD_DIM)
        self.kv = {"kv": [[torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(2)]
                          for _ in range(NUM_LAYERS)]}
        self.words = [t.view(num_blocks, -1).view(torch.int64) for layer in self.kv["kv"] for t in layer]
        g = torch.Generator().manual_seed(seed)
        n = self.words[0].shape[1]
        self.base = [torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).to(device)
                     for _ in self.words]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.block_bytes = self.words[0].shape[1] * 8
        from .layout import KVLayout

        self.layout = KVLayout.from_tensors(self.kv)

    def store_kwargs(self, keys: list[bytes]) -> tuple[dict[str, Any], list[int]]:
        return {}, []

    def load_kwargs(self) -> tuple[dict[str, Any], list[int]]:
        return {}, []

    def release_states(self, slots: list[int]) -> None:
        pass

    def verify_load(self, keys: list[bytes], blocks: list[int], loaded: int, kwargs: dict[str, Any]) -> list[bytes]:
        return self.verify(keys, blocks)

    def load_bytes(self, keys: list[bytes], blocks: list[int], kwargs: dict[str, Any]) -> tuple[int, int]:
        n = len(keys) * self.layout.chunk_bytes(BLOCKS_PER_CHUNK)
        return n, n

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _salts(self, keys: list[bytes]) -> Any:
        vals = [int.from_bytes(hashlib.blake2b(k + bytes([j]), digest_size=8).digest(), "little", signed=True)
                for k in keys for j in range(BLOCKS_PER_CHUNK)]
        return self.torch.tensor(vals, dtype=self.torch.int64, device=self.device)

    def compute(self, keys: list[bytes], blocks: list[int]) -> None:
        """'Prefill': write the KV bytes of chunks ``keys`` into their blocks."""
        if not keys:
            return
        idx = self.torch.tensor(blocks, device=self.device)
        salts = self._salts(keys)[:, None]
        for words, base in zip(self.words, self.base, strict=True):
            words[idx] = base[None, :] ^ salts

    def verify(self, keys: list[bytes], blocks: list[int]) -> list[bytes]:
        """The keys among ``keys`` whose blocks do not hold their bytes."""
        if not keys:
            return []
        torch = self.torch
        idx = torch.tensor(blocks, device=self.device)
        salts = self._salts(keys)[:, None]
        bad = torch.zeros(len(blocks), dtype=torch.bool, device=self.device)
        for words, base in zip(self.words, self.base, strict=True):
            bad |= (words[idx] != (base[None, :] ^ salts)).any(dim=1)
        bad_chunks = bad.view(len(keys), BLOCKS_PER_CHUNK).any(dim=1).tolist()
        return [k for k, b in zip(keys, bad_chunks, strict=True) if b]


def pick_device(name: str | None) -> Any:
    import torch

    if name:
        return torch.device(name)
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return torch.device("cpu")


def default_config(tier_dir: str, slot_bytes: int) -> dict[str, Any]:
    from ..registry import get_registry

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
    from ..config import VLLM_ALIASES

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

    from .arena import slot_bytes_for
    from .manager import Request, TieringManager

    device = pick_device(device_name)
    rng = random.Random(seed)
    tpc = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
    max_prompt = SYSTEM_TOKENS + turns * (USER_TOKENS[1] + ASSISTANT_TOKENS[1])
    req_blocks = -(-max_prompt // TOKENS_PER_BLOCK)
    if model == "dense":
        engine: Any = SimEngine(device, 3 * req_blocks, seed)
    else:
        from .hybrid_demo import HybridSimEngine

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


@click.command()
@click.option("--turns", default=6, show_default=True, type=click.IntRange(1), help="Turns per conversation.")
@click.option("--conversations", default=8, show_default=True, type=click.IntRange(1),
              help="Conversations, served round-robin.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory of the persistent tier (default: a temporary one, removed at exit).")
@click.option("--keep", is_flag=True, help="Keep the temporary directory (its path is printed).")
@click.option("--config", "config_text", default=None, metavar="JSON",
              help='JSON merged over the demo\'s config, e.g. \'{"eviction_policy": "arc"}\'.')
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of prompts and KV bytes.")
@click.option("--device", default=None, help="torch device (default: the accelerator if any, else cpu).")
@click.option("--model", type=click.Choice(["dense", "hybrid-swa", "hybrid-ssm"]), default="dense", show_default=True,
              help="KV layout: dense attention, sliding-window + full attention, or attention + Mamba state.")
@click.option("--events", "events_endpoint", default=None, metavar="ENDPOINT",
              help="Publish KV events (vLLM's wire format) on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557.")
@click.option("--events-replay", default=None, metavar="ENDPOINT",
              help="With --events: answer replay requests on this ZMQ endpoint.")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535),
              help="Serve Prometheus /metrics on this port (127.0.0.1) while the demo runs.")
@click.option("--linger", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds the replay socket and /metrics stay up after the run (a last replay or scrape).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@click.option("--scenario", type=click.Choice(["chat", "pd"]), default="chat", show_default=True,
              help="chat: conversations through the tiers; pd: a prefill and a decode process over p2p "
                   "(--conversations prompts).")
@click.option("--p2p-backend", type=click.Choice(["zmq", "nixl"]), default="zmq", show_default=True,
              help="With --scenario pd: the p2p data path (nixl: the prefill writes into decode's slots).")
def demo(turns: int, conversations: int, directory: str | None, keep: bool, config_text: str | None, seed: int,
         device: str | None, model: str, events_endpoint: str | None, events_replay: str | None,
         metrics_port: int | None, linger: float, as_json: bool, scenario: str = "chat",
         p2p_backend: str = "zmq") -> None:
    """Serve simulated multi-turn conversations through the host arena and a persistent
    tier, verify every loaded byte, and print hits, bandwidth and prefill tokens saved.

    Exits 1 if any loaded chunk differs from what was stored.
    """
    if scenario == "pd":  # prefill/decode disaggregation over the p2p tier (docs/p2p.md)
        from .pd_demo import pd_command

        return pd_command(prompts=conversations, seed=seed, device=device, as_json=as_json, backend=p2p_backend)
    from ..config import parse_json_option
    from ..metrics import serve_metrics
    from .observe import observe_config, require_metrics_server

    override = parse_json_option(config_text, None)
    override = {**observe_config(events_endpoint, events_replay, linger), **override}
    server = None
    if metrics_port is not None:
        require_metrics_server()
        server = serve_metrics(metrics_port, "127.0.0.1")
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="kvtiers-demo-")
    try:
        t0 = time.perf_counter()
        tally, mgr, info = run_demo(turns=turns, conversations=conversations, tier_dir=directory,
                                    override=override, seed=seed, device_name=device, quiet=as_json, model=model)
        seconds = time.perf_counter() - t0
    finally:
        if tmp is not None and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if as_json:
        click.echo(json.dumps(summary(tally, mgr, info, seconds)))
    else:
        click.echo(render(tally, mgr, info, seconds))
        if tmp is not None and keep:
            click.echo(f"tier directory kept: {tmp}")
    if tally.mismatches:
        click.echo(f"kvtiers demo: BYTE MISMATCH in {tally.mismatches} loaded chunk(s); first: "
                   f"{tally.first_mismatch}", err=True)
        raise click.exceptions.Exit(1)
    if server is not None:  # --linger: a last scrape
        time.sleep(linger)
        server.close()
