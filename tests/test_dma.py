"""DMA engine: round trips through every layout, byte for byte, on every code path.

Paths: the CPU path (numpy / memmove), and the accelerator code (torch gathers into a staging
buffer, scatters back; and the 'direct' per-run copies) run on CPU tensors without streams,
so its index arithmetic is checked here too. Device tensors are either separate allocations
(one per layer and K/V, as vLLM allocates) or views of one pool.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtiers.engine.arena import create_host_arena, slot_bytes_for
from kvtiers.engine.dma import DmaEngine
from kvtiers.engine.layout import KVGroup, KVLayout

POISON = 0xA5
NUM_BLOCKS = 48
BPC = 4

LAYOUTS = {
    "flat": KVLayout.flat(3, 256),
    "mla": KVLayout.mla(4, 576),
    "multi": KVLayout.multi([KVGroup("target", 3, 2, 512), KVGroup("draft", 1, 2, 96)]),
}
DTYPES = {"flat": torch.bfloat16, "mla": torch.float16, "multi": torch.int8}
PATHS = {
    "cpu": {},
    "torch-staged": {"_torch_path_on_cpu": True},
    "torch-staged-1": {"_torch_path_on_cpu": True, "staging_bytes": 1},  # one chunk per batch
    "torch-staged-2": {"_torch_path_on_cpu": True, "staging_bytes": 1},  # two chunks per batch (set below)
}

# (block ids, slot): full chunks of consecutive blocks into consecutive slots (merged into one
# copy on the CPU path), partial, non-consecutive, reversed, many short runs (> 4), one block
STORE = [
    ([0, 1, 2, 3], 0),
    ([4, 5, 6, 7], 1),
    ([10, 11, 12], 2),
    ([20, 7, 30, 5], 3),
    ([43, 42, 41, 40], 5),
    ([44], 6),
]
LOAD = [  # the same slots into other blocks
    ([24, 25, 26, 27], 0),
    ([28, 29, 30, 31], 1),
    ([8, 9, 13], 2),
    ([32, 34, 36, 38], 3),
    ([14, 15, 16, 17], 5),
    ([47], 6),
]



def count_copies(monkeypatch) -> list:
    """A list that grows by one at each ``np.copyto`` from now on (the copies still happen)."""
    calls: list = []
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda *a, **k: calls.append(1) or real_copyto(*a, **k))
    return calls


def make_caches(layout: KVLayout, dtype: torch.dtype, pooled: bool | str, seed: int = 0):
    """pooled=True: views of one pool; False: one allocation per tensor; "unaligned": one
    allocation per tensor, each tensor 0, 1 or 2 elements past its allocation's start (so the
    accelerator path's span rows are a few bytes, not a block)."""
    g = torch.Generator().manual_seed(seed)
    caches = {}
    for grp in layout.groups:
        esz = torch.empty(0, dtype=dtype).element_size()
        per_block = grp.block_bytes // esz
        shape = (grp.num_layers, grp.tensors_per_layer, NUM_BLOCKS, per_block)
        if pooled == "unaligned":
            caches[grp.name] = []
            for li in range(grp.num_layers):
                layer = []
                for ti in range(grp.tensors_per_layer):
                    skip = esz * ((li * grp.tensors_per_layer + ti) % 3)
                    buf = torch.randint(0, 256, (skip + NUM_BLOCKS * grp.block_bytes,), dtype=torch.uint8, generator=g)
                    layer.append(buf[skip:].view(NUM_BLOCKS, grp.block_bytes).view(dtype))
                caches[grp.name].append(layer)
        elif pooled:
            pool = torch.empty(shape[:-1] + (grp.block_bytes,), dtype=torch.uint8)
            pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=g))
            pool = pool.view(dtype)
            caches[grp.name] = [[pool[li, ti] for ti in range(grp.tensors_per_layer)] for li in range(grp.num_layers)]
        else:
            caches[grp.name] = [
                [torch.randint(0, 256, (NUM_BLOCKS, grp.block_bytes), dtype=torch.uint8, generator=g).view(dtype)
                 for _ in range(grp.tensors_per_layer)]
                for _ in range(grp.num_layers)
            ]
    return caches


def block_bytes_of(caches, group, layer, tensor, block) -> bytes:
    return caches[group][layer][tensor][block].contiguous().view(torch.uint8).numpy().tobytes()


def snapshot(caches):
    return {n: [[t.clone() for t in layer] for layer in layers] for n, layers in caches.items()}


def expected_slot_pieces(layout, caches, ids):
    """(offset, bytes) of every block the chunk must put in its slot, computed independently."""
    pieces = []
    off = 0
    for grp in layout.groups:
        for li in range(grp.num_layers):
            for ti in range(grp.tensors_per_layer):
                for pos, b in enumerate(ids):
                    pieces.append((off + pos * grp.block_bytes, block_bytes_of(caches, grp.name, li, ti, b)))
                off += BPC * grp.block_bytes
    return pieces


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pooled", [False, True, "unaligned"], ids=["separate", "pooled", "unaligned"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_every_byte(name, pooled, path):
    layout = LAYOUTS[name]
    caches = make_caches(layout, DTYPES[name], pooled)
    assert KVLayout.from_tensors(caches) == layout
    host = create_host_arena(8, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False)
    host.ndarray()[:] = POISON
    opts = dict(PATHS[path])
    if path == "torch-staged-2":
        opts["staging_bytes"] = 2 * layout.chunk_bytes(BPC)
    eng = DmaEngine(layout, caches, host, BPC, **opts)
    assert eng.kind == "cpu"
    if path == "cpu":
        assert (eng._groups[0].rows is not None) == (pooled is True)  # the pooled fast path was found
    elif pooled == "unaligned":
        assert eng._unit < 8  # rows of a few bytes: the span still reaches every tensor

    eng.submit_store(1, STORE)
    assert eng.poll() == [1]
    assert eng.poll() == []
    arena = host.ndarray()
    for ids, slot in STORE:
        for off, want in expected_slot_pieces(layout, caches, ids):
            assert arena[slot, off : off + len(want)].tobytes() == want, (ids, slot, off)
    assert (arena[4] == POISON).all() and (arena[7] == POISON).all()

    before = snapshot(caches)
    for layers in caches.values():  # poison the device
        for layer in layers:
            for t in layer:
                t.view(torch.uint8).fill_(POISON)
    eng.submit_load(2, LOAD)
    eng.wait(2, timeout=10)
    assert eng.poll() == [2]
    loaded = {}
    for (src_ids, _), (dst_ids, _) in zip(STORE, LOAD, strict=True):
        loaded.update(zip(dst_ids, src_ids, strict=True))
    for grp in layout.groups:
        for li in range(grp.num_layers):
            for ti in range(grp.tensors_per_layer):
                for b in range(NUM_BLOCKS):
                    got = block_bytes_of(caches, grp.name, li, ti, b)
                    if b in loaded:
                        assert got == block_bytes_of(before, grp.name, li, ti, loaded[b]), (grp.name, li, ti, b)
                    else:
                        assert got == bytes([POISON]) * grp.block_bytes, (grp.name, li, ti, b)
    eng.close()
    host.close()


def test_poll_reports_each_transfer_once_and_ids_can_be_reused():
    layout = LAYOUTS["flat"]
    caches = make_caches(layout, torch.float16, pooled=False)
    with create_host_arena(4, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        eng = DmaEngine(layout, caches, host, BPC)
        eng.submit_store(7, [([1, 2], 0)])
        eng.submit_store(8, [])  # an empty transfer is a transfer too
        with pytest.raises(ValueError, match="already in flight"):
            eng.submit_load(7, [([3], 0)])
        eng.wait(7)
        assert sorted(eng.poll()) == [7, 8]
        assert eng.poll() == []
        eng.submit_load(7, [([3, 4], 0)])  # reported, so the id is free again
        assert eng.poll() == [7]
        assert block_bytes_of(caches, "kv", 2, 1, 3) == block_bytes_of(caches, "kv", 2, 1, 1)
        eng.close()
        with pytest.raises(ValueError, match="closed"):
            eng.submit_store(9, [([1], 0)])


def test_caller_errors_are_raised_before_anything_is_copied():
    layout = LAYOUTS["multi"]
    caches = make_caches(layout, torch.int8, pooled=False)
    with create_host_arena(4, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, BPC)
        with pytest.raises(IndexError, match="slot 4 out of range"):
            eng.submit_store(1, [([1], 0), ([2], 4)])
        with pytest.raises(IndexError, match=f"device block {NUM_BLOCKS} out of range"):
            eng.submit_store(1, [([1], 0), ([NUM_BLOCKS], 1)])
        with pytest.raises(IndexError, match="device block -1"):
            eng.submit_load(1, [([-1], 0)])
        with pytest.raises(ValueError, match="more than blocks_per_chunk"):
            eng.submit_store(1, [([1, 2, 3, 4, 5], 0)])
        with pytest.raises(ValueError, match="slot 0 given twice"):
            eng.submit_store(1, [([1], 0), ([2], 0)])
        with pytest.raises(ValueError, match="loaded twice"):
            eng.submit_load(1, [([1, 2], 0), ([2], 1)])
        with pytest.raises(TypeError, match="each chunk is"):
            eng.submit_store(1, [5])
        assert (host.ndarray() == POISON).all()
        assert eng.poll() == []


def test_engine_checks_tensors_against_the_layout():
    layout = LAYOUTS["flat"]
    caches = make_caches(layout, torch.float16, pooled=False)
    host = create_host_arena(2, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False)
    with pytest.raises(ValueError, match="do not match"):
        DmaEngine(layout, {"other": caches["kv"]}, host, BPC)
    with pytest.raises(ValueError, match="2 layers given, layout says 3"):
        DmaEngine(layout, {"kv": caches["kv"][:2]}, host, BPC)
    with pytest.raises(ValueError, match="block of 512 bytes, layout says 256"):
        DmaEngine(KVLayout.flat(3, 256), {"kv": [[torch.zeros(4, 256, dtype=torch.float16)] * 2] * 3}, host, BPC)
    with pytest.raises(ValueError, match="slots hold"):
        DmaEngine(layout, caches, host, BPC * 8)
    host.close()


def test_cpu_path_batches_pooled_groups(monkeypatch):
    """A pooled group costs one numpy call per chunk (or per run of chunks), whatever its layer count."""
    layout = KVLayout.flat(16, 128)
    caches = make_caches(layout, torch.float16, pooled=True)
    with create_host_arena(4, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        eng = DmaEngine(layout, caches, host, BPC)
        calls = count_copies(monkeypatch)
        eng.submit_store(1, [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 1), ([8, 9, 10, 11], 2)])
        assert len(calls) == 1  # consecutive blocks to consecutive slots: one strided copy
        eng.submit_load(2, [([20, 21, 22, 23], 0), ([30, 31], 3)])
        assert len(calls) == 3  # one per chunk
        assert sorted(eng.poll()) == [1, 2]
        for li in range(16):
            for ti in range(2):
                assert block_bytes_of(caches, "kv", li, ti, 22) == block_bytes_of(caches, "kv", li, ti, 2)


def address_runs(tensors) -> int:
    """How many runs of consecutive tensors lie at one address stride (each tensor in at most
    one run; a run of two or more needs non-overlapping tensors), counted here from the
    tensors' addresses."""
    addrs = [t.data_ptr() for t in tensors]
    size = max(t.numel() * t.element_size() for t in tensors)
    count, i = 0, 0
    while i < len(addrs):
        j = i + 1
        if j < len(addrs) and abs(addrs[j] - addrs[i]) >= size:
            while j + 1 < len(addrs) and addrs[j + 1] - addrs[j] == addrs[i + 1] - addrs[i]:
                j += 1
            j += 1
        count += 1
        i = j
    return count


def test_cpu_path_one_copy_per_tensor_run_for_runs_of_chunks(monkeypatch):
    """Separate tensors: full chunks of consecutive blocks to consecutive slots cost one strided
    copy per run of tensors at one address stride (at most one per tensor) for the whole run of
    chunks, whatever the number of chunks; every byte lands."""
    layout = KVLayout.flat(5, 128)
    caches = make_caches(layout, torch.float16, pooled=False, seed=3)
    with create_host_arena(6, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, BPC)
        calls = count_copies(monkeypatch)
        eng.submit_store(1, [([8, 9, 10, 11], 1), ([12, 13, 14, 15], 2), ([16, 17, 18, 19], 3)])
        per_transfer = address_runs([t for layer in caches["kv"] for t in layer])
        assert len(calls) == per_transfer <= 10  # at most one per tensor: 5 layers x K,V
        arena = host.ndarray()
        for c, slot in enumerate((1, 2, 3)):
            for off, want in expected_slot_pieces(layout, caches, list(range(8 + 4 * c, 12 + 4 * c))):
                assert arena[slot, off : off + len(want)].tobytes() == want
        assert (arena[0] == POISON).all() and (arena[4] == POISON).all()
        before = snapshot(caches)
        for layer in caches["kv"]:
            for t in layer:
                t.view(torch.uint8).fill_(POISON)
        eng.submit_load(2, [([20, 21, 22, 23], 1), ([24, 25, 26, 27], 2)])
        assert len(calls) == 2 * per_transfer
        assert sorted(eng.poll()) == [1, 2]
        for li in range(5):
            for ti in range(2):
                for b in range(NUM_BLOCKS):
                    want = block_bytes_of(before, "kv", li, ti, b - 12) if 20 <= b < 28 else bytes([POISON]) * 128
                    assert block_bytes_of(caches, "kv", li, ti, b) == want, (li, ti, b)


@pytest.mark.parametrize("pooled", [False, True], ids=["separate", "pooled"])
def test_cpu_path_splits_large_runs_over_two_threads(monkeypatch, pooled):
    """Runs of chunks above PARALLEL_MIN_BYTES are copied half on the caller's thread, half on a
    helper thread; every byte still lands, and close() ends the helper thread."""
    import threading

    import kvtiers.engine.dma as dma

    monkeypatch.setattr(dma, "PARALLEL_MIN_BYTES", 1)  # the split, on test-sized data
    layout = KVLayout.flat(4, 256)
    caches = make_caches(layout, torch.float16, pooled=pooled, seed=5)
    with create_host_arena(6, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, BPC, cpu_threads=2)
        threads = set()
        both = threading.Barrier(2, timeout=30)
        real_copyto = np.copyto

        def copyto(*a, **k):
            name = threading.current_thread().name
            if name not in threads:  # each thread's first part waits for the other's: both copy
                threads.add(name)
                both.wait()
            return real_copyto(*a, **k)

        monkeypatch.setattr(np, "copyto", copyto)
        plan = [([4 * c + b for b in range(BPC)], c + 1) for c in range(4)]  # 4 chunks -> slots 1..4
        eng.submit_store(1, plan)
        assert len(threads) == 2 and any(n.startswith("kvtiers-dma") for n in threads)
        arena = host.ndarray()
        for ids, slot in plan:
            for off, want in expected_slot_pieces(layout, caches, ids):
                assert arena[slot, off : off + len(want)].tobytes() == want, (slot, off)
        assert (arena[0] == POISON).all() and (arena[5] == POISON).all()
        before = snapshot(caches)
        for layer in caches["kv"]:
            for t in layer:
                t.view(torch.uint8).fill_(POISON)
        eng.submit_load(2, [([20 + 4 * c + b for b in range(BPC)], c + 1) for c in range(4)])
        assert sorted(eng.poll()) == [1, 2]
        for li in range(4):
            for ti in range(2):
                for b in range(NUM_BLOCKS):
                    want = block_bytes_of(before, "kv", li, ti, b - 20) if 20 <= b < 36 else bytes([POISON]) * 256
                    assert block_bytes_of(caches, "kv", li, ti, b) == want, (li, ti, b)
        eng.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtiers-dma")]


def test_cpu_path_does_not_wait_for_a_helper_thread_that_never_starts(monkeypatch):
    """A busy machine: the helper thread is not free (here: held by another task) when a large
    transfer is split. The caller's thread copies every part itself and returns (the helper's
    share is cancelled), rather than waiting for the helper; every byte lands."""
    import threading

    import kvtiers.engine.dma as dma

    monkeypatch.setattr(dma, "PARALLEL_MIN_BYTES", 1)
    layout = KVLayout.flat(4, 256)
    caches = make_caches(layout, torch.float16, pooled=True, seed=6)
    with create_host_arena(6, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        eng = DmaEngine(layout, caches, host, BPC, cpu_threads=2)
        plan = [([4 * c + b for b in range(BPC)], c + 1) for c in range(4)]
        eng.submit_store(1, plan)  # starts the helper thread
        release = threading.Event()
        eng._pool.submit(release.wait, 60)  # the only helper is busy
        done = threading.Thread(target=eng.submit_store, args=(2, plan), daemon=True)
        try:
            done.start()
            done.join(30)
            assert not done.is_alive(), "the transfer waited for a helper thread that never started"
        finally:
            release.set()
        arena = host.ndarray()
        for ids, slot in plan:
            for off, want in expected_slot_pieces(layout, caches, ids):
                assert arena[slot, off : off + len(want)].tobytes() == want, (slot, off)
        assert sorted(eng.poll()) == [1, 2]
        eng.close()


def _strided_tensors(n: int, rows: int, bb: int, gaps: list[int]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """``n`` tensors ``[rows, bb]`` as separate torch storages inside one numpy buffer, tensor i
    starting ``sum(gaps[:i]) + i * rows * bb`` bytes in (gaps[i] bytes unused after tensor i)."""
    buf = np.random.default_rng(7).integers(0, 256, size=n * rows * bb + sum(gaps) + 4096, dtype=np.uint8)
    out, off = [], 0
    for i in range(n):
        out.append(torch.from_numpy(buf[off : off + rows * bb]).view(rows, bb))
        off += rows * bb + gaps[i]
    return buf, out


GAPS = {  # 16 tensors: gap after each -> runs of tensors at one address stride
    "one-address-stride": ([64] * 16, 1),
    "three-strides": ([64] * 5 + [4096] + [128] * 6 + [64] + [192] * 3, 3),  # tensors 0-5, 6-12, 13-15
    "uneven": ([64 * (i % 3 + 1) for i in range(16)], 8),  # no two steps alike: pairs
}


@pytest.mark.parametrize("gaps", list(GAPS))
def test_copy_calls_per_transfer_for_separate_allocations(monkeypatch, gaps):
    """Separate allocations (vLLM's layout): a run of chunks costs one strided copy per run of
    tensors at one address stride (one per transfer for the group where every tensor lies at
    one stride, whatever its layer count); every byte lands, and the gaps between the tensors
    are never written."""
    layers, bb, rows = 8, 4096, 32
    layout = KVLayout.flat(layers, bb)
    gaps, per_transfer = GAPS[gaps]
    buf, flat = _strided_tensors(2 * layers, rows, bb, gaps)
    before_buf = buf.copy()
    caches = {"kv": [flat[2 * li : 2 * li + 2] for li in range(layers)]}
    with create_host_arena(8, slot_bytes_for(layout.chunk_bytes(BPC)), pin=False) as host:
        eng = DmaEngine(layout, caches, host, BPC, cpu_threads=1)
        calls = count_copies(monkeypatch)
        plan = [([4 * c + b for b in range(BPC)], c + 1) for c in range(4)]  # blocks 0..15 -> slots 1..4
        eng.submit_store(1, plan)
        assert len(calls) == per_transfer == address_runs(flat)
        arena = host.ndarray()
        for ids, slot in plan:
            for off, want in expected_slot_pieces(layout, caches, ids):
                assert arena[slot, off : off + len(want)].tobytes() == want, (slot, off)
        eng.submit_load(2, [([16 + 4 * c + b for b in range(BPC)], c + 1) for c in range(4)])  # -> blocks 16..31
        assert len(calls) == 2 * per_transfer
        assert sorted(eng.poll()) == [1, 2]
        off = 0
        for i, t in enumerate(flat):
            u = t.numpy()
            assert (u[16:32] == u[0:16]).all(), i  # loaded back where asked
            end = off + rows * bb
            assert (buf[end : end + gaps[i]] == before_buf[end : end + gaps[i]]).all(), i  # gap untouched
            off = end + gaps[i]
        eng.close()


@pytest.mark.parametrize("tensors", ["pooled", "separate"])
def test_bench_arena_transfer_is_one_strided_copy(monkeypatch, tensors):
    """`kvtiers bench arena`'s 1 MiB rows (16 chunks of 64 pieces of 16 KiB): each store and load
    is one numpy copy call per run of tensors at one address stride for the whole transfer (one
    for the pool), not one per piece or per tensor; inside it the pieces stay 16 KiB, the slot
    layout's contiguous run."""
    from kvtiers.commands.bench.arena import MiB, make_setup

    s = make_setup(MiB, 16, tensors, cpu_threads=1)
    try:
        per_transfer = address_runs(s.engine._groups[0].tensors)  # 1 for the pool; where this
        # allocator placed the 64 separate tensors: 1 or 2 seen (one jump between heap areas)
        assert per_transfer == 1 or tensors == "separate"
        calls = []
        real_copyto = np.copyto
        monkeypatch.setattr(np, "copyto", lambda d, src, **k: calls.append((d.shape, d.strides, src.strides))
                            or real_copyto(d, src, **k))
        plan = [([c], c) for c in range(16)]
        s.engine.submit_store(1, plan)
        s.engine.submit_load(2, plan)
        assert len(calls) == 2 * per_transfer
        assert sum(np.prod(shape) for shape, *_ in calls) == 2 * 16 * MiB
        for shape, *_ in calls:
            assert shape[-1] == 16 * 1024
        s.engine.poll()
    finally:
        s.close()


def _caches_for(kind: str, layers: int, bb: int, rows: int):
    """(caches, flat tensors, backing buffer or None, gaps or None) for a flat layout:
    'pooled' (one torch pool), 'separate' (one torch allocation per tensor), or a GAPS entry
    (separate storages inside one numpy buffer at the given gaps)."""
    g = torch.Generator().manual_seed(11)
    if kind == "pooled":
        pool = torch.randint(0, 256, (layers, 2, rows, bb), dtype=torch.uint8, generator=g)
        flat = [pool[li, ti] for li in range(layers) for ti in range(2)]
        buf = gaps = None
    elif kind == "separate":
        flat = [torch.randint(0, 256, (rows, bb), dtype=torch.uint8, generator=g) for _ in range(2 * layers)]
        buf = gaps = None
    else:
        gaps = GAPS[kind][0]
        buf, flat = _strided_tensors(2 * layers, rows, bb, gaps)
    return {"kv": [flat[2 * li : 2 * li + 2] for li in range(layers)]}, flat, buf, gaps


@pytest.mark.parametrize("kind", ["pooled", "separate", "three-strides", "uneven"])
def test_cpu_path_batches_evenly_spaced_chunks_and_keeps_every_byte(monkeypatch, kind):
    """Full chunks of consecutive blocks whose first blocks step evenly (up or down) going to
    slots that step evenly (every other slot: a run of slots that is not contiguous) are one
    strided copy per run of tensors at one address stride; scattered and partial chunks around
    them take the per-chunk paths. Every byte is checked against the tensors read block by
    block, slots and blocks not named keep their poison, and gaps between allocations stay
    untouched."""
    layers, bb, rows, bpc = 8, 1024, 96, 8
    layout = KVLayout.flat(layers, bb)
    caches, flat, buf, gaps = _caches_for(kind, layers, bb, rows)
    buf_before = None if buf is None else buf.copy()
    runs = address_runs(flat)
    evenly = [(list(range(16 * c, 16 * c + 8)), 2 * c) for c in range(3)]  # blocks 0.., 16.., 32.. -> slots 0, 2, 4
    down = [(list(range(88, 96)), 5), (list(range(72, 80)), 6)]  # first blocks 88, 72 -> slots 5, 6
    others = [([50, 48, 60, 52, 63, 41, 45, 58], 7), ([64, 65, 66], 8)]  # scattered (> 4 runs), partial
    loads = [(list(range(8 + 16 * c, 16 + 16 * c)), 2 * c) for c in range(3)]  # slots 0, 2, 4 -> 8.., 24.., 40..
    loads += [(list(range(80, 88)), 5), (list(range(56, 64)), 6)]  # first blocks 80, 56
    loads += [([0, 2, 4, 6, 17, 19, 21, 23], 7), ([49, 51, 53], 8)]

    def slot_bytes(ids):  # what a slot must hold: tensor by tensor, the chunk's blocks in order,
        # positions past a partial chunk's blocks not written
        pad = bytes([POISON]) * ((bpc - len(ids)) * bb)
        return b"".join(b"".join(t[b].numpy().tobytes() for b in ids) + pad for t in flat)

    with create_host_arena(10, slot_bytes_for(layout.chunk_bytes(bpc)), pin=False) as host:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, bpc, cpu_threads=1)
        calls = count_copies(monkeypatch)
        eng.submit_store(1, evenly)
        assert len(calls) == runs  # three chunks, one copy per run of tensors
        eng.submit_store(2, down)
        assert len(calls) == 2 * runs
        eng.submit_store(3, others)
        arena = host.ndarray()
        for ids, slot in evenly + down + others:
            want = slot_bytes(ids)
            assert arena[slot, : len(want)].tobytes() == want, slot
            assert (arena[slot, len(want) :] == POISON).all(), slot
        assert (arena[[1, 3, 9]] == POISON).all()

        before = [t.clone() for t in flat]
        for t in flat:
            t.fill_(POISON)
        calls.clear()
        eng.submit_load(4, loads[:3])
        assert len(calls) == runs
        eng.submit_load(5, loads[3:])
        assert sorted(eng.poll()) == [1, 2, 3, 4, 5]
        src = {}
        for (s_ids, _), (d_ids, _) in zip(sorted(evenly + down + others, key=lambda x: x[1]),
                                              sorted(loads, key=lambda x: x[1]), strict=True):
            src.update(zip(d_ids, s_ids, strict=True))
        for i, t in enumerate(flat):
            for b in range(rows):
                want = before[i][src[b]] if b in src else torch.full((bb,), POISON, dtype=torch.uint8)
                assert torch.equal(t[b], want), (i, b)
        if buf is not None:
            off = 0
            for i in range(len(flat)):
                end = off + rows * bb
                assert (buf[end : end + gaps[i]] == buf_before[end : end + gaps[i]]).all(), i
                off = end + gaps[i]
        eng.close()


def test_cpu_masked_path_batches_chunks_to_every_other_slot(monkeypatch):
    """Hybrid chunks given per group (full attention, a sliding window with skipped chunks, an
    SSM state per chunk) going to every other slot: each group's full chunks are one strided
    copy per run of tensors at one address stride. Slots and device tensors are checked byte
    by byte against the tensors read block by block; skipped positions keep their poison."""
    bpc, bb, sb = 4, 256, 128
    layout = KVLayout([KVGroup("full", 2, 2, bb), KVGroup("swa", 2, 2, bb, kind="sliding", window=64),
                       KVGroup("ssm", 3, 1, sb, kind="ssm")])
    g = torch.Generator().manual_seed(13)
    rows = {"full": 40, "swa": 40, "ssm": 10}
    caches = {grp.name: [[torch.randint(0, 256, (rows[grp.name], grp.block_bytes), dtype=torch.uint8, generator=g)
                          for _ in range(grp.tensors_per_layer)] for _ in range(grp.num_layers)]
              for grp in layout.groups}
    flat = {n: [t for layer in layers for t in layer] for n, layers in caches.items()}

    def chunk(c, base, state):
        ids = list(range(base + 4 * c, base + 4 * c + 4))
        return {"full": ids, "swa": ids if c >= 2 else [-1] * 4, **({"ssm": [state]} if state is not None else {})}

    store = [(chunk(c, 0, c), 2 * c) for c in range(4)]  # slots 0, 2, 4, 6; states 0..3
    load = [(chunk(c, 20, 9 if c == 3 else None), 2 * c) for c in range(4)]  # the last chunk's state only
    with create_host_arena(8, slot_bytes_for(layout.chunk_bytes(bpc)), pin=False) as host:
        host.ndarray()[:] = POISON
        eng = DmaEngine(layout, caches, host, bpc, cpu_threads=1)
        calls = count_copies(monkeypatch)
        eng.submit_store(1, store)
        assert len(calls) == sum(address_runs(ts) for ts in flat.values())  # one per run of tensors per group
        arena = host.ndarray()
        for spec, slot in store:
            off = 0
            for grp in layout.groups:
                npos = grp.positions(bpc)
                for t in flat[grp.name]:
                    for p, b in enumerate(spec.get(grp.name, [-1] * npos)):
                        got = arena[slot, off : off + grp.block_bytes].tobytes()
                        want = t[b].numpy().tobytes() if b >= 0 else bytes([POISON]) * grp.block_bytes
                        assert got == want, (slot, grp.name, p)
                        off += grp.block_bytes
        assert (arena[[1, 3, 5, 7]] == POISON).all()

        before = {n: [t.clone() for t in ts] for n, ts in flat.items()}
        for ts in flat.values():
            for t in ts:
                t.fill_(POISON)
        eng.submit_load(2, load)
        assert sorted(eng.poll()) == [1, 2]
        src = {"full": {20 + i: i for i in range(16)}, "swa": {28 + i: 8 + i for i in range(8)}, "ssm": {9: 3}}
        for name, ts in flat.items():
            for i, t in enumerate(ts):
                for b in range(rows[name]):
                    want = before[name][i][src[name][b]] if b in src[name] else torch.full_like(t[b], POISON)
                    assert torch.equal(t[b], want), (name, i, b)
        eng.close()


def test_strided_view_shares_memory_and_stays_in_its_buffer():
    """A segment's strided view writes through to the tensor's bytes and cannot reach past
    the buffer it was made over."""
    from kvtiers.engine import dma_copies

    t = torch.zeros((6, 32), dtype=torch.uint8)
    (seg,) = dma_copies.address_segments([t], [t.numpy()], 6, 32)
    _, _, _, base = seg
    v = dma_copies.strided(base, 2 * 32, (2, 1, 1, 32), (2 * 32, 0, 32, 1))  # blocks 2 and 4
    v[...] = 7
    assert t[2].eq(7).all() and t[4].eq(7).all() and t[[0, 1, 3, 5]].eq(0).all()
    with pytest.raises(ValueError):
        dma_copies.strided(base, 5 * 32, (2, 1, 1, 32), (32, 0, 32, 1))  # block 6 is past the tensor
