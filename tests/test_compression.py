"""The ``"compress"`` option (docs/compression.md) on real tiers: lossless codecs give every
byte of bf16 KV back and store fewer bytes; fp8 stays within its stated error bound and lives
in a namespace an exact reader never loads from; compress composes with encrypt; a damaged
piece fails its load, then answers MISS; bad options are one-line errors at open."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtiers import Arena, ConfigError, Job, Lookup, Namespace, TierContext
from kvtiers.compression import HEADER, read_header
from kvtiers.registry import open_tier

pytest.importorskip("zstandard")
pytest.importorskip("lz4")

SLOT = 256 << 10
N = 8


def kv_bf16(seed: int, nbytes: int = SLOT) -> bytes:
    """bf16 KV-like values: normal per head dim, scaled per head (as K and V come out of a model)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(nbytes // 2).astype(np.float32).reshape(-1, 8, 128)
    x *= np.exp(rng.standard_normal((1, 8, 1))).astype(np.float32)
    bits = x.ravel().view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def bf16_to_f32(b: bytes) -> np.ndarray:
    return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def wait(h, jid: int, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in h.get_finished_jobs():
            if r.job_id == jid:
                return r
        time.sleep(0.005)
    raise AssertionError(f"job {jid} not reported in {timeout} s")


def resolve(h, keys: list[bytes], timeout: float = 30.0) -> list[Lookup]:
    """Lookups until none answers RETRY (a fresh fs instance probes its medium first)."""
    deadline = time.monotonic() + timeout
    while True:
        answers = h.lookup(keys)
        if Lookup.RETRY not in answers or time.monotonic() > deadline:
            return answers
        time.sleep(0.01)


def ctx_for(dtype: str = "bfloat16") -> TierContext:
    return TierContext(Arena.allocate(N, SLOT), Namespace({"model": "test", "dtype": dtype}))


def store_load(h, ctx, chunks: list[bytes], keys: list[bytes]):
    for i, c in enumerate(chunks):
        ctx.arena[i][:] = c
    r = wait(h, _submit(h, "store", keys))
    assert r.ok, r.error
    assert [bytes(ctx.arena[i]) for i in range(len(chunks))] == chunks  # the slot never saw encoded bytes
    for i in range(len(chunks)):
        ctx.arena[i][:] = bytes(SLOT)
    return wait(h, _submit(h, "load", keys))


_ids = iter(range(1, 1 << 30))


def _submit(h, kind: str, keys: list[bytes]) -> int:
    jid = next(_ids)
    (h.submit_store if kind == "store" else h.submit_load)(Job(jid, tuple(keys), tuple(range(len(keys)))))
    return jid


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_lossless_gives_every_byte_back_and_stores_less(tmp_path, codec):
    ctx = ctx_for()
    h = open_tier("fs", {"root_dir": str(tmp_path), "compress": {"codec": codec}}, ctx)
    chunks = [kv_bf16(i) for i in range(N - 1)] + [os.urandom(SLOT)]  # the last does not compress
    keys = [b"key%d" % i for i in range(N)]
    r = store_load(h, ctx, chunks, keys)
    assert r.ok, r.error
    assert [bytes(ctx.arena[i]) for i in range(N)] == chunks
    stats = h.hooks.stats
    assert stats["multi_piece"] == 1  # the random chunk: two pieces, loaded whole
    kv_ratio = (N - 1) * SLOT / (stats["stored_bytes"] - 2 * h.hooks.piece_bytes)
    assert kv_ratio >= (1.3 if codec == "zstd" else 1.05), kv_ratio
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.bin"))  # the pieces, as the tier keeps them
    assert stats["stored_bytes"] <= on_disk <= stats["stored_bytes"] + N * 8192, on_disk
    h.close()


def test_fp8_error_bound_and_its_own_namespace(tmp_path):
    ctx = ctx_for()
    lossy = open_tier("fs", {"root_dir": str(tmp_path), "compress": {"codec": "fp8", "lossy": True}}, ctx)
    chunks = [kv_bf16(10 + i) for i in range(N)]
    keys = [b"fp8-%d" % i for i in range(N)]
    r = store_load(lossy, ctx, chunks, keys)
    assert r.ok, r.error
    assert lossy.hooks.ratio > 1.85
    for i, c in enumerate(chunks):
        x, y = bf16_to_f32(c), bf16_to_f32(bytes(ctx.arena[i]))
        m = np.repeat(np.abs(x).reshape(-1, 128).max(axis=1), 128)
        bound = np.abs(x) / 16 + np.abs(x) / 256 + m / 2 ** 18  # docs/compression.md
        assert (np.abs(y - x) <= bound).all(), float((np.abs(y - x) / bound).max())
        assert (y != x).any()  # it is lossy
    lossy.close()
    # an exact reader on the same medium, compressed or not, never finds the fp8 chunks
    # (pieces of the fp8 size, so only the namespace tells them apart)
    piece = lossy.hooks.piece_bytes
    for opts in ({"compress": {"codec": "zstd", "piece_bytes": piece}}, {}):
        exact = open_tier("fs", {"root_dir": str(tmp_path), **opts}, ctx_for())
        assert resolve(exact, keys) == [Lookup.MISS] * N
        exact.close()


def test_lossless_chunks_are_not_an_uncompressed_readers(tmp_path):
    ctx = ctx_for()
    # pieces of a whole slot: files of the size an uncompressed reader keeps, only the namespace differs
    h = open_tier("fs", {"root_dir": str(tmp_path), "compress": {"codec": "zstd", "piece_bytes": SLOT}}, ctx)
    keys = [b"z%d" % i for i in range(N)]
    assert store_load(h, ctx, [kv_bf16(i) for i in range(N)], keys).ok
    h.close()
    plain = open_tier("fs", {"root_dir": str(tmp_path)}, ctx_for())
    assert resolve(plain, keys) == [Lookup.MISS] * N
    plain.close()


def test_compress_then_seal(tmp_path):
    from kvtiers.encryption import HEADER as SEALED
    from kvtiers.encryption import read_header as sealed_header

    key = tmp_path / "k.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    ctx = ctx_for()
    root = tmp_path / "kv"
    h = open_tier("fs", {"root_dir": str(root), "compress": {"codec": "zstd"},
                         "encrypt": {"key_file": str(key), "key_id": "k1"}}, ctx)
    chunks = [kv_bf16(i) for i in range(N)]
    r = store_load(h, ctx, chunks, [b"s%d" % i for i in range(N)])
    assert r.ok, r.error
    assert [bytes(ctx.arena[i]) for i in range(N)] == chunks
    files = list(root.rglob("*.bin"))
    assert len(files) == N
    for f in files:  # sealed on the medium, and smaller than a chunk: compressed before sealing
        data = f.read_bytes()
        assert sealed_header(data[:SEALED.size])[0] == "k1"
        assert len(data) < SLOT
    h.close()


def test_a_damaged_piece_fails_its_load_then_answers_miss(tmp_path):
    ctx = ctx_for()
    h = open_tier("memory", {"compress": {"codec": "zstd"}}, ctx)
    keys = [b"d%d" % i for i in range(2)]
    chunks = [kv_bf16(1), os.urandom(SLOT)]
    for i, c in enumerate(chunks):
        ctx.arena[i][:] = c
    assert wait(h, _submit(h, "store", keys)).ok
    tier = h.tier  # the memory tier's own store: flip one payload byte of each chunk's first piece
    store = next(v for v in vars(tier).values() if isinstance(v, dict) and keys[0] in v)
    for k in keys:
        buf = bytearray(store[k])
        read_header(buf)
        buf[HEADER.size + 100] ^= 0xFF
        store[k] = bytes(buf)
    r = wait(h, _submit(h, "load", keys))
    assert set(r.failed_keys) == set(keys) and "CorruptChunk" in r.error, r
    assert h.lookup(keys) == [Lookup.MISS, Lookup.MISS]
    h.close()


@pytest.mark.parametrize("spec, words", [
    ({"codec": "brotli"}, "unknown codec 'brotli'"),
    ({"codec": "fp8"}, "say \"lossy\": true"),
    ({"codec": "zstd", "level": 99}, "'level' expects an int -7..22"),
    ({"codec": "lz4", "level": "fast"}, "'level' expects an int 0..16"),
    ({"codec": "zstd", "lossy": True}, "is lossless"),
    ({"codec": "zstd", "speed": 3}, "unknown key(s) ['speed']"),
    ({"codec": "zstd", "piece_bytes": 100}, "'piece_bytes' expects an int 4096.."),
    ("zstd", "expects an object"),
])
def test_bad_compress_is_one_line_at_open(tmp_path, spec, words):
    with pytest.raises(ConfigError) as e:
        open_tier("fs", {"root_dir": str(tmp_path), "compress": spec}, ctx_for())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tier 'fs': compress: ") and words in msg, msg


def test_fp8_needs_a_16_bit_dtype(tmp_path):
    ctx = TierContext(Arena.allocate(2, SLOT), Namespace({"dtype": "float32"}))
    with pytest.raises(ConfigError, match="needs 'dtype' one of"):
        open_tier("memory", {"compress": {"codec": "fp8", "lossy": True}}, ctx)
    h = open_tier("memory", {"compress": {"codec": "fp8", "lossy": True, "dtype": "float16"}}, ctx)
    x = (np.random.default_rng(0).standard_normal(SLOT // 2) * 4).astype(np.float16)
    ctx.arena[0][:] = x.tobytes()
    assert wait(h, _submit(h, "store", [b"h"])).ok
    ctx.arena[0][:] = bytes(SLOT)
    assert wait(h, _submit(h, "load", [b"h"])).ok
    y = np.frombuffer(ctx.arena[0], np.float16).astype(np.float32)
    xf = x.astype(np.float32)
    m = np.repeat(np.abs(xf).reshape(-1, 128).max(axis=1), 128)
    assert (np.abs(y - xf) <= np.abs(xf) / 16 + np.abs(xf) / 1024 + m / 2 ** 18 + 2 ** -24).all()
    h.close()


def test_through_the_manager_each_tenants_chunks_compressed_then_sealed_under_its_key(tmp_path):
    """The engine path: a manager config's tier entry with "compress" and tenant "encrypt";
    each submit's tenant goes with the tier's jobs the compressing wrapper makes later, so
    every piece on the medium is sealed under its tenant's key, and each tenant reloads its
    own chunks byte for byte while another tenant's load of them fails."""
    pytest.importorskip("cryptography")
    from test_encryption import _key
    from test_encryption_tenants import _kids, _reload, _store, _tenants, _tkey
    from test_manager import blocks_of, kv_caches, make_manager

    keys = {n: _key(tmp_path, n) for n in ("alice", "bob", "default")}
    root = tmp_path / "kv"
    entry = {"root_dir": str(root), "compress": {"codec": "zstd"}, "encrypt": _tenants(keys)}
    a_keys = [_tkey(i, "alice") for i in range(4)]
    b_keys = [_tkey(i, "bob") for i in range(4)]
    mgr, kv, _ = make_manager(8, tiers=[("fs", entry)], kv=kv_caches(0))
    try:
        _store(mgr, a_keys, 0, "alice")
        _store(mgr, b_keys, 4, "bob")
        assert mgr.tiers[0].handle.hooks.stats["encoded"] == 8
        want = blocks_of(kv, range(16))
    finally:
        mgr.close(timeout=5)
    kids = _kids(root)
    assert set(kids) == {"alice-1", "bob-1"} and kids["alice-1"] >= 4 and kids["bob-1"] >= 4, kids
    mgr, kv2, _ = make_manager(8, tiers=[("fs", entry)], kv=kv_caches(1))
    try:
        look, res = _reload(mgr, kv2, a_keys, 0, "alice")
        assert look.num_chunks == 4 and not res.failed_keys, res
        look, res = _reload(mgr, kv2, b_keys, 4, "bob")
        assert look.num_chunks == 4 and not res.failed_keys, res
        assert all(t.equal(w) for t, w in zip(blocks_of(kv2, range(16)), want, strict=True))
    finally:
        mgr.close(timeout=5)
    mgr, kv3, _ = make_manager(8, tiers=[("fs", entry)], kv=kv_caches(2))
    try:
        _look, res = _reload(mgr, kv3, a_keys, 0, "bob")
        assert set(res.failed_keys) == set(a_keys)
    finally:
        mgr.close(timeout=5)


def test_a_tenant_given_with_the_submit_seals_pieces_staged_after_the_call(tmp_path):
    """``as_tenant`` around the submit only (nothing noted): the compressing wrapper stages
    and hands the pieces to the sealing wrapper later, in get_finished_jobs, outside the
    scope; they are still sealed under that tenant's key."""
    pytest.importorskip("cryptography")
    from test_encryption import _key
    from test_encryption_tenants import _kids, _tenants

    from kvtiers.encryption.tenants import as_tenant

    keys = {n: _key(tmp_path, n) for n in ("alice", "bob", "default")}
    root = tmp_path / "kv"
    ctx = ctx_for()
    h = open_tier("fs", {"root_dir": str(root), "compress": {"codec": "zstd"}, "encrypt": _tenants(keys)}, ctx)
    for i in range(2):
        ctx.arena[i][:] = kv_bf16(i)
    with as_tenant(h, "alice"):
        _submit(h, "store", [b"a0", b"a1"])
    jid = next(_ids)
    with as_tenant(h, "bob"):
        h.submit_store(Job(jid, (b"b0",), (1,)))
    results = {}
    deadline = time.monotonic() + 30
    while len(results) < 2 and time.monotonic() < deadline:
        results.update({r.job_id: r for r in h.get_finished_jobs()})
        time.sleep(0.005)
    assert all(r.ok for r in results.values()), results
    h.close()
    assert _kids(root) == {"alice-1": 2, "bob-1": 1}
