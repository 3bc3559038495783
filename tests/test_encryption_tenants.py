"""Tenant keys (kvtiers.encryption.tenants, docs/security.md#tenants), through the tiering
manager on real fs tiers: each tenant's chunks sealed under its own key and bound to it; a
tenant without a key not offloaded (counted); a chunk moved between tenants' files on disk
fails authentication; tenant names and keys stay out of logs and errors."""

from __future__ import annotations

import collections
import logging
import pathlib
import re
import shutil
import time

import pytest
from test_encryption import _key
from test_manager import blocks_of, chunk_blocks, kv_caches, make_manager, poison, settle
from tier_helpers import wait_job

from kvtiers import ConfigError
from kvtiers.encryption import HEADER, Keyring, read_header
from kvtiers.encryption.tenants import CONFLICT, TenantBook, TenantKeys, tenant_label

pytest.importorskip("cryptography")


@pytest.fixture
def keys(tmp_path) -> dict[str, str]:
    return {n: _key(tmp_path, n) for n in ("alice", "bob", "default")}


def _tenants(keys: dict[str, str], **extra) -> dict:
    """alice and bob each with a key of their own; other tenants: not offloaded."""
    return {"tenants": {"alice": {"key_file": keys["alice"], "key_id": "alice-1"},
                        "bob": {"key_file": keys["bob"], "key_id": "bob-1"}}, **extra}


def _tkey(i: int, tenant: str) -> bytes:
    """Chunk keys salted per tenant, as vLLM's cache_salt makes them."""
    return f"chunk-{i}-{tenant}".encode()


def _manager(root: pathlib.Path, enc: dict, seed: int = 0):
    return make_manager(8, tiers=[("fs", {"root_dir": str(root), "encrypt": enc})], kv=kv_caches(seed))


def _store(mgr, keys: list[bytes], first: int, tenant: str | None) -> None:
    tid = mgr.store(keys, [chunk_blocks(first + i) for i in range(len(keys))], tenant=tenant)
    (res,) = mgr.wait([tid], timeout=10)
    assert not res.failed_keys
    settle(mgr)


def _reload(mgr, kv, keys: list[bytes], first: int, tenant: str | None):
    """Lookup (promoting from the tier) until settled, then load into poisoned blocks."""
    blocks = [chunk_blocks(first + i) for i in range(len(keys))]
    poison(kv, [b for bl in blocks for b in bl])
    deadline = time.monotonic() + 10
    while True:
        look = mgr.lookup(keys, tenant=tenant)
        if not look.retry or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    tid = mgr.load(keys, blocks, tenant=tenant)
    (res,) = mgr.wait([tid], timeout=10)
    return look, res


def _kids(root: pathlib.Path) -> collections.Counter[str]:
    """Chunk files on the medium by the key id in their sealed header."""
    return collections.Counter(read_header(p.read_bytes()[:HEADER.size])[0] for p in root.rglob("*.bin"))


def _file(root: pathlib.Path, key: bytes) -> pathlib.Path:
    (p,) = root.rglob(key.hex() + ".bin")
    return p


# -- two tenants, one without a key -----------------------------------------------------------

def test_two_tenants_share_nothing_and_a_tenant_without_a_key_is_not_offloaded(tmp_path, keys, caplog):
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "kv"
    enc = _tenants(keys)
    a_keys = [_tkey(i, "alice") for i in range(4)]
    b_keys = [_tkey(i, "bob") for i in range(4)]
    c_keys = [_tkey(i, "carol") for i in range(2)]
    mgr, kv, _ = _manager(root, enc)
    try:
        _store(mgr, a_keys, 0, "alice")
        _store(mgr, b_keys, 4, "bob")
        _store(mgr, c_keys, 8, "carol")  # no key for carol: kept in the arena, never on the medium
        sealed = mgr.tiers[0].handle.hooks
        assert sealed.stats["tenant_skipped_store"] == 2
        assert sealed.tenant_stats[tenant_label("alice"), "sealed"] == 4
        assert sealed.tenant_stats[tenant_label("bob"), "sealed"] == 4
        assert mgr.stats.events["stored", "fs"] == 8
        want = blocks_of(kv, range(16))  # the blocks of alice's and bob's chunks
    finally:
        mgr.close(timeout=5)
    assert _kids(root) == {"alice-1": 4, "bob-1": 4}  # each tenant's chunks under its own key
    assert not any(list(root.rglob(k.hex() + ".bin")) for k in c_keys)

    # a new manager (nothing in its arena): each tenant reloads its own chunks, byte for byte
    mgr, kv2, _ = _manager(root, enc, seed=1)
    try:
        look, res = _reload(mgr, kv2, a_keys, 0, "alice")
        assert look.num_chunks == 4 and set(look.sources) == {"fs"} and not res.failed_keys
        look, res = _reload(mgr, kv2, b_keys, 4, "bob")
        assert look.num_chunks == 4 and not res.failed_keys
        assert all(t.equal(w) for t, w in zip(blocks_of(kv2, range(16)), want, strict=True))
        sealed = mgr.tiers[0].handle.hooks
        assert sealed.tenant_stats[tenant_label("alice"), "opened"] == 4
        assert sealed.tenant_stats[tenant_label("bob"), "opened"] == 4
    finally:
        mgr.close(timeout=5)

    # another tenant asking for alice's keys gets nothing: bob finds her files but can not open
    # them; carol (no key) and a request with no tenant (no default key) do not even ask the medium
    for tenant in ("bob", "carol", None):
        mgr, kv3, _ = _manager(root, enc, seed=2)
        try:
            look, res = _reload(mgr, kv3, a_keys, 0, tenant)
            assert set(res.failed_keys) == set(a_keys)
            sealed = mgr.tiers[0].handle.hooks
            assert sealed.stats["opened"] == 0
            if tenant == "bob":
                assert sealed.stats["open_failed_unknown_key"] == 4
            else:
                assert look.num_chunks == 0  # MISS: the medium was not asked
        finally:
            mgr.close(timeout=5)
    text = caplog.text + repr(sealed.keys)
    for secret in ("alice", "bob", "carol", *(pathlib.Path(k).read_bytes().hex() for k in keys.values())):
        assert secret not in text.replace("alice-1", "").replace("bob-1", "")


def test_a_key_noted_for_two_tenants_is_offloaded_for_neither(tmp_path, keys):
    root = tmp_path / "kv"
    mgr, _kv, _ = _manager(root, _tenants(keys))
    try:
        k = [b"unsalted-chunk"]
        mgr.lookup(k, tenant="alice")
        mgr.lookup(k, tenant="bob")
        tid = mgr.store(k, [chunk_blocks(0)], tenant="alice")
        mgr.wait([tid], timeout=10)
        settle(mgr)
        sealed = mgr.tiers[0].handle.hooks
        assert sealed.stats["tenant_conflict_store"] == 1 and sealed.stats["sealed"] == 0
        assert sealed.book.conflicts == 1
    finally:
        mgr.close(timeout=5)
    assert not list(root.rglob("*.bin"))


def test_a_key_noted_for_a_tenant_and_then_asked_with_none_is_a_conflict(tmp_path, keys):
    """docs/security.md#tenants: a key noted for alice and then asked for with no tenant
    (``as_tenant(tier, None)``, as the manager passes ``tenant=None``), with a default key
    that could seal it for nobody, is offloaded for neither: the lookup misses without asking
    the medium, the store fails and leaves alice's chunk as it was, the load fails as a
    conflict without opening anything and leaves the slot untouched."""
    from test_encryption import _pattern

    from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier
    from kvtiers.encryption.tenants import as_tenant

    root = tmp_path / "kv"
    enc = _tenants(keys, key_file=keys["default"], key_id="d-1")
    slot = 64 << 10
    ctx = TierContext(Arena.allocate(4, slot), Namespace({"model": "m"}))
    for i in range(2):
        ctx.arena[i][:] = _pattern(i, slot)
    k = b"unsalted-chunk"
    h = open_tier("fs", {"root_dir": str(root), "encrypt": enc}, ctx)
    try:
        with as_tenant(h, "alice"):
            h.submit_store(Job(1, (k,), (0,)))
        assert wait_job(h, 1, strict=False).ok
        alice_file = _file(root, k).read_bytes()
        assert _kids(root) == {"alice-1": 1}
        with as_tenant(h, None):
            assert h.lookup([k]) == [Lookup.MISS]
            h.submit_store(Job(2, (k,), (1,)))
        assert wait_job(h, 2, strict=False).failed_keys == (k,)
        assert _file(root, k).read_bytes() == alice_file
        ctx.arena[2][:] = b"\xa5" * slot
        with as_tenant(h, None):
            h.submit_load(Job(3, (k,), (2,)))
        assert wait_job(h, 3, strict=False).failed_keys == (k,)
        assert bytes(ctx.arena[2]) == b"\xa5" * slot
        stats = h.hooks.stats
        assert (stats["tenant_conflict_store"], stats["tenant_conflict_load"]) == (1, 1), stats
        assert not any(n.startswith("open_failed") for n in stats) and stats["sealed"] == 1, stats
        with as_tenant(h, "alice"):  # alice's own calls still reach her chunk
            h.submit_load(Job(4, (k,), (3,)))
        assert wait_job(h, 4, strict=False).ok and bytes(ctx.arena[3]) == _pattern(0, slot)
    finally:
        h.close()


def test_the_manager_checks_the_tenant_argument(tmp_path, keys):
    mgr, _kv, _ = _manager(tmp_path / "kv", _tenants(keys))
    try:
        with pytest.raises(TypeError, match="tenant must be a str"):
            mgr.lookup([b"k"], tenant=7)
        with pytest.raises(ValueError, match="non-empty"):
            mgr.store([b"k"], [chunk_blocks(0)], tenant="")
    finally:
        mgr.close(timeout=5)


# -- a chunk moved between tenants' files -------------------------------------------------------

def _store_in(root: pathlib.Path, enc: dict, key: bytes, tenant: str | None) -> None:
    mgr, _kv, _ = _manager(root, enc)
    try:
        _store(mgr, [key], 0, tenant)
    finally:
        mgr.close(timeout=5)


def _load_in(root: pathlib.Path, enc: dict, key: bytes, tenant: str | None):
    mgr, kv, _ = _manager(root, enc, seed=3)
    try:
        look, res = _reload(mgr, kv, [key], 0, tenant)
        return look, res, dict(mgr.tiers[0].handle.hooks.stats)
    finally:
        mgr.close(timeout=5)


def test_a_chunk_moved_to_another_tenants_file_fails(tmp_path, keys):
    """One chunk key (an engine that does not salt keys) stored for alice and for bob on two
    roots; alice's file copied over bob's: bob's load fails, never alice's bytes."""
    enc = _tenants(keys)
    k = b"same-chunk-key"
    ra, rb = tmp_path / "a", tmp_path / "b"
    _store_in(ra, enc, k, "alice")
    _store_in(rb, enc, k, "bob")
    assert _load_in(rb, enc, k, "bob")[1].failed_keys == ()  # bob's own copy opens
    shutil.copyfile(_file(ra, k), _file(rb, k))
    _look, res, stats = _load_in(rb, enc, k, "bob")
    assert res.failed_keys == (k,)
    assert stats["open_failed_unknown_key"] >= 1  # sealed under alice's key id, which bob has not
    assert _load_in(rb, enc, k, "alice")[1].failed_keys == ()  # the bytes are intact: alice's


def test_the_tenant_is_bound_even_under_one_shared_key(tmp_path, keys):
    """``unknown_tenant: default`` (and a plain single-key option with tenants noted): every
    tenant under the default key, each chunk bound to its tenant by the associated data."""
    for enc in ({"key_file": keys["default"]},
                {"key_file": keys["default"], "unknown_tenant": "default", **_tenants(keys)}):
        k = b"same-chunk-key"
        rx, ry = tmp_path / "x", tmp_path / "y"
        shutil.rmtree(rx, ignore_errors=True)
        shutil.rmtree(ry, ignore_errors=True)
        _store_in(rx, enc, k, "xavier")
        _store_in(ry, enc, k, "yolanda")
        shutil.copyfile(_file(rx, k), _file(ry, k))
        for tenant in ("yolanda", None):
            _look, res, stats = _load_in(ry, enc, k, tenant)
            assert res.failed_keys == (k,), enc
            assert stats["open_failed_auth"] >= 1  # same key id, same chunk key: only the tenant differs
        assert _load_in(ry, enc, k, "xavier")[1].failed_keys == ()


def test_single_key_config_without_tenants_is_unchanged(tmp_path, keys):
    """No tenant noted: the same sealed format as before tenants (loads as such)."""
    from kvtiers import Arena, Namespace, TierContext, open_tier
    from kvtiers.encryption import open_into, sealed_bytes

    root = tmp_path / "kv"
    mgr, _kv, _ = _manager(root, {"key_file": keys["default"]})
    try:
        _store(mgr, [b"plain-chunk"], 0, None)
        slot = mgr.arena.slot_bytes
    finally:
        mgr.close(timeout=5)
    data = _file(root, b"plain-chunk").read_bytes()[:sealed_bytes(slot)]  # the fs tier's own trailer after it
    kr = Keyring.from_spec({"key_file": keys["default"]})
    out = memoryview(bytearray(slot))
    ctx = TierContext(Arena.allocate(1, slot), Namespace({}))
    h = open_tier("fs", {"root_dir": str(tmp_path / "unused"), "encrypt": {"key_file": keys["default"]}}, ctx)
    try:
        assert open_into(kr, h.hooks.digest8, b"plain-chunk", memoryview(data), out) == kr.current
        assert len(TenantBook()) == 0 and h.hooks.keys.unknown == "default"
    finally:
        h.close()


# -- configuration -----------------------------------------------------------------------------

def test_tenant_configuration(keys):
    tk = TenantKeys.from_spec(_tenants(keys))
    assert tk.default is None and tk.unknown == "skip"
    assert tk.keyring_for("alice").current == "alice-1" and tk.keyring_for("carol") is None
    assert tk.keyring_for(None) is None
    assert "'alice'" not in repr(tk) and f"'{tenant_label('alice')}': 'alice-1'" in repr(tk)
    tk = TenantKeys.from_spec({"key_file": keys["default"], "key_id": "d-1", "unknown_tenant": "default",
                               **_tenants(keys)})
    assert tk.keyring_for("carol").current == "d-1" and tk.keyring_for(None).current == "d-1"
    single = TenantKeys.from_spec({"key_file": keys["default"]})
    assert single.unknown == "default" and single.keyring_for("anyone") is single.default

    bad = [
        ({**_tenants(keys), "unknown_tenant": "default"}, "needs a default key"),
        ({**_tenants(keys), "unknown_tenant": "share"}, "'unknown_tenant' expects one of 'skip', 'default'"),
        ({"tenants": {"alice": {"key_file": keys["alice"]}, "bob": {"key_file": keys["alice"]}}},
         "is configured for tenant 'alice' and for tenant 'bob'"),
        ({"key_file": keys["alice"], "tenants": {"alice": {"key_file": keys["alice"]}}},
         "configured for the default key and for tenant 'alice'"),
        ({"tenants": {"alice": {"key_file": keys["alice"], "threads": 2}}}, "'threads' is set for the whole"),
        ({"tenants": {"alice": {"key_env": "KVTIERS_NO_SUCH_VAR"}}}, r"tenants\['alice'\]: environment variable"),
        ({"tenants": {"alice": "k"}}, "expects a key object"),
        ({"tenants": {}}, "non-empty object"),
        ({"tenants": {"": {"key_file": keys["alice"]}}}, "non-empty string"),
        ({"key_id": "d", **_tenants(keys)}, "'key_id' belongs to a default key"),
    ]
    for spec, msg in bad:
        with pytest.raises(ConfigError, match=msg) as e:
            TenantKeys.from_spec(spec)
        assert "\n" not in str(e.value)
        for path in keys.values():
            assert pathlib.Path(path).read_bytes().hex() not in str(e.value)


def test_the_tenant_book_is_bounded_and_marks_conflicts():
    book = TenantBook(capacity=3)
    book.note([b"a", b"b", b"c"], "t")
    book.note([b"a"], "t")  # noted again: the most recent
    book.note([b"d"], "t")
    assert len(book) == 3 and book.get(b"b") is None and book.get(b"a") == "t"
    book.note([b"a"], "u")
    assert book.get(b"a") is CONFLICT and book.conflicts == 1
    book.note([b"a"], "t")  # stays a conflict
    assert book.get(b"a") is CONFLICT and book.conflicts == 1


# -- the tenant of a job is the job's, not the book's -------------------------------------------

def test_a_store_in_waves_stays_its_tenants_after_the_book_forgot_it(tmp_path, keys):
    """Issue 44 item 3: alice's store of 8 chunks through a 4-slot arena runs in two waves;
    between them bob looks up 70,000 keys (more than the tenant book holds), so the book no
    longer knows alice's keys when the second wave reaches the tier. Every chunk must still be
    sealed under alice's key and bound to her: none under the default key for nobody."""
    root = tmp_path / "kv"
    enc = {"key_file": keys["default"], "key_id": "default-1", **_tenants(keys)}
    a_keys = [_tkey(i, "alice") for i in range(8)]
    mgr, kv, _ = make_manager(4, tiers=[("fs", {"root_dir": str(root), "encrypt": enc})], kv=kv_caches(0))
    try:
        sealed = mgr.tiers[0].handle.hooks
        assert sealed.book.capacity < 70_000
        tid = mgr.store(a_keys, [chunk_blocks(i) for i in range(8)], tenant="alice")
        assert mgr._stores.pending() == 1  # the second wave waits for the first wave's slots
        mgr.lookup([f"bob-probe-{i}".encode() for i in range(70_000)], tenant="bob")
        assert sealed.book.get(a_keys[-1]) is None  # the book forgot alice's keys
        (res,) = mgr.wait([tid], timeout=20)
        assert not res.skipped_keys and not res.failed_keys
        settle(mgr)
        assert sealed.tenant_stats[tenant_label("alice"), "sealed"] == 8
        want = blocks_of(kv, range(16))
    finally:
        mgr.close(timeout=5)
    assert _kids(root) == {"alice-1": 8}  # none under the default key
    for tenant in (None, "bob"):  # nobody else opens any of them, not even under the default key
        mgr, kv2, _ = _manager(root, enc, seed=2)
        try:
            _look, res = _reload(mgr, kv2, a_keys[:4], 0, tenant)
            assert set(res.failed_keys) == set(a_keys[:4]), tenant
            _look, res = _reload(mgr, kv2, a_keys[4:], 4, tenant)
            assert set(res.failed_keys) == set(a_keys[4:]), tenant
        finally:
            mgr.close(timeout=5)
    mgr, kv3, _ = _manager(root, enc, seed=3)
    try:
        for half in (0, 4):
            _look, res = _reload(mgr, kv3, a_keys[half:half + 4], half, "alice")
            assert not res.failed_keys
        assert all(t.equal(w) for t, w in zip(blocks_of(kv3, range(16)), want, strict=True))
    finally:
        mgr.close(timeout=5)


# -- a failed load leaves none of the other tenant's bytes in the caller's slot -----------------

@pytest.mark.parametrize("shared", ["single key", "unknown_tenant default"])
def test_a_failed_load_under_a_shared_key_leaves_no_plaintext_in_the_slot(tmp_path, keys, shared):
    """Issue 44 item 4: two tenants under one AES key (a single-key option, as vLLM runs with
    one; or ``unknown_tenant: "default"``). In a tier opened again (its book empty), a
    no-tenant and bob's load of alice's chunks (keys not salted) fail authentication, and the
    slots they were to fill are zeroed: none of alice's bytes (GCM wrote them before the tag
    failed), for a small job (opened on the caller's thread) and a big one (on the wrapper's
    threads)."""
    from test_encryption import _pattern

    from kvtiers import Arena, Job, Namespace, TierContext, open_tier
    from kvtiers.encryption.tenants import as_tenant

    enc = ({"key_file": keys["default"]} if shared == "single key"
           else {"key_file": keys["default"], "unknown_tenant": "default", "tenants": {
               "carol": {"key_file": keys["alice"]}}})
    slot = 64 << 10
    ctx = TierContext(Arena.allocate(16, slot), Namespace({"model": "m"}))
    ks = [f"shared-{i}".encode() for i in range(8)]  # unsalted keys: the same for every tenant

    def tier():
        return open_tier("fs", {"root_dir": str(tmp_path / "kv"), "encrypt": enc}, ctx)

    h = tier()
    try:
        for i in range(8):
            ctx.arena[i][:] = _pattern(i, slot)
        with as_tenant(h, "alice"):
            h.submit_store(Job(1, tuple(ks), tuple(range(8))))
        assert wait_job(h, 1, strict=False).ok
    finally:
        h.close()
    h = tier()
    try:
        jid = 1
        for tenant in (None, "bob"):
            for part in (ks[:2], ks[2:]):  # 128 KiB: inline; 384 KiB: on the wrapper's threads
                slots = tuple(range(8, 8 + len(part)))
                for s in slots:
                    ctx.arena[s][:] = b"\xa5" * slot
                jid += 1
                with as_tenant(h, tenant):
                    h.submit_load(Job(jid, tuple(part), slots))
                res = wait_job(h, jid, strict=False)
                assert set(res.failed_keys) == set(part), (tenant, res)
                for s in slots:
                    assert bytes(ctx.arena[s]) == bytes(slot), (tenant, s)
        assert h.hooks.stats["open_failed_auth"] == 16 and h.hooks.stats["opened"] == 0
    finally:
        h.close()
    h = tier()
    try:  # alice's own loads open, byte for byte
        with as_tenant(h, "alice"):
            h.submit_load(Job(99, tuple(ks), tuple(range(8, 16))))
        assert wait_job(h, 99, strict=False).ok
        assert all(bytes(ctx.arena[8 + i]) == _pattern(i, slot) for i in range(8))
    finally:
        h.close()


def test_one_key_for_two_owners_under_any_ids_is_an_error_at_open(tmp_path, keys, monkeypatch):
    """Issue 44 item 12: the same key bytes configured for two owners (two tenants, a tenant
    and the default key, a tenant's current and another's retired key), under distinct key
    ids and in different encodings (raw file, hex file, environment variable), is refused
    when the tier opens: one line, naming the entries, never the key."""
    from kvtiers import Arena, Namespace, TierContext, open_tier

    raw = pathlib.Path(keys["alice"]).read_bytes()
    hexed = tmp_path / "alice-hex"
    hexed.write_text(raw.hex() + "\n")
    hexed.chmod(0o600)
    monkeypatch.setenv("KVTIERS_TEST_ALICE_AGAIN", raw.hex())
    alice = {"key_file": keys["alice"], "key_id": "alice-1"}
    cases = [
        ({"tenants": {"alice": alice, "bob": {"key_file": str(hexed), "key_id": "bob-1"}}},
         "for tenant 'alice' (key id 'alice-1') and for tenant 'bob' (key id 'bob-1')"),
        ({"tenants": {"alice": alice, "bob": {"key_env": "KVTIERS_TEST_ALICE_AGAIN"}}}, "and for tenant 'bob'"),
        ({"tenants": {"alice": alice, "bob": {"key_file": keys["bob"], "key_id": "bob-2",
                                              "retired": [{"key_file": str(hexed), "key_id": "bob-1"}]}}},
         "for tenant 'alice' (key id 'alice-1') and for tenant 'bob' (key id 'bob-1')"),
        ({"key_file": str(hexed), "key_id": "d-1", "tenants": {"alice": alice}},
         "for the default key (key id 'd-1') and for tenant 'alice' (key id 'alice-1')"),
    ]
    for enc, msg in cases:
        ctx = TierContext(Arena.allocate(2, 4096), Namespace({}))
        with pytest.raises(ConfigError, match=re.escape(msg)) as e:
            open_tier("fs", {"root_dir": str(tmp_path / "kv"), "encrypt": enc}, ctx)
        text = str(e.value)
        assert "\n" not in text and text.startswith("tier 'fs': encrypt: one key is configured")
        assert raw.hex() not in text and raw.hex().upper() not in text
    # one owner's own key under two ids (current and retired) is not two owners: accepted
    TenantKeys.from_spec({"tenants": {"alice": {**alice, "retired": [{"key_file": str(hexed), "key_id": "a-0"}]}}})


# -- what metrics, events, logs and the medium show ---------------------------------------------

def test_encrypt_metrics_count_and_nothing_shows_a_key_or_a_tenant_name(tmp_path, keys, caplog):
    """Issue 44 item 15 (docs/security.md): the ``kvtiers_encrypt_*`` series count seals, opens,
    open failures by reason and keys not offloaded by tenant reason; and no key (raw or hex)
    nor tenant name is in a metric, a cache event, a published KV event, a log line or
    anywhere on the medium (chunks, ``config.json``, the fs tier's own files)."""
    import hashlib

    from prometheus_client import CollectorRegistry, generate_latest
    from test_kvevents import drain, subscriber, wait_subscribed
    from test_metrics import samples, value

    from kvtiers.engine.kvevents import attach_kv_events
    from kvtiers.metrics import attach_metrics

    caplog.set_level(logging.DEBUG)
    names = {"alice": "alice-salt-5d1e", "bob": "bob-salt-90ac", "carol": "carol-salt-3b77"}
    enc = {"tenants": {names["alice"]: {"key_file": keys["alice"], "key_id": "a-1"},
                       names["bob"]: {"key_file": keys["bob"], "key_id": "b-1"}}}
    root = tmp_path / "kv"

    def k(tenant: str, i: int) -> bytes:  # salted keys that do not spell the tenant's name
        return hashlib.sha256(f"{names[tenant]}/{i}".encode()).digest()[:16]

    seen: list[str] = []
    payloads: list[bytes] = []

    def run(seed: int, work) -> dict:
        reg = CollectorRegistry()
        mgr, kv, _ = make_manager(8, tiers=[("fs", {"root_dir": str(root), "encrypt": enc})], kv=kv_caches(seed))
        mgr.add_listener(lambda ev: seen.append(repr(ev)))
        attach_metrics(mgr, {"interval": 0}, registry=reg)
        bridge = attach_kv_events(mgr, {"endpoint": "tcp://127.0.0.1:0", "topic": "kv"})
        zctx, sub = subscriber(bridge.publisher.endpoint)
        try:
            wait_subscribed(bridge.publisher, sub)
            work(mgr, kv)
            mgr.close(timeout=5)
            payloads.extend(p for _t, _s, p in drain(sub))
        finally:
            sub.close(linger=0)
            zctx.term()
            mgr.close(timeout=5)
        text = generate_latest(reg).decode()
        seen.append(text)
        return samples(text)

    shared = b"unsalted-shared"

    def first(mgr, kv):
        _store(mgr, [k("alice", i) for i in range(4)] + [shared], 0, names["alice"])
        _store(mgr, [k("bob", i) for i in range(4)], 5, names["bob"])
        _store(mgr, [k("carol", i) for i in range(2)], 9, names["carol"])  # no key: not offloaded
        both = [b"noted-twice"]
        mgr.lookup(both, tenant=names["alice"])
        mgr.lookup(both, tenant=names["bob"])
        _store(mgr, both, 11, names["alice"])  # a conflict: offloaded for neither

    found = run(0, first)
    fs = {"tier": "fs"}
    assert value(found, "kvtiers_encrypt_chunks_total", op="seal", **fs) == 9
    assert value(found, "kvtiers_encrypt_tenant_skipped_total", op="store", reason="skipped", **fs) == 2
    assert value(found, "kvtiers_encrypt_tenant_skipped_total", op="store", reason="conflict", **fs) == 1

    def second(mgr, kv):
        _look, res = _reload(mgr, kv, [k("alice", i) for i in range(4)], 0, names["alice"])
        assert not res.failed_keys
        _look, res = _reload(mgr, kv, [shared], 4, names["bob"])  # alice's chunk, asked for as bob's
        assert res.failed_keys == (shared,)

    found = run(1, second)
    assert value(found, "kvtiers_encrypt_chunks_total", op="open", **fs) == 4
    assert value(found, "kvtiers_encrypt_open_failures_total", reason="unknown_key", **fs) == 1

    raw_keys = [pathlib.Path(p).read_bytes() for p in keys.values()]
    text = "\n".join(seen) + caplog.text
    binary = b"".join(payloads) + b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())
    assert payloads and list(root.rglob("*.bin"))
    for raw in raw_keys:
        for form in (raw.hex(), raw.hex().upper()):
            assert form not in text and form.encode() not in binary
        assert raw not in binary
    for name in names.values():
        assert name not in text and name.encode() not in binary
