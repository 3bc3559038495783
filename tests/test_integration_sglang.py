"""kvtiers tiers behind SGLang 0.5.23's HiCache storage interface (v1), on CPU.

What is SGLang's own code here (installed by ``make test`` with ``--no-deps``): the
``HiCacheStorage`` base class, ``HiCacheStorageConfig`` and ``StorageBackendFactory``, which
builds the backend exactly as ``--hicache-storage-backend dynamic`` does
(``class_name(storage_config, kwargs)`` from ``module_path``, then wraps it in its failure
injector). SGLang's package ``__init__`` imports triton and its front end, which a CPU test
machine lacks, so the modules are imported with that ``__init__`` skipped; they themselves
need only torch.

What is not: SGLang's host pools (``MHATokenToKVPoolHost`` needs triton, torchvision,
sgl-kernel and a device pool) and the cache controller's threads. ``HostPool`` below stands in
for the host pool: a real CPU tensor and ``get_page_buffer_meta`` with the pointer arithmetic
SGLang 0.5.23's MHA host pool uses for its ``page_first`` and ``layer_first`` layouts; the
tests call ``batch_exists`` / ``batch_set_v1`` / ``batch_get_v1`` as the controller's prefetch
and backup threads do, several at once, and check every byte that comes back.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

import pytest

torch = pytest.importorskip("torch")


def import_sglang_storage():
    """SGLang's storage modules, with the top-level package ``__init__`` skipped (see above)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang 0.5.23 is installed by `make test`")
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
    hs = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    return hs, factory.StorageBackendFactory


hicache, StorageBackendFactory = import_sglang_storage()

from kvtiers.errors import ConfigError  # noqa: E402
from kvtiers.integrations.sglang import KvtiersStorage  # noqa: E402

MODULE = "kvtiers.integrations.sglang"


class HostPool:
    """A stand-in for SGLang's MHA host pool: K and V planes in one CPU tensor, addressed by
    ``get_page_buffer_meta`` as SGLang's ``MHATokenToKVPoolHost`` does."""

    def __init__(self, layout: str, pages: int = 8, page_size: int = 4, layers: int = 2, heads: int = 2,
                 head_dim: int = 128, dtype=torch.float16) -> None:
        self.layout, self.page_size, self.size, self.dtype = layout, page_size, pages * page_size, dtype
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        shape = (2, self.size, layers, heads, head_dim) if layout == "page_first" else (2, layers, self.size, heads,
                                                                                         head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.row = heads * head_dim * dtype.itemsize  # bytes of one token of one layer

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        base, idx = self.kv_buffer.data_ptr(), indices.tolist()
        v_off = self.layer_num * self.size * self.row
        ptrs = []
        for i in range(0, len(idx), self.page_size):
            if self.layout == "page_first":
                k = base + idx[i] * self.layer_num * self.row
                ptrs += [k, k + v_off]
                size = self.layer_num * self.page_size * self.row
            else:
                for layer in range(self.layer_num):
                    k = base + idx[i] * self.row + layer * self.size * self.row
                    ptrs += [k, k + v_off]
                size = self.page_size * self.row
        return ptrs, [size] * len(ptrs)

    def page(self, p: int) -> bytes:
        """Every byte of page ``p``: K and V of every layer of its tokens."""
        sl = slice(p * self.page_size, (p + 1) * self.page_size)
        t = self.kv_buffer[:, sl] if self.layout == "page_first" else self.kv_buffer[:, :, sl]
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    def fill(self, p: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        sl = slice(p * self.page_size, (p + 1) * self.page_size)
        t = self.kv_buffer[:, sl] if self.layout == "page_first" else self.kv_buffer[:, :, sl]
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(self.dtype))

    def indices(self, pages: list[int]):
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])


def storage_config(extra: dict, *, tp_rank: int = 0, mla: bool = False):
    return hicache.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="org/tiny-model",
        extra_config={"backend_name": "kvtiers", "module_path": MODULE, "class_name": "KvtiersStorage",
                      "interface_v1": 1, **extra},
    )


def backend(pool: HostPool, extra: dict, **kw):
    """Built as SGLang's cache controller builds it: the factory's dynamic path, then the pool."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def inner(b) -> KvtiersStorage:
    return getattr(b, "_backend", b)  # the factory may wrap it in SGLang's failure injector


HASHES = [f"{i:064x}" for i in range(1, 7)]


@pytest.mark.parametrize("layout,mode", [("page_first", "zero-copy"), ("layer_first", "staged")])
def test_pages_round_trip_through_the_fs_tier(layout, mode, tmp_path) -> None:
    pool = HostPool(layout)
    b = backend(pool, {"tier": "fs", "root_dir": str(tmp_path), "zero_copy": None})
    kb = inner(b)
    assert isinstance(kb, KvtiersStorage) and isinstance(kb, hicache.HiCacheStorage)
    assert kb.layout.zero_copy is (mode == "zero-copy")
    try:
        assert b.batch_exists(HASHES) == 0
        for p in range(6):
            pool.fill(p, seed=p)
        want = {h: pool.page(p) for p, h in enumerate(HASHES)}
        # the backup thread writes pages 0-5 (host pages 0..5)
        assert b.batch_set_v1(HASHES, pool.indices(list(range(6)))) == [True] * 6
        assert b.batch_exists(HASHES) == 6
        assert b.batch_exists(HASHES[:3] + [f"{99:064x}"] + HASHES[3:]) == 3  # leading hits only
        # the prefetch thread reads them into other host pages, in another order
        pool.kv_buffer.zero_()
        dst = [7, 6, 2, 3, 1, 0]
        assert b.batch_get_v1(HASHES, pool.indices(dst)) == [True] * 6
        assert {h: pool.page(p) for h, p in zip(HASHES, dst, strict=True)} == want
    finally:
        b.close()
    # a new backend on the same directory (an SGLang restart) reads them back
    b2 = backend(pool, {"tier": "fs", "root_dir": str(tmp_path), "zero_copy": None})
    try:
        pool.kv_buffer.zero_()
        assert b2.batch_exists(HASHES) == 6
        assert b2.batch_get_v1(HASHES[:2], pool.indices([4, 5])) == [True, True]
        assert pool.page(4) == want[HASHES[0]] and pool.page(5) == want[HASHES[1]]
    finally:
        b2.close()


def test_missing_pages_fail_and_ranks_have_their_own_namespace(tmp_path) -> None:
    pool = HostPool("page_first")
    b0 = backend(pool, {"tier": "fs", "root_dir": str(tmp_path)}, tp_rank=0)
    b1 = backend(pool, {"tier": "fs", "root_dir": str(tmp_path)}, tp_rank=1)
    try:
        pool.fill(0, seed=9)
        assert b0.batch_set_v1(HASHES[:1], pool.indices([0])) == [True]
        assert b1.batch_exists(HASHES[:1]) == 0  # TP rank 1 holds other heads: not rank 0's bytes
        assert inner(b0).namespace.fields["tp"] == [0, 2] and inner(b1).namespace.fields["tp"] == [1, 2]
        assert b0.batch_get_v1(HASHES[:2], pool.indices([3, 4])) == [True, False]
    finally:
        b0.close()
        b1.close()


def test_memory_tier_under_concurrent_prefetch_and_backup_threads() -> None:
    pool = HostPool("page_first", pages=32)
    b = backend(pool, {"tier": "memory"})
    hashes = [f"{i:064x}" for i in range(100, 116)]
    for p in range(16):
        pool.fill(p, seed=100 + p)
    want = {h: pool.page(p) for p, h in enumerate(hashes)}
    errors = []

    def backup(lo: int) -> None:
        try:
            assert b.batch_set_v1(hashes[lo:lo + 4], pool.indices(list(range(lo, lo + 4)))) == [True] * 4
        except Exception as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=backup, args=(lo,)) for lo in range(0, 16, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [] and b.batch_exists(hashes) == 16
        got = {}

        def prefetch(lo: int) -> None:
            try:
                dst = list(range(16 + lo, 20 + lo))
                assert b.batch_get_v1(hashes[lo:lo + 4], pool.indices(dst)) == [True] * 4
                got.update({h: pool.page(p) for h, p in zip(hashes[lo:lo + 4], dst, strict=True)})
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=prefetch, args=(lo,)) for lo in range(0, 16, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [] and got == want
    finally:
        b.close()


def test_config_errors() -> None:
    pool = HostPool("page_first")
    with pytest.raises(ConfigError, match="name the tier"):
        backend(pool, {})
    with pytest.raises(ConfigError, match="root_dir"):
        backend(pool, {"tier": "fs"})
    with pytest.raises(ConfigError, match="unknown tier"):
        backend(pool, {"tier": "nope"})
    with pytest.raises(ValueError, match="cannot be arena slots"):
        backend(HostPool("page_first", head_dim=8), {"tier": "memory", "zero_copy": True})  # 256-byte pieces


def test_admit_is_refused_not_ignored(tmp_path) -> None:
    """"admit" is applied by the manager's cascade only: SGLang opens the tier directly, so the
    option would do nothing; it is one line naming it (was: accepted and ignored)."""
    with pytest.raises(ConfigError, match=r"option 'admit' is not applied .*SGLang"):
        backend(HostPool("page_first"), {"tier": "fs", "root_dir": str(tmp_path), "admit": {"min_offers": 2}})


# --- interface v2: hybrid models' side pools, with SGLang's own PoolTransfer and hit policies ---

PoolName, PoolHitPolicy, PoolTransfer = hicache.PoolName, hicache.PoolHitPolicy, hicache.PoolTransfer


class StatePool:
    """A stand-in for a side host pool (a Mamba state, an indexer): one piece of ``state``
    bytes per page of ``page_size`` slots, addressed as ``get_page_buffer_meta`` does."""

    def __init__(self, pages: int = 8, state: int = 8192, page_size: int = 1) -> None:
        self.page_size, self.size, self.state, self.layout, self.dtype = page_size, pages * page_size, state, None, None
        self.buf = torch.zeros(pages, state, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        idx = indices.tolist()[::self.page_size]
        return [self.buf.data_ptr() + (i // self.page_size) * self.state for i in idx], [self.state] * len(idx)

    def fill(self, p: int, seed: int) -> None:
        self.buf[p] = torch.randint(0, 256, (self.state,), generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.uint8)

    def page(self, p: int) -> bytes:
        return self.buf[p].numpy().tobytes()

    def indices(self, pages: list[int]):
        return torch.tensor([p * self.page_size for p in pages], dtype=torch.int64)


def hybrid_backend(kv: HostPool, sides: dict, extra: dict):
    """Built and attached as SGLang's hybrid cache controller does: the anchor pool, every
    pool by name (v2), then ``on_host_pools_registered``."""
    b = backend(kv, extra)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in sides.items():
        b.register_mem_host_pool_v2(pool, name)
    b.on_host_pools_registered()
    return b


def test_v2_side_pools_round_trip_with_their_hit_policies(tmp_path) -> None:
    kv, mamba, indexer = HostPool("page_first"), StatePool(), StatePool(state=4096)
    b = hybrid_backend(kv, {PoolName.MAMBA: mamba, PoolName.INDEXER: indexer},
                       {"tier": "fs", "root_dir": str(tmp_path)})
    try:
        for p in range(6):
            kv.fill(p, seed=p)
            indexer.fill(p, seed=50 + p)
        mamba.fill(5, seed=77)  # the state after page 5, the last of the prefix
        mamba.fill(3, seed=33)  # and after page 3
        want = ({h: kv.page(p) for p, h in enumerate(HASHES)}, {h: indexer.page(p) for p, h in enumerate(HASHES[:4])},
                {HASHES[3]: mamba.page(3), HASHES[5]: mamba.page(5)})
        done = b.batch_set_v2([
            PoolTransfer(PoolName.KV, host_indices=kv.indices(list(range(6))), keys=HASHES),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer.indices(list(range(4))), keys=HASHES[:4]),
            PoolTransfer(PoolName.MAMBA, host_indices=mamba.indices([3]), keys=[HASHES[3]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])
        assert done == {PoolName.KV: [True] * 6, PoolName.INDEXER: [True] * 4, PoolName.MAMBA: [True]}
        assert b.batch_exists(HASHES) == 6  # v1 and v2 share the KV pool's namespace

        def exists(*transfers):
            r = b.batch_exists_v2(HASHES, list(transfers))
            assert isinstance(r, hicache.PoolTransferResult)
            return r.kv_hit_pages, dict(r.extra_pool_hit_pages)

        trailing = PoolTransfer(PoolName.MAMBA, keys=[HASHES[5]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        # only the state after page 3 is stored: the prefix ends there (4 pages)
        assert exists(trailing) == (4, {"kv": 6, "mamba": 4})
        # every page needs its indexer page: 4 stored
        assert exists(PoolTransfer(PoolName.INDEXER, keys=HASHES, hit_policy=PoolHitPolicy.ALL_PAGES)) == \
            (4, {"kv": 6, "indexer": 4})
        # groups of 3 pages: one whole group of the indexer; its own verdict, the KV prefix stands
        assert exists(PoolTransfer(PoolName.INDEXER, keys=HASHES, hit_policy=PoolHitPolicy.BLOCK_GROUPS,
                                   group_pages=3)) == (6, {"kv": 6, "indexer": 3})
        assert b.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=mamba.indices([5]), keys=[HASHES[5]])]) \
            == {PoolName.MAMBA: [True]}
        assert exists(trailing) == (6, {"kv": 6, "mamba": 6})
        # the prefetch reads each pool's pages back into other host pages
        kv.kv_buffer.zero_()
        indexer.buf.zero_()
        mamba.buf.zero_()
        got = b.batch_get_v2([
            PoolTransfer(PoolName.KV, host_indices=kv.indices([7, 6, 5, 4, 3, 2]), keys=HASHES),
            PoolTransfer(PoolName.INDEXER, host_indices=indexer.indices([7, 6, 5, 4, 3]), keys=HASHES[:5]),
            PoolTransfer(PoolName.MAMBA, host_indices=mamba.indices([0, 1]), keys=[HASHES[5], HASHES[4]]),
        ])
        assert got == {PoolName.KV: [True] * 6, PoolName.INDEXER: [True] * 4 + [False],
                       PoolName.MAMBA: [True, False]}
        assert {h: kv.page(p) for h, p in zip(HASHES, [7, 6, 5, 4, 3, 2], strict=True)} == want[0]
        assert {h: indexer.page(p) for h, p in zip(HASHES[:4], [7, 6, 5, 4], strict=True)} == want[1]
        assert mamba.page(0) == want[2][HASHES[5]]
        # a pool SGLang never registered fails its pages, the others go on
        assert b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=mamba.indices([2]), keys=HASHES[:1]),
                               PoolTransfer(PoolName.KV, host_indices=kv.indices([1]), keys=HASHES[:1])]) == \
            {PoolName.SWA: [False], PoolName.KV: [True]}
        assert inner(b).namespace.fields.get("pool") is None  # the KV pool: v1's namespace
        assert {p.namespace.fields["pool"] for n, p in inner(b)._pools.items() if n != "kv"} == {"mamba", "indexer"}
    finally:
        b.close()


def test_v2_a_side_pools_pages_never_answer_for_another_pool(tmp_path) -> None:
    kv, mamba, swa = HostPool("page_first"), StatePool(), StatePool()
    b = hybrid_backend(kv, {PoolName.MAMBA: mamba, PoolName.SWA: swa}, {"tier": "fs", "root_dir": str(tmp_path)})
    try:
        kv.fill(0, seed=1)
        mamba.fill(0, seed=2)
        assert b.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv.indices([0]), keys=HASHES[:1]),
                               PoolTransfer(PoolName.MAMBA, host_indices=mamba.indices([0]), keys=HASHES[:1])]) \
            == {PoolName.KV: [True], PoolName.MAMBA: [True]}
        r = b.batch_exists_v2(HASHES[:1], [PoolTransfer(PoolName.SWA, keys=HASHES[:1],
                                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert r.kv_hit_pages == 0  # same hash, same bytes size, another pool: not its window
        assert b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=swa.indices([1]), keys=HASHES[:1])]) == \
            {PoolName.SWA: [False]}
        assert not swa.buf.any()
    finally:
        b.close()
