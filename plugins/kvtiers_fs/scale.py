"""``kvtiers bench fs --scale N``: the fs tier on a root of N chunk files.

Builds (once, under ``--dir``) a namespace directory of ``N`` chunk files, then measures, each
in a fresh process: the time from opening the tier to its first HIT for a stored key, the time
to the full view without and with an index snapshot, the index's bytes per key (tracemalloc:
what the index holds once the view is complete), the lookup rate, and the directory entries
listed per second in steady state by K instances sharing the root with a bound (real
processes, each storing at a steady pace). The last line projects that metadata load to 10M
chunks x 100 instances by scaling the measured figure linearly in chunks and instances (the
load of a tier that lists everything grows so; a cleaner that lists only changed directories
grows with the churn, which this also scales linearly with the instances).

To build 1M chunks in minutes, all but ``real`` of the files are *placeholders*: sparse files
of the chunk file's size, which is all a listing, a probe or the index ever look at (a load of
one would fail its trailer check, as it should). The ``real`` files are valid chunks of zeros.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from . import layout

NAMESPACE = {"model": "kvtiers-fs-scale", "dtype": "float16"}
PROJECT_CHUNKS = 10_000_000
PROJECT_INSTANCES = 100
BASELINE_MAX = 2_000_000  # the lookup baseline's dict of every key (~100 bytes a key) up to this many


def scale_key(i: int) -> bytes:
    """The 32-byte key of chunk ``i`` of a scale root (the size of a sha256 block hash)."""
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little")) + xxhash.xxh3_128_digest(i.to_bytes(8, "big"))


def _namespace():
    import kvtiers

    return kvtiers.Namespace(NAMESPACE)


def build_root(root: str, n: int, slot_bytes: int, *, real: int = 1000, threads: int = 4,
               progress: Callable[[int], None] | None = None) -> str:
    """Create the namespace directory of a scale root with chunk files for keys
    ``scale_key(0..n-1)`` (skipping files already there); every ``n // real``-th is a valid
    chunk of zeros, the others sparse placeholders. Returns the namespace directory."""
    nsdir = layout.ensure_namespace(root, _namespace())
    fbytes = layout.file_bytes(slot_bytes)
    step = max(1, n // max(1, real))
    zeros = memoryview(bytes(slot_bytes))
    digest = layout.data_digest(zeros)
    ns = layout.namespace_tag(_namespace().digest)
    done = [0]
    lock = threading.Lock()

    def work(lo: int, hi: int) -> None:
        page = bytearray(layout.TRAILER_BYTES)
        made: set[str] = set()
        for i in range(lo, hi):
            key = scale_key(i)
            path = layout.chunk_path(nsdir, key)
            d = os.path.dirname(path)
            if d not in made:
                os.makedirs(d, exist_ok=True)
                made.add(d)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            try:
                if i % step == 0:
                    layout.pack_trailer(memoryview(page), key, slot_bytes, digest, ns)
                    os.pwrite(fd, page, slot_bytes)
                else:
                    os.ftruncate(fd, fbytes)
            finally:
                os.close(fd)
            if (i - lo) % 10000 == 9999:
                with lock:
                    done[0] += 10000
                    if progress is not None:
                        progress(done[0])

    per = -(-n // threads)
    ts = [threading.Thread(target=work, args=(lo, min(n, lo + per))) for lo in range(0, n, per)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return nsdir


def real_keys(n: int, real: int = 1000) -> list[bytes]:
    """The keys of the valid chunks :func:`build_root` wrote."""
    step = max(1, n // max(1, real))
    return [scale_key(i) for i in range(0, n, step)]


# -- one open, in a fresh process ----------------------------------------------------------------
_OPEN = r"""
import gc, json, os, sys, time, tracemalloc
sys.path[:0] = {path!r}
import kvtiers
from kvtiers_fs import FsTier
from kvtiers_fs.scale import BASELINE_MAX, NAMESPACE, scale_key, real_keys
n, slot, root, trace, opts = {n!r}, {slot!r}, {root!r}, {trace!r}, {opts!r}
ctx = kvtiers.TierContext(kvtiers.Arena.allocate(2, slot), kvtiers.Namespace(NAMESPACE))
probe_key = real_keys(n)[-1]
gc.collect()
if trace:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
t0 = time.perf_counter()
t = FsTier(ctx, root_dir=root, **opts)
t_open = time.perf_counter() - t0
first_hit = None
while time.perf_counter() - t0 < 60:
    r = t.lookup([probe_key])[0]
    if r is kvtiers.Lookup.HIT:
        first_hit = time.perf_counter() - t0
        break
    time.sleep(0.0005)
view = getattr(t, "view_ready", None) or t.scanned
view.wait(3600)
t_view = time.perf_counter() - t0
t.scanned.wait(3600)
t_full = time.perf_counter() - t0
out = dict(open_s=t_open, first_hit_s=first_hit, view_s=t_view, reconciled_s=t_full,
           snapshot=bool(getattr(t, "snapshot_loaded", False)))
if trace:
    gc.collect()
    out["index_bytes"] = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
else:
    # the baseline: the index this tier had before (a dict of every key, answered per key
    # after the same key check), on the same keys, its rounds interleaved with the tier's
    from collections import OrderedDict
    HIT = kvtiers.Lookup.HIT
    from kvtiers.types import check_keys
    old = OrderedDict.fromkeys(scale_key(i) for i in range(n)) if n <= BASELINE_MAX else None
    def old_lookup(b):
        return [HIT if k in old else None for k in check_keys(b)]
    for size, name in ((1000, ""), (16, "_small")):
        keys = [scale_key(i) for i in range(0, n, max(1, n // 100000))][:100000]
        if size < 1000:  # a few requests' keys asked again and again (a scheduler's polls)
            keys = keys[:size * 50] * 40
        batches = [keys[i:i + size] for i in range(0, len(keys), size)]
        rates, base = [], []
        for _ in range(5):
            s = time.perf_counter()
            hits = 0
            for b in batches:
                hits += sum(1 for x in t.lookup(b) if x is HIT)
            rates.append(len(keys) / (time.perf_counter() - s))
            if old is not None:
                s = time.perf_counter()
                for b in batches:
                    old_lookup(b)
                base.append(len(keys) / (time.perf_counter() - s))
        out["lookup" + name + "_keys_per_s"] = sorted(rates)[2]
        out["lookup" + name + "_hits"] = hits / len(keys)
        if base:
            out["lookup" + name + "_baseline_keys_per_s"] = sorted(base)[2]
    del old
t.close()
print("RESULT " + json.dumps(out))
"""

# -- one instance of the steady-state group --------------------------------------------------------
_STEADY = r"""
import json, os, sys, time
sys.path[:0] = {path!r}
_real = os.scandir
listed = [0]
class _Counting:
    def __init__(self, it): self.it = it
    def __enter__(self): return self
    def __exit__(self, *a): self.it.close()
    def __iter__(self):
        for e in self.it:
            listed[0] += 1
            yield e
    def close(self): self.it.close()
os.scandir = lambda p=".": _Counting(_real(p))   # counts every directory entry any listing yields
import kvtiers
from kvtiers_fs import FsTier
from kvtiers_fs.scale import NAMESPACE
idx, slot, root, opts, window, pace, start = {idx!r}, {slot!r}, {root!r}, {opts!r}, {window!r}, {pace!r}, {start!r}
ctx = kvtiers.TierContext(kvtiers.Arena.allocate(2, slot), kvtiers.Namespace(NAMESPACE))
t = FsTier(ctx, root_dir=root, **opts)
t.scanned.wait(3600)
while time.time() < start:
    time.sleep(0.01)
l0, t0, i = listed[0], time.time(), 0
stored = 0
while time.time() - t0 < window:
    k = b"steady-%d-%d" % (idx, i)
    i += 1
    t.submit_store(kvtiers.Job(i, (k,), (0,)))
    while not t.get_finished_jobs():
        time.sleep(0.001)
    stored += 1
    time.sleep(pace)
dt = time.time() - t0
out = dict(listed=listed[0] - l0, seconds=dt, stored=stored,
           cleaner=bool(getattr(t, "is_cleaner", True)))
t.close()
print("RESULT " + json.dumps(out))
"""


def _run(code: str, timeout: float) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"scale bench child failed (rc {p.returncode}): {p.stderr.strip()[-2000:]}")


def _paths() -> list[str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [here]


def measure_open(root: str, n: int, slot_bytes: int, opts: dict, *, trace: bool = False,
                 timeout: float = 3600) -> dict[str, Any]:
    """Open the tier on a scale root in a fresh process: times, and index bytes (``trace``)
    or the lookup rate."""
    return _run(_OPEN.format(path=_paths(), n=n, slot=slot_bytes, root=root, trace=trace, opts=opts), timeout)


def measure_steady(root: str, slot_bytes: int, k: int, opts: dict, *, window: float, pace: float,
                   timeout: float = 3600) -> list[dict[str, Any]]:
    """K instances (processes) on ``root`` with ``opts``, each storing one chunk every
    ``pace`` seconds for ``window`` seconds once all are open; their listing counts."""
    start = time.time() + 5.0
    results: list[Any] = [None] * k
    errors: list[BaseException] = []

    def one(i: int) -> None:
        code = _STEADY.format(path=_paths(), idx=i, slot=slot_bytes, root=root, opts=opts, window=window,
                              pace=pace, start=start)
        try:
            results[i] = _run(code, timeout)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # the start time is fixed only once every instance had time to open: a generous guess,
    # pushed back if an instance is still opening (its wait for `start` then returns at once)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return results


def remove_snapshot(root: str) -> None:
    """Delete the index snapshot of the scale namespace, if the tier writes one."""
    nsdir = os.path.join(root, _namespace().digest)
    for name in os.listdir(nsdir):
        if name.startswith("index.snapshot"):
            os.unlink(os.path.join(nsdir, name))


def run_scale(root: str, n: int, slot_bytes: int, *, instances: list[int], window: float, pace: float,
              rescan_seconds: float, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole ``--scale`` bench; returns its figures (what ``--json`` prints)."""
    t0 = time.perf_counter()
    build_root(root, n, slot_bytes)
    echo(f"root: {n} chunk files of {layout.file_bytes(slot_bytes)} bytes under {root} "
         f"(built or checked in {time.perf_counter() - t0:.1f} s)")
    out: dict[str, Any] = {"chunks": n, "chunk_bytes": slot_bytes, "root": root}
    remove_snapshot(root)
    cold = measure_open(root, n, slot_bytes, {})
    snap = measure_open(root, n, slot_bytes, {})
    mem = measure_open(root, n, slot_bytes, {}, trace=True)
    out["open_without_snapshot"] = cold
    out["open_with_snapshot"] = snap
    out["index_bytes_per_key"] = mem["index_bytes"] / n
    for name in ("lookup", "lookup_small"):
        for what in ("_keys_per_s", "_baseline_keys_per_s"):
            if name + what in snap:
                out[name + what] = snap[name + what]
    echo(f"open -> first HIT: {cold['first_hit_s']:.3f} s (no snapshot), {snap['first_hit_s']:.3f} s (snapshot)")
    echo(f"open -> full view: {cold['view_s']:.2f} s without a snapshot, {snap['view_s']:.2f} s with one"
         f" (reconciled with the directory after {snap['reconciled_s']:.2f} s)")
    echo(f"index: {out['index_bytes_per_key']:.1f} bytes per key (tracemalloc, {n} keys)")
    for name, what in (("lookup", "batches of 1000 of 100k known keys"),
                       ("lookup_small", "batches of 16 of 800 known keys, asked 40 times")):
        line = f"lookup: {out[name + '_keys_per_s'] / 1e6:.2f} M keys/s ({what})"
        base = out.get(name + "_baseline_keys_per_s")
        if base:
            line += f"; the old dict index {base / 1e6:.2f} M keys/s: {out[name + '_keys_per_s'] / base:.2f}x"
        echo(line)
    bound = (n + 10_000) * layout.file_bytes(slot_bytes)  # above the root: steady state, no mass eviction
    steady = []
    for k in instances:
        res = measure_steady(root, slot_bytes, k, {"max_bytes": bound, "rescan_seconds": rescan_seconds},
                             window=window, pace=pace)
        total = sum(r["listed"] / r["seconds"] for r in res)
        stores = sum(r["stored"] / r["seconds"] for r in res)
        projected = total * (PROJECT_INSTANCES / k) * (PROJECT_CHUNKS / n)
        steady.append({"instances": k, "entries_listed_per_s": total, "stores_per_s": stores,
                       "per_instance": res, "projected_entries_per_s": projected})
        echo(f"steady state, {k} instance(s), bound set, rescan_seconds={rescan_seconds}: "
             f"{total:,.0f} directory entries listed/s in all ({stores:.0f} stores/s)")
        echo(f"  projected at {PROJECT_CHUNKS:,} chunks x {PROJECT_INSTANCES} instances "
             f"(same churn per instance): {projected:,.0f} entries/s")
        remove_steady(root)
    out["steady"] = steady
    return out


def remove_steady(root: str) -> None:
    """Remove the chunks the steady-state instances stored (keys ``steady-*``)."""
    nsdir = os.path.join(root, _namespace().digest)
    prefix = b"steady-".hex()
    for d1 in os.scandir(nsdir):
        if not d1.is_dir(follow_symlinks=False):
            continue
        for d2 in os.scandir(d1.path):
            for e in os.scandir(d2.path):
                if e.name.startswith(prefix):
                    try:
                        os.unlink(e.path)
                    except FileNotFoundError:
                        pass

