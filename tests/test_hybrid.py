"""Hybrid layouts: sliding-window, SSM state, MLA with indexer, mixed dtypes, through the DMA
engine (CPU path and the accelerator code path run on CPU tensors) and the manager."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtiers import Namespace  # noqa: E402
from kvtiers.engine.arena import create_host_arena, slot_bytes_for  # noqa: E402
from kvtiers.engine.dma import DmaEngine  # noqa: E402
from kvtiers.engine.hybrid import chunk_specs, copied_bytes, window_first_block  # noqa: E402
from kvtiers.engine.layout import KVGroup, KVLayout  # noqa: E402
from kvtiers.engine.manager import TieringManager  # noqa: E402

pytest_plugins = ["s3_fixture"]

BPC = 4
TPB = 16  # tokens per block
NBLOCKS = 48
NSTATES = 12


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    u8 = t.view(torch.uint8)
    u8.copy_(torch.randint(0, 256, u8.shape, generator=gen, dtype=torch.uint8))


def hybrid_caches(pooled: bool, dtypes: dict[str, torch.dtype] | None = None, seed: int = 0):
    """Full attention (fp8 e4m3), sliding window (bf16), MLA latent + indexer (fp8 e5m2 / int8),
    Mamba conv and recurrent states (float32): every kind in one chunk."""
    dt = {"full": torch.float8_e4m3fn, "swa": torch.bfloat16, "mla": torch.float8_e5m2, "idx": torch.int8,
          "conv": torch.float32, "ssm": torch.float32, **(dtypes or {})}
    shapes = {"full": (NBLOCKS, TPB, 2, 8), "swa": (NBLOCKS, TPB, 2, 8), "mla": (NBLOCKS, TPB, 36),
              "idx": (NBLOCKS, TPB, 8), "conv": (NSTATES, 3, 40), "ssm": (NSTATES, 4, 16, 8)}
    per_layer = {"full": 2, "swa": 2, "mla": 1, "idx": 1, "conv": 1, "ssm": 1}
    layers = {"full": 2, "swa": 3, "mla": 2, "idx": 2, "conv": 2, "ssm": 2}
    gen = torch.Generator().manual_seed(seed)
    kv = {}
    for name in shapes:
        n = layers[name] * per_layer[name]
        if pooled:  # one allocation per group: [tensors, blocks, ...]
            pool = torch.empty((n, *shapes[name]), dtype=dt[name])
            ts = [pool[i] for i in range(n)]
        else:
            ts = [torch.empty(shapes[name], dtype=dt[name]) for _ in range(n)]
        for t in ts:
            _fill(t, gen)
        k = per_layer[name]
        kv[name] = [ts[i * k : (i + 1) * k] for i in range(layers[name])]
    kinds = {"swa": {"kind": "sliding", "window": 40}, "mla": "mla", "idx": "mla_indexer", "conv": "ssm",
             "ssm": "ssm"}
    return kv, KVLayout.from_tensors(kv, kinds=kinds)


def block_bytes(kv, group: str, block: int) -> list[bytes]:
    return [t[block].contiguous().view(torch.uint8).numpy().tobytes() for layer in kv[group] for t in layer]


def test_layout_kinds_sizes_and_description():
    kv, layout = hybrid_caches(pooled=True)
    conv, full = layout.group("conv"), layout.group("full")
    assert conv.is_state and conv.positions(BPC) == 1
    assert conv.chunk_bytes(BPC) == 2 * 3 * 40 * 4  # one state per chunk, not one per block
    assert full.chunk_bytes(BPC) == 4 * BPC * TPB * 2 * 8
    assert layout.chunk_bytes(BPC) == sum(g.chunk_bytes(BPC) for g in layout.groups)
    assert layout.is_hybrid and not KVLayout.flat(2, 64).is_hybrid
    d = json.loads(json.dumps(layout.describe()))
    by = {g["name"]: g for g in d["groups"]}
    assert by["swa"]["kind"] == "sliding" and by["swa"]["window"] == 40
    assert by["full"]["dtype"] == "float8_e4m3fn" and "kind" not in by["full"]
    assert by["idx"]["kind"] == "mla_indexer" and by["conv"]["dtype"] == "float32"
    # kinds, windows and dtypes change the namespace
    other = KVLayout([KVGroup(g.name, g.num_layers, g.tensors_per_layer, g.block_bytes, kind=g.kind,
                              window=(64 if g.window else None), dtype=g.dtype) for g in layout.groups])
    assert Namespace({"layout": other.describe()}).digest != Namespace({"layout": layout.describe()}).digest
    bf = KVLayout.from_tensors({"kv": [[torch.zeros(4, 8, dtype=torch.bfloat16)] * 2]})
    f16 = KVLayout.from_tensors({"kv": [[torch.zeros(4, 8, dtype=torch.float16)] * 2]})
    assert bf == f16 and bf.describe() != f16.describe()  # same copies, different bytes
    mla = KVLayout.mla(3, 1152, indexer_bytes=132)
    assert [g.kind for g in mla.groups] == ["mla", "mla_indexer"]
    assert mla.chunk_bytes(2) == 3 * 2 * (1152 + 132)


def test_layout_rejects_bad_kinds():
    with pytest.raises(ValueError, match="kind must be one of"):
        KVGroup("x", 1, 2, 64, kind="linear")
    with pytest.raises(TypeError, match="needs window"):
        KVGroup("x", 1, 2, 64, kind="sliding")
    with pytest.raises(ValueError, match="window applies to kind 'sliding' only"):
        KVGroup("x", 1, 2, 64, window=128)
    with pytest.raises(ValueError, match="kinds names groups"):
        KVLayout.from_tensors({"kv": [[torch.zeros(4, 8)] * 2]}, kinds={"nope": "ssm"})


def test_window_first_block():
    # 10 blocks of 16 tokens: the last token is in block 9 (tokens 144..159); a 40-token window
    # ending at token 144 starts at token 105, block 6
    assert window_first_block(10, 40, 16) == 6
    assert window_first_block(10, 16, 16) == 8  # ends at 144: starts at 129 (block 8)
    assert window_first_block(10, 1, 16) == 9
    assert window_first_block(3, 4096, 16) == 0


@pytest.mark.parametrize("path", ["cpu", "torch"])
@pytest.mark.parametrize("pooled", [True, False])
def test_dma_round_trip_every_kind_with_skips(path, pooled):
    src, layout = hybrid_caches(pooled, seed=1)
    dst, _ = hybrid_caches(pooled, seed=2)
    host = create_host_arena(8, slot_bytes_for(layout.chunk_bytes(BPC)))
    try:
        opts = {"_torch_path_on_cpu": True} if path == "torch" else {}
        store = DmaEngine(layout, src, host, BPC, **opts)
        load = DmaEngine(layout, dst, host, BPC, **opts)
        attn = ["full", "swa", "mla", "idx"]
        # three chunks; per-group blocks differ (a hybrid allocator); the last chunk is partial
        spec = []
        for c in range(3):
            n = BPC if c < 2 else 2
            d = {g: [(5 * c + 3 * i + j) % NBLOCKS for j in range(n)] for i, g in enumerate(attn)}
            d["conv"] = d["ssm"] = [c + 1]
            spec.append(d)
        store.submit_store(1, [(s, slot) for slot, s in enumerate(spec)])
        assert store.poll() == [1]
        before = {g: [block_bytes(dst, g, b) for b in range(NBLOCKS if g in attn else NSTATES)] for g in dst}
        # load into other blocks; sliding group: first two positions skipped; state: last chunk only
        lspec = []
        for c in range(3):
            n = BPC if c < 2 else 2
            d = {g: [(7 * c + 11 * i + j + 20) % NBLOCKS for j in range(n)] for i, g in enumerate(attn)}
            if c == 0:
                d["swa"] = [-1, -1] + d["swa"][2:]
            d["conv"] = d["ssm"] = [9] if c == 2 else [-1]
            lspec.append(d)
        load.submit_load(2, [(s, slot) for slot, s in enumerate(lspec)])
        assert load.poll() == [2]
        written = {g: set() for g in dst}
        for c in range(3):
            for g in dst:
                for p, b in enumerate(lspec[c][g]):
                    if b < 0:
                        continue
                    sb = spec[c][g][p]
                    assert block_bytes(dst, g, b) == block_bytes(src, g, sb), (g, c, p)
                    written[g].add(b)
        for g in dst:  # nothing else on the device changed: skipped positions were not written
            for b, old in enumerate(before[g]):
                if b not in written[g]:
                    assert block_bytes(dst, g, b) == old, (g, b)
        assert written["conv"] == {9} and block_bytes(dst, "conv", 9) == block_bytes(src, "conv", 3)
    finally:
        host.close()


def test_dma_rejects_bad_group_ids():
    kv, layout = hybrid_caches(pooled=True)
    host = create_host_arena(4, slot_bytes_for(layout.chunk_bytes(BPC)))
    try:
        dma = DmaEngine(layout, kv, host, BPC)
        with pytest.raises(ValueError, match="names KV groups"):
            dma.submit_store(1, [({"nope": [1]}, 0)])
        with pytest.raises(ValueError, match="takes a state slot"):
            dma.submit_store(2, [({"conv": [1, 2]}, 0)])
        with pytest.raises(IndexError, match="state slot 12 out of range"):
            dma.submit_store(3, [({"conv": [NSTATES]}, 0)])
        with pytest.raises(ValueError, match="loaded twice"):
            dma.submit_load(4, [({"ssm": [1]}, 0), ({"ssm": [1]}, 1)])
    finally:
        host.close()


def test_dma_takes_any_mapping_and_names_bad_block_ids():
    """Chunks given per group as any read-only mapping (not only a dict) copy the same bytes;
    a bad id of an attention group is refused naming it, with nothing copied."""
    from types import MappingProxyType

    src, layout = hybrid_caches(pooled=False, seed=3)
    dst, _ = hybrid_caches(pooled=False, seed=4)
    host = create_host_arena(4, slot_bytes_for(layout.chunk_bytes(BPC)))
    try:
        store = DmaEngine(layout, src, host, BPC)
        load = DmaEngine(layout, dst, host, BPC)
        spec = {g.name: ([2] if g.is_state else [4, 5, 6, 7]) for g in layout.groups}
        store.submit_store(1, [(MappingProxyType(spec), 0)])
        back = {g.name: ([7] if g.is_state else [20, 21, -1, 23]) for g in layout.groups}
        before = {g: block_bytes(dst, g, 22) for g in ("full", "swa")}
        load.submit_load(2, [(MappingProxyType(back), 0)])
        assert store.poll() == [1] and load.poll() == [2]
        for g in ("full", "swa", "mla", "idx"):
            for p, b in ((0, 20), (1, 21), (3, 23)):
                assert block_bytes(dst, g, b) == block_bytes(src, g, 4 + p), (g, b)
        assert {g: block_bytes(dst, g, 22) for g in before} == before  # -1: position 2 not written
        assert block_bytes(dst, "conv", 7) == block_bytes(src, "conv", 2)
        dst_before = {g.name: [block_bytes(dst, g.name, b) for b in range(8)] for g in layout.groups
                      if not g.is_state}
        for bad, word in ((NBLOCKS, f"device block {NBLOCKS} out of range"), (-2, "device block -2 out of range")):
            with pytest.raises(IndexError, match=word):
                load.submit_load(3, [({"full": [0, 1, 2, 3]}, 1), ({"swa": [4, bad, 6, 7]}, 2)])
        with pytest.raises(ValueError, match="KV group 'full' is loaded twice"):
            load.submit_load(4, [({"full": [0, 1, 2, 3]}, 1), ({"full": [3, 4, 5, 6]}, 2)])
        assert load.poll() == []
        assert {n: [block_bytes(dst, n, b) for b in range(8)] for n in dst_before} == dst_before
    finally:
        host.close()


def test_chunk_specs_window_and_state():
    _, layout = hybrid_caches(pooled=True)
    keys = tuple(bytes([i]) * 8 for i in range(4))
    blocks = list(range(16))
    spec = chunk_specs(layout, keys, blocks, BPC, load=True, state_slot=5, tokens_per_block=TPB)
    # 16 blocks: last in block 15 -> window of 40 tokens from token 240 starts at 201: block 12
    assert [spec[j]["swa"] for j in range(4)] == [[-1] * 4, [-1] * 4, [-1] * 4, [12, 13, 14, 15]]
    assert spec[0]["full"] == [0, 1, 2, 3] and spec[3]["conv"] == [5] and spec[0]["ssm"] == [-1]
    full_copy = sum(copied_bytes(layout, BPC, {g.name: [1] * g.positions(BPC) for g in layout.groups})
                    for _ in keys)
    assert sum(copied_bytes(layout, BPC, s) for s in spec) < full_copy
    with pytest.raises(ValueError, match="pass state_slot"):
        chunk_specs(layout, keys, blocks, BPC, load=True, tokens_per_block=TPB)
    with pytest.raises(ValueError, match="one state slot per chunk"):
        chunk_specs(layout, keys, blocks, BPC, load=False, state_slots=[1, 2])
    with pytest.raises(ValueError, match="missing"):
        chunk_specs(layout, keys, {"full": blocks}, BPC, load=False, state_slots=[1, 2, 3, 4])
    store = chunk_specs(layout, keys, blocks, BPC, load=False, state_slots=[1, 2, 3, 4])
    assert store[2]["swa"] == [8, 9, 10, 11]  # stores keep the whole chunk
    with pytest.raises(ValueError, match="no SSM group"):
        chunk_specs(KVLayout.flat(2, 64), keys, blocks, BPC, load=False, state_slots=[1, 2, 3, 4])


def _manager(tiers, kv=None):
    src, layout = hybrid_caches(pooled=False, seed=3)
    kv = src if kv is None else kv
    cfg = {"host_bytes": 8 * slot_bytes_for(layout.chunk_bytes(BPC)), "blocks_per_chunk": BPC, "tiers": tiers}
    mgr = TieringManager.from_config(cfg, kv, layout=layout, tokens_per_block=TPB,
                                     namespace_fields={"model": "hybrid-test"})
    return kv, layout, mgr


def _settle(mgr) -> None:
    deadline = time.monotonic() + 120
    while mgr.pending():
        assert time.monotonic() < deadline, "manager did not settle in 120 s"
        mgr.poll()
        time.sleep(0.002)


@pytest.mark.parametrize("tier", ["memory", "fs", "obj"])
def test_manager_hybrid_store_and_partial_load_byte_exact(tmp_path, tier, request):
    """Store 6 chunks (fp8 e4m3/e5m2, bf16, int8, fp32 groups), then load 5 into fresh blocks
    (fs, obj: from the tier, in a second manager with an empty arena): full/MLA/indexer get
    every block, the window only its blocks, the state slot the state after chunk 5; nothing
    else on the device changes."""
    tiers = {"memory": lambda: [{"type": "memory"}], "fs": lambda: [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
             "obj": lambda: [{"type": "obj", **request.getfixturevalue("obj_options")}]}[tier]()
    kv, layout, mgr = _manager(tiers)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    try:
        assert mgr.namespace.fields["layout"] == layout.describe()
        (res,) = mgr.wait([mgr.store(keys, list(range(6 * BPC)), state_slots=[0, 1, 2, 3, 4, 5])], timeout=60)
        assert not res.failed_keys and not res.skipped_keys
        _settle(mgr)
        expect = {g: [block_bytes(kv, g, b) for b in range(NBLOCKS)] for g in ("full", "swa", "mla", "idx")}
        states = {g: [block_bytes(kv, g, s) for s in range(6)] for g in ("conv", "ssm")}
        if tier != "memory":  # a new instance, its own device tensors, loads from the tier
            mgr.close()
            kv, _ = hybrid_caches(pooled=False, seed=4)
            kv, _, mgr = _manager(tiers, kv)
        gen = torch.Generator().manual_seed(99)  # scramble the device
        for t in (t for g in kv.values() for layer in g for t in layer):
            _fill(t, gen)
        before = {g: [block_bytes(kv, g, b) for b in range(NBLOCKS if g not in ("conv", "ssm") else NSTATES)]
                  for g in kv}
        look = mgr.lookup(keys[:5])
        deadline = time.monotonic() + 120
        while look.retry and time.monotonic() < deadline:
            time.sleep(0.002)
            look = mgr.lookup(keys[:5])
        assert look.num_chunks == 5
        assert set(look.sources) == {"host" if tier == "memory" else tier}
        dst = list(range(24, 24 + 5 * BPC))
        (res,) = mgr.wait([mgr.load(keys[:5], dst, state_slot=10)], timeout=60)
        assert not res.failed_keys, res
        first = window_first_block(5 * BPC, 40, TPB)
        assert first > 0
        for i, b in enumerate(dst):
            for g in ("full", "mla", "idx"):
                assert block_bytes(kv, g, b) == expect[g][i], (g, i)
            if i >= first:
                assert block_bytes(kv, "swa", b) == expect["swa"][i], i
            else:  # outside the window: not copied
                assert block_bytes(kv, "swa", b) == before["swa"][b], i
        for g in ("conv", "ssm"):
            assert block_bytes(kv, g, 10) == states[g][4]  # the state after chunk 5
            for s in range(NSTATES):
                if s != 10:
                    assert block_bytes(kv, g, s) == before[g][s]
    finally:
        mgr.close()


def test_manager_hybrid_needs_state_slots(tmp_path):
    kv, layout, mgr = _manager([{"type": "memory"}])
    try:
        with pytest.raises(ValueError, match="state_slots"):
            mgr.store([b"k" * 16], list(range(BPC)))
    finally:
        mgr.close()
    plain = {"kv": [[torch.zeros(8, 64)] * 2]}
    with TieringManager.from_config({"host_bytes": 1 << 20, "blocks_per_chunk": 1, "tiers": []}, plain) as m:
        with pytest.raises(ValueError, match="layout has no SSM group"):
            m.store([b"k" * 16], [1], state_slots=[0])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("path", ["cpu", "torch"])
def test_dtypes_byte_exact_through_the_dma_engine(dtype, path):
    gen = torch.Generator().manual_seed(7)
    src = {"kv": [[torch.empty(16, 8, 4, 8, dtype=dtype) for _ in range(2)] for _ in range(3)]}
    dst = {"kv": [[torch.zeros(16, 8, 4, 8, dtype=dtype) for _ in range(2)] for _ in range(3)]}
    for t in (t for layer in src["kv"] for t in layer):
        _fill(t, gen)
    layout = KVLayout.from_tensors(src)
    assert layout.groups[0].dtype == str(dtype).removeprefix("torch.")
    host = create_host_arena(4, slot_bytes_for(layout.chunk_bytes(2)))
    try:
        opts = {"_torch_path_on_cpu": True} if path == "torch" else {}
        a = DmaEngine(layout, src, host, 2, **opts)
        b = DmaEngine(layout, dst, host, 2, **opts)
        a.submit_store(1, [([3, 9], 0), ([4, 5], 1)])
        b.submit_load(1, [([0, 1], 0), ([14, 2], 1)])
        for s, d in [(3, 0), (9, 1), (4, 14), (5, 2)]:
            assert block_bytes(dst, "kv", d) == block_bytes(src, "kv", s)
        assert np.count_nonzero(host.ndarray()[2:]) == 0
    finally:
        host.close()


@pytest.mark.parametrize("model", ["hybrid-swa", "hybrid-ssm"])
def test_hybrid_demo_verifies_every_copied_byte(tmp_path, model):
    from kvtiers.commands.demo.chat import run_demo

    tally, _, info = run_demo(turns=3, conversations=3, tier_dir=str(tmp_path), seed=1, device_name="cpu",
                              quiet=True, model=model, override={"tiers": [{"type": "memory"}]})
    assert info["model"] == model
    assert tally.mismatches == 0 and tally.verified_chunks > 0
    assert 0 < tally.device_bytes < tally.full_bytes  # window-only blocks / last state only


@pytest.mark.parametrize("model", ["hybrid-swa", "hybrid-ssm"])
def test_hybrid_demo_catches_a_wrong_window_or_state(tmp_path, model, monkeypatch):
    """The demo's check is real: loads that skip the window, or restore the first chunk's
    state instead of the last, are reported as mismatches."""
    import kvtiers.engine.hybrid as hybrid
    from kvtiers.commands.demo.chat import run_demo

    if model == "hybrid-swa":
        monkeypatch.setattr(hybrid, "window_first_block", lambda n, w, t: n)
    else:
        real = hybrid.chunk_specs

        def first_state(*a, **kw):
            specs = real(*a, **kw)
            if kw.get("load") and len(specs) > 1:
                specs[0] = {**specs[0], "conv": specs[-1]["conv"], "ssm": specs[-1]["ssm"]}
                specs[-1] = {**specs[-1], "conv": [-1], "ssm": [-1]}
            return specs

        monkeypatch.setattr(hybrid, "chunk_specs", first_state)
    tally, _, _ = run_demo(turns=3, conversations=3, tier_dir=str(tmp_path), seed=1, device_name="cpu",
                           quiet=True, model=model, override={"tiers": [{"type": "memory"}]})
    assert tally.mismatches > 0


@pytest.mark.parametrize("model", ["hybrid-swa", "hybrid-ssm"])
def test_bench_arena_covers_hybrids(model):
    from kvtiers.commands.bench.arena import run_bench

    res = {r["op"]: r for r in run_bench([1 << 20], 4, 3, ["separate"], "cpu", model)}
    assert res["store"]["bytes"] == res["store"]["full_bytes"]  # stores keep whole chunks
    assert 0 < res["load"]["bytes"] < res["load"]["full_bytes"]  # loads: window / last state only
    assert res["load"]["model"] == model and res["load"]["gbps"] > 0 and res["load"]["ratio"] > 0


@pytest.mark.parametrize("pooled", [True, False])
def test_dma_masked_merges_consecutive_chunks_byte_exact(pooled):
    """Full chunks of consecutive blocks to consecutive slots take one strided copy per tensor
    on the masked path; a window that starts mid-run and the last state still land exactly."""
    src, layout = hybrid_caches(pooled, seed=5)
    dst, _ = hybrid_caches(pooled, seed=6)
    host = create_host_arena(6, slot_bytes_for(layout.chunk_bytes(BPC)))
    try:
        a, b = DmaEngine(layout, src, host, BPC), DmaEngine(layout, dst, host, BPC)
        attn = ["full", "swa", "mla", "idx"]
        st = [{**{g: list(range(4 * c, 4 * c + 4)) for g in attn}, "conv": [c], "ssm": [c]} for c in range(5)]
        a.submit_store(1, [(x, c + 1) for c, x in enumerate(st)])
        ld = [{**{g: list(range(20 + 4 * c, 24 + 4 * c)) for g in attn}, "conv": [-1], "ssm": [-1]} for c in range(5)]
        for c in range(3):
            ld[c]["swa"] = [-1] * 4
        ld[3]["swa"] = [-1, -1, 34, 35]
        ld[4]["conv"] = ld[4]["ssm"] = [11]
        before = block_bytes(dst, "swa", 33)
        b.submit_load(2, [(x, c + 1) for c, x in enumerate(ld)])
        for c in range(5):
            for g in attn:
                for p in range(4):
                    if ld[c][g][p] >= 0:
                        assert block_bytes(dst, g, ld[c][g][p]) == block_bytes(src, g, st[c][g][p]), (g, c, p)
        assert block_bytes(dst, "swa", 33) == before
        for g in ("conv", "ssm"):
            assert block_bytes(dst, g, 11) == block_bytes(src, g, 4)
    finally:
        host.close()
