"""Encryption at rest (kvtiers.encryption, docs/security.md): the ``"encrypt"`` option on
real tiers (fs on real files, the memory tier, whose stored bytes a test can reach), and
what an attacker with the medium can do: read it (no plaintext), flip bytes, swap chunks
between keys, namespaces and key ids, present a wrong or retired key."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest
from tier_helpers import wait_job

from kvtiers import Arena, ConfigError, Job, JobResult, Lookup, Namespace, TierContext, open_tier
from kvtiers.encryption import HEADER, OVERHEAD, Keyring, key_fingerprint, read_header

SLOT = 64 * 1024


def _key(tmp_path: pathlib.Path, name: str = "key", *, hexed: bool = False) -> str:
    p = tmp_path / name
    raw = os.urandom(32)
    p.write_bytes(raw.hex().encode() + b"\n" if hexed else raw)
    p.chmod(0o600)
    return str(p)


def _ctx(num_slots: int = 8, ns: dict | None = None, slot: int = SLOT) -> TierContext:
    return TierContext(Arena.allocate(num_slots, slot), Namespace(ns or {"model": "m"}))


def _pattern(i: int, n: int = SLOT) -> bytes:
    """Distinct, recognisable plaintext per chunk (a repeated 64-byte marker)."""
    marker = f"KVTIERS-PLAINTEXT-MARKER-{i:06d}-".encode().ljust(64, b"#")
    return (marker * (n // 64 + 1))[:n]


def _store(h, ctx: TierContext, keys: list[bytes], jid: int = 1) -> JobResult:
    for i, _k in enumerate(keys):
        ctx.arena[i][:] = _pattern(i, ctx.arena.slot_bytes)
    h.submit_store(Job(jid, tuple(keys), tuple(range(len(keys)))))
    return wait_job(h, jid)


def _load(h, ctx: TierContext, keys: list[bytes], jid: int = 2) -> JobResult:
    n = len(ctx.arena) - len(keys)
    for s in range(n, len(ctx.arena)):
        ctx.arena[s][:] = b"\xa5" * ctx.arena.slot_bytes
    h.submit_load(Job(jid, tuple(keys), tuple(range(n, n + len(keys)))))
    return wait_job(h, jid)


def _loaded(ctx: TierContext, i: int, n_keys: int) -> bytes:
    return bytes(ctx.arena[len(ctx.arena) - n_keys + i])


# -- fs: the medium holds no plaintext, and loads give the exact bytes -----------------------

def test_fs_round_trip_and_no_plaintext_on_disk(tmp_path):
    key = _key(tmp_path)
    root = tmp_path / "kv"
    ctx = _ctx(16)
    keys = [b"chunk-%d" % i for i in range(8)]
    h = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": key}}, ctx)
    assert type(h.tier).__name__ == "FsTier"  # handle.tier is the tier itself
    assert _store(h, ctx, keys).ok
    assert h.lookup(keys) == [Lookup.HIT] * 8
    r = _load(h, ctx, keys)
    assert r.ok and r.nbytes == 8 * SLOT
    assert all(_loaded(ctx, i, 8) == _pattern(i) for i in range(8))
    h.close()
    files = [p for p in root.rglob("*") if p.is_file()]
    chunks = [p for p in files if p.suffix == ".bin"]
    assert len(chunks) == 8
    for p in chunks:  # one page more than the chunk (plus the fs trailer page)
        assert p.stat().st_size == SLOT + OVERHEAD + 4096
        assert read_header(p.read_bytes()[:HEADER.size]) is not None
    for p in files:
        data = p.read_bytes()
        assert b"KVTIERS-PLAINTEXT-MARKER" not in data, p
    # a new instance with the same key reads them back (durable)
    ctx2 = _ctx(16)
    h2 = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": key}}, ctx2)
    r = _load(h2, ctx2, keys, jid=7)
    assert r.ok and all(_loaded(ctx2, i, 8) == _pattern(i) for i in range(8))
    h2.close()


def test_fs_without_the_key_fails_every_key(tmp_path):
    root = tmp_path / "kv"
    ctx = _ctx()
    keys = [b"a", b"b"]
    h = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": _key(tmp_path)}}, ctx)
    assert _store(h, ctx, keys).ok
    h.close()
    ctx2 = _ctx()
    other = _key(tmp_path, "other")
    h2 = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": other}}, ctx2)
    r = _load(h2, ctx2, keys)
    assert set(r.failed_keys) == set(keys)
    assert "not configured" in r.error  # another key has another id: named, never the key itself
    assert h2.hooks.stats["open_failed_unknown_key"] == 2
    h2.close()
    # the same key id forced onto another key: authentication fails
    ctx3 = _ctx()
    kid = h.hooks.keyring.current
    h3 = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": other, "key_id": kid}}, ctx3)
    r = _load(h3, ctx3, keys)
    assert set(r.failed_keys) == set(keys) and "authentication" in r.error
    assert h3.hooks.stats["open_failed_auth"] == 2
    h3.close()
    # and a plain (unencrypted) instance on the same root never hands out the sealed bytes as data:
    # its loads succeed byte-exactly with what is on disk, which is ciphertext, not the plaintext
    ctx4 = TierContext(Arena.allocate(4, SLOT + OVERHEAD), Namespace({"model": "m"}))
    h4 = open_tier("fs", {"root_dir": str(root)}, ctx4)
    r = _load(h4, ctx4, keys)
    assert r.ok and all(b"KVTIERS-PLAINTEXT-MARKER" not in _loaded(ctx4, i, 2) for i in range(2))
    h4.close()


def test_fs_plaintext_chunks_are_not_loaded_as_sealed(tmp_path):
    """A root written without encryption, then opened with it: the old chunks fail (format)."""
    root = tmp_path / "kv"
    ctx = TierContext(Arena.allocate(4, SLOT + OVERHEAD), Namespace({"model": "m"}))
    h = open_tier("fs", {"root_dir": str(root)}, ctx)
    assert _store(h, ctx, [b"old"]).ok
    h.close()
    ctx2 = _ctx(4)
    h2 = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": _key(tmp_path)}}, ctx2)
    r = _load(h2, ctx2, [b"old"])
    assert r.failed_keys == (b"old",) and "no KVTSEAL1 header" in r.error
    h2.close()


# -- tampering with the stored bytes (memory tier: no checksum of its own in the way) --------

def _memory(tmp_path, key: str | None = None, ns: dict | None = None, **enc):
    ctx = _ctx(8, ns)
    spec = {"key_file": key or _key(tmp_path), **enc}
    return open_tier("memory", {"encrypt": spec}, ctx), ctx


def test_flipped_bytes_anywhere_fail_authentication(tmp_path):
    key = _key(tmp_path)
    h, ctx = _memory(tmp_path, key)
    keys = [b"k"]
    assert _store(h, ctx, keys).ok
    data = h.tier._data
    good = data[b"k"]
    assert len(good) == SLOT + OVERHEAD
    # header (magic, nonce, key id), ciphertext start/middle/end, tag, padding after the tag
    for off in (0, 20, 40, HEADER.size, HEADER.size + SLOT // 2, HEADER.size + SLOT - 1,
                HEADER.size + SLOT + 3, len(good) - 1):
        bad = bytearray(good)
        bad[off] ^= 0x01
        data[b"k"] = bytes(bad)
        r = _load(h, ctx, keys, jid=100 + off)
        assert r.failed_keys == (b"k",), off
        assert r.error and "failed" in r.error
    data[b"k"] = good
    assert _load(h, ctx, keys, jid=99).ok and _loaded(ctx, 0, 1) == _pattern(0)
    h.close()


def test_chunks_swapped_between_keys_fail(tmp_path):
    h, ctx = _memory(tmp_path)
    keys = [b"one", b"two"]
    assert _store(h, ctx, keys).ok
    d = h.tier._data
    d[b"one"], d[b"two"] = d[b"two"], d[b"one"]
    r = _load(h, ctx, keys)
    assert set(r.failed_keys) == set(keys) and "another chunk key" in r.error
    assert h.hooks.stats["open_failed_mismatch"] == 2
    h.close()


def test_chunk_moved_to_another_namespace_fails(tmp_path):
    key = _key(tmp_path)
    a, ctx_a = _memory(tmp_path, key, {"model": "a"})
    b, ctx_b = _memory(tmp_path, key, {"model": "b"})
    assert _store(a, ctx_a, [b"k"]).ok
    b.tier._data[b"k"] = a.tier._data[b"k"]  # same key, same encryption key, other namespace
    r = _load(b, ctx_b, [b"k"])
    assert r.failed_keys == (b"k",) and "another namespace" in r.error
    a.close()
    b.close()


def test_header_rewritten_to_match_still_fails(tmp_path):
    """An attacker who edits the header's chunk key to the asked one: the tag binds the header."""
    h, ctx = _memory(tmp_path)
    assert _store(h, ctx, [b"aaaa", b"bbbb"]).ok
    d = h.tier._data
    forged = bytearray(d[b"aaaa"])
    magic, klen, keylen, n, nonce, kid, _key_field, ns = HEADER.unpack(bytes(forged[:HEADER.size]))
    forged[:HEADER.size] = HEADER.pack(magic, klen, 4, n, nonce, kid, b"bbbb", ns)
    d[b"bbbb"] = bytes(forged)
    r = _load(h, ctx, [b"bbbb"])
    assert r.failed_keys == (b"bbbb",) and "authentication" in r.error
    h.close()


def test_fresh_nonce_per_store(tmp_path):
    h, ctx = _memory(tmp_path)
    assert _store(h, ctx, [b"x"]).ok
    first = h.tier._data[b"x"]
    del h.tier._data[b"x"]
    assert _store(h, ctx, [b"x"], jid=3).ok  # the same bytes again
    second = h.tier._data[b"x"]
    assert first[:8] == second[:8] and first[24:36] != second[24:36]  # nonce differs
    assert first[HEADER.size:HEADER.size + 64] != second[HEADER.size:HEADER.size + 64]
    h.close()


# -- keys: rotation, retired keys, sources, errors -----------------------------------------

def test_rotation_new_stores_use_the_current_key_old_ones_still_load(tmp_path):
    k1, k2 = _key(tmp_path, "k1"), _key(tmp_path, "k2", hexed=True)
    root = tmp_path / "kv"
    ctx = _ctx()
    h = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": k1, "key_id": "2026-01"}}, ctx)
    assert _store(h, ctx, [b"old"]).ok
    h.close()
    rotated = {"key_file": k2, "key_id": "2026-02", "retired": [{"key_file": k1, "key_id": "2026-01"}]}
    ctx2 = _ctx()
    h2 = open_tier("fs", {"root_dir": str(root), "encrypt": rotated}, ctx2)
    assert _store(h2, ctx2, [b"new"], jid=5).ok
    r = _load(h2, ctx2, [b"old", b"new"])
    assert r.ok, r.error
    h2.close()
    kids = {read_header(p.read_bytes()[:HEADER.size])[0] for p in root.rglob("*.bin")}
    assert kids == {"2026-01", "2026-02"}
    # the retired key dropped from the config: the old chunk fails, the new one loads
    ctx3 = _ctx()
    h3 = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": k2, "key_id": "2026-02"}}, ctx3)
    r = _load(h3, ctx3, [b"old", b"new"])
    assert r.failed_keys == (b"old",) and "'2026-01', which is not configured" in r.error
    h3.close()


def test_key_from_env_and_default_id(tmp_path, monkeypatch):
    raw = os.urandom(32)
    monkeypatch.setenv("KVTIERS_TEST_KEY", raw.hex())
    kr = Keyring.from_spec({"key_env": "KVTIERS_TEST_KEY"})
    assert kr.current == key_fingerprint(raw) and kr.current.startswith("fp-")
    assert raw.hex() not in repr(kr) and "KVTIERS_TEST_KEY" not in kr.current


@pytest.mark.parametrize("spec, message", [
    ({}, "give exactly one of key_file, key_env, provider (got none)"),
    ({"key_file": "/nonexistent/key"}, "cannot read key_file '/nonexistent/key'"),
    ({"key_env": "KVTIERS_NOT_SET_38"}, "environment variable 'KVTIERS_NOT_SET_38' (key_env) is not set"),
    ({"key_env": "X", "key_file": "/k"}, "give exactly one of key_file, key_env, provider (got key_file and key_env)"),
    ({"keyfile": "/k"}, "unknown field 'keyfile'"),
    ({"provider": "nope"}, "unknown key provider 'nope'"),
    ({"key_file": "KEY", "key_id": "has space"}, "'key_id' expects 1-32 of"),
    ({"key_file": "KEY", "retired": {"key_file": "KEY"}}, "'retired' expects a list"),
    ({"key_file": "KEY", "retired": [{"key_file": "KEY"}]}, "is configured twice"),
    ({"key_file": "KEY", "staging_bytes": 0}, "'staging_bytes' expects a positive int"),
])
def test_bad_encrypt_options_are_one_line_errors(tmp_path, spec, message):
    key = _key(tmp_path)
    spec = {k: (key if v == "KEY" else v) for k, v in spec.items()}
    if isinstance(spec.get("retired"), list):
        spec["retired"] = [{"key_file": key}]
    elif isinstance(spec.get("retired"), dict):
        spec["retired"] = {"key_file": key}
    with pytest.raises(ConfigError) as e:
        open_tier("memory", {"encrypt": spec}, _ctx())
    text = str(e.value)
    assert message in text and "\n" not in text and text.startswith("tier 'memory': encrypt")


def test_key_material_never_in_errors_or_logs(tmp_path, caplog):
    bad = tmp_path / "short"
    secret = os.urandom(16).hex()  # 32 hex digits: the wrong length
    bad.write_text(secret)
    with pytest.raises(ConfigError) as e:
        open_tier("memory", {"encrypt": {"key_file": str(bad)}}, _ctx())
    assert "holds 32 bytes of text: expected 32 random raw bytes or 64 hex digits" in str(e.value)
    assert secret not in str(e.value)
    bad.write_text(secret + "\n")
    with pytest.raises(ConfigError, match="holds 33 bytes: expected 32 raw bytes or 64 hex digits"):
        open_tier("memory", {"encrypt": {"key_file": str(bad)}}, _ctx())
    key = tmp_path / "loose"
    raw = os.urandom(32)
    key.write_bytes(raw)
    key.chmod(0o644)
    with caplog.at_level(logging.DEBUG, logger="kvtiers"):
        h = open_tier("memory", {"encrypt": {"key_file": str(key)}}, ctx := _ctx())
        r = _store(h, ctx, [b"k"])
        h.tier._data[b"k"] = b"\0" * (SLOT + OVERHEAD)
        r = _load(h, ctx, [b"k"])
        h.close()
    assert "readable by group or others" in caplog.text
    for text in (caplog.text, r.error, repr(h.hooks.keyring)):
        assert raw.hex() not in text and raw.hex().upper() not in text


def test_key_provider_from_a_plugin(tmp_path):
    raw = os.urandom(32)
    seen = []

    def kms(fields: dict) -> bytes:
        seen.append(fields)
        return raw

    def denied(fields: dict) -> bytes:
        raise RuntimeError("denied")

    kr = Keyring.from_spec({"provider": "kms", "key_ref": "arn:x", "key_id": "kms-1"}, providers={"kms": kms})
    assert kr.current == "kms-1" and seen == [{"key_ref": "arn:x"}]
    with pytest.raises(ConfigError, match="key provider 'kms' returned 5: expected 32 bytes"):
        Keyring.from_spec({"provider": "kms"}, providers={"kms": lambda f: b"short"})
    with pytest.raises(ConfigError, match="key provider 'kms' failed: RuntimeError: denied"):
        Keyring.from_spec({"provider": "kms"}, providers={"kms": denied})


def test_the_tier_never_sees_the_option(tmp_path):
    """Any tier class (here one defined by the test, opened by class) takes 'encrypt'."""
    from kvtiers.memory import MemoryTier

    seen = {}

    class Picky(MemoryTier):
        def __init__(self, ctx, *, max_bytes: int | None = None) -> None:
            seen["slot_bytes"] = ctx.arena.slot_bytes
            seen["max_bytes"] = max_bytes
            super().__init__(ctx, max_bytes=max_bytes)

    ctx = _ctx()
    h = open_tier(Picky, {"max_bytes": 4 * SLOT, "encrypt": {"key_file": _key(tmp_path)}}, ctx)
    assert seen == {"slot_bytes": SLOT + OVERHEAD, "max_bytes": 4 * (SLOT + OVERHEAD)}
    assert "encrypt" not in h.options
    assert _store(h, ctx, [b"a", b"b"]).ok and _load(h, ctx, [b"a", b"b"]).ok
    h.close()
    with pytest.raises(ConfigError, match="tier 'memory': encrypt: expects an object, got str"):
        open_tier("memory", {"encrypt": "yes"}, _ctx())


# -- big jobs: sealed off the caller's thread; staging smaller than the job ----------------------

def test_big_job_through_few_staging_slots(tmp_path):
    """A 32-key job of 1 MiB chunks through 8 staging slots: every key stored and loaded exactly,
    the submits return at once (sealing runs on the workers), close leaves no thread."""
    import threading

    slot = 1 << 20
    ctx = TierContext(Arena.allocate(64, slot), Namespace({"model": "big"}))
    h = open_tier("fs", {"root_dir": str(tmp_path / "kv"),
                         "encrypt": {"key_file": _key(tmp_path), "staging_bytes": 8 * (slot + OVERHEAD)}}, ctx)
    assert len(h.tier.ctx.arena) == 8
    keys = [b"big-%d" % i for i in range(32)]
    for i in range(32):
        ctx.arena[i][:] = _pattern(i, slot)
    t0 = time.perf_counter()
    h.submit_store(Job(1, tuple(keys), tuple(range(32))))
    submit_s = time.perf_counter() - t0
    r = wait_job(h, 1, 120)
    assert r.ok, r.error
    assert submit_s < 0.5  # one 1 MiB seal inline would be ~0.2 ms; 32 of them are not done here
    h.submit_load(Job(2, tuple(keys), tuple(range(32, 64))))
    r = wait_job(h, 2, 120)
    assert r.ok and r.nbytes == 32 * slot
    assert all(bytes(ctx.arena[32 + i]) == _pattern(i, slot) for i in range(32))
    assert any(t.name.startswith("kvtiers-seal") for t in threading.enumerate())
    h.close()
    assert not any(t.name.startswith("kvtiers-seal") for t in threading.enumerate())


def test_close_finishes_jobs_in_flight(tmp_path):
    slot = 1 << 20
    ctx = TierContext(Arena.allocate(16, slot), Namespace({"model": "close"}))
    h = open_tier("fs", {"root_dir": str(tmp_path / "kv"),
                         "encrypt": {"key_file": _key(tmp_path), "staging_bytes": 1}}, ctx)
    keys = [b"c-%d" % i for i in range(16)]
    h.submit_store(Job(1, tuple(keys), tuple(range(16))))
    h.close()  # the job waits for staging slots: close still finishes it
    results = h.get_finished_jobs()
    assert [r.job_id for r in results] == [1] and results[0].ok
    assert h.get_finished_jobs() == []


def test_check_options_accepts_encrypt_for_any_tier():
    """Callers that check options before open_tier (the SGLang backend) accept the core's option."""
    from kvtiers.memory import MemoryTier
    from kvtiers.options import check_options

    assert check_options("memory", MemoryTier, {"encrypt": {"key_file": "/k"}}) == {"encrypt": {"key_file": "/k"}}
    with pytest.raises(ConfigError, match="tier 'memory': option 'encrypt' expects an object, got int"):
        check_options("memory", MemoryTier, {"encrypt": 1})


def test_a_config_tier_entry_takes_encrypt(tmp_path):
    """A config's tier entry (ours or vLLM's secondary_tiers) keeps 'encrypt' among the tier's
    options; the manager and the vLLM tier open them with open_tier, as here."""
    from kvtiers.config import load_config

    key = _key(tmp_path)
    cfg = load_config({"cpu_bytes_to_use": 1 << 30, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path / "kv"), "encrypt": {"key_file": key}}]})
    (tier,) = cfg.tiers
    assert tier.options["encrypt"] == {"key_file": key}
    ctx = _ctx()
    h = open_tier(tier.type, tier.options, ctx)
    assert _store(h, ctx, [b"cfg"]).ok and _load(h, ctx, [b"cfg"]).ok
    h.close()
    assert not any(b"KVTIERS-PLAINTEXT-MARKER" in p.read_bytes() for p in (tmp_path / "kv").rglob("*.bin"))


def test_the_cipher_releases_the_gil():
    """Sealing on the workers runs in parallel with Python on other threads: with a switch
    interval of 1 s, a thread that held the GIL through encrypt_into would stall this one
    for a second; this one keeps counting while the worker seals."""
    import sys
    import threading

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aes = AESGCM(os.urandom(32))
    data, out = bytearray(16 << 20), bytearray((16 << 20) + 16)
    stop = threading.Event()

    def seal() -> None:
        while not stop.is_set():
            aes.encrypt_into(os.urandom(12), memoryview(data), b"", memoryview(out))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t0 = time.perf_counter()
        worker = threading.Thread(target=seal)
        worker.start()
        counted = 0
        while time.perf_counter() - t0 < 0.5:
            counted += 1
    finally:
        stop.set()
        sys.setswitchinterval(old)
        worker.join()
    assert counted > 0


def test_older_cryptography_without_the_into_calls(tmp_path):
    """cryptography before encrypt_into/decrypt_into (the extra allows >= 42): the same format
    through encrypt/decrypt, readable both ways."""
    from kvtiers.encryption import open_into, seal_into, sealed_bytes

    kr = Keyring.from_spec({"key_file": _key(tmp_path)})
    real = kr.cipher(kr.current)

    class Old:  # only the calls cryptography 42 has
        encrypt = real.encrypt
        decrypt = real.decrypt

    old = Keyring(kr.current, {kr.current: Old()}, kr.specs)
    data = memoryview(bytearray(_pattern(1, 8192)))
    a, b = memoryview(bytearray(sealed_bytes(8192))), memoryview(bytearray(sealed_bytes(8192)))
    seal_into(old, b"\1" * 8, b"k", data, a)
    seal_into(kr, b"\1" * 8, b"k", data, b)
    for sealed, ring in ((a, kr), (b, old)):
        out = memoryview(bytearray(8192))
        assert open_into(ring, b"\1" * 8, b"k", sealed, out) == kr.current
        assert bytes(out) == bytes(data)


def test_a_fifo_or_a_device_as_key_file_is_a_one_line_error_not_a_hang(tmp_path):
    """Issue 44 item 10: ``key_file`` naming a FIFO (nobody writing it) or a device: opening
    the tier in a real child process is a one-line error at once, never a hang in ``open()``."""
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    script = (
        "import sys\n"
        "from kvtiers import Arena, ConfigError, Namespace, TierContext, open_tier\n"
        "ctx = TierContext(Arena.allocate(2, 4096), Namespace({}))\n"
        "try:\n"
        "    open_tier('fs', {'root_dir': sys.argv[1], 'encrypt': {'key_file': sys.argv[2]}}, ctx)\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    for path in (str(fifo), "/dev/zero"):
        try:
            out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "kv"), path],
                                 capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"open_tier with key_file {path} hung")
        assert out.returncode == 3, out.stderr
        assert out.stdout.strip() == f"tier 'fs': encrypt: key_file {path!r} is not a regular file"


def test_a_poll_returns_within_its_budget_while_the_workers_keep_finishing_pieces(tmp_path, monkeypatch):
    """Rule 5: one ``get_finished_jobs`` moves a big job on for about ``POLL_BUDGET_S``, then
    returns; the next poll goes on. Fault injection: each seal and each poll of the tier below
    takes 20 ms, so pieces keep finishing while a poll runs (as under a loaded machine); before
    the budget one poll drove most of the job (16 polls of the tier below in one call here)."""
    from kvtiers.encryption import sealed_tier
    from kvtiers.types import POLL_BUDGET_S

    monkeypatch.setattr(sealed_tier, "PIECE_BYTES", 4 * SLOT)  # 4-key pieces: many of them
    ctx = _ctx(256)
    h = open_tier("memory", {"encrypt": {"key_file": _key(tmp_path)}}, ctx)
    wrapper = h.hooks
    assert type(wrapper).__name__ == "SealedTier"
    seal, inner_poll = wrapper._seal, wrapper.inner.get_finished_jobs
    polls_below = [0]

    def slow_seal(piece):
        time.sleep(0.02)
        return seal(piece)

    def slow_poll():
        polls_below[0] += 1
        time.sleep(0.02)
        return inner_poll()

    monkeypatch.setattr(wrapper, "_seal", slow_seal)
    monkeypatch.setattr(wrapper.inner, "get_finished_jobs", slow_poll)
    keys = [b"budget-%d" % i for i in range(256)]
    for i in range(256):
        ctx.arena[i][:] = _pattern(i)
    h.submit_store(Job(1, tuple(keys), tuple(range(256))))
    most, results = 0, []
    deadline = time.monotonic() + 120
    while not results and time.monotonic() < deadline:
        before = polls_below[0]
        results = h.get_finished_jobs()
        most = max(most, polls_below[0] - before)
    assert [r.job_id for r in results] == [1] and results[0].ok, results
    # a pass polls the tier below once (20 ms): past the budget no further pass starts
    assert most <= POLL_BUDGET_S / 0.02 + 2, f"one poll polled the tier below {most} times"
    assert h.lookup(keys) == [Lookup.HIT] * 256
    h.close()
