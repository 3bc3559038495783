"""``kvtiers encrypt scan|rewrite`` on a real fs root: chunks under a retired key are found,
sealed again under the current key, and still load; chunks under unknown keys are left alone."""

from __future__ import annotations

import json
import os
import time

from kvtiers import Arena, Job, Namespace, TierContext, open_tier
from kvtiers.commands.cli import main
from kvtiers.encryption import HEADER, read_header

SLOT = 16 * 1024


def _key(tmp_path, name: str) -> str:
    p = tmp_path / name
    p.write_bytes(os.urandom(32))
    p.chmod(0o600)
    return str(p)


def _job(h, kind: str, job: Job):
    (h.submit_store if kind == "store" else h.submit_load)(job)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for r in h.get_finished_jobs():
            if r.job_id == job.job_id:
                return r
        time.sleep(0.001)
    raise AssertionError("job not reported")


def _store(root, enc: dict, keys: list[bytes], ns: dict) -> None:
    ctx = TierContext(Arena.allocate(len(keys), SLOT), Namespace(ns))
    for i, k in enumerate(keys):
        ctx.arena[i][:] = (k * (SLOT // len(k) + 1))[:SLOT]
    h = open_tier("fs", {"root_dir": str(root), "encrypt": enc}, ctx)
    assert _job(h, "store", Job(1, tuple(keys), tuple(range(len(keys))))).ok
    h.close()


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_scan_and_rewrite_retired_chunks(tmp_path, capsys):
    root = tmp_path / "kv"
    old, new, stranger = _key(tmp_path, "old"), _key(tmp_path, "new"), _key(tmp_path, "stranger")
    old_keys = [b"old-%d" % i for i in range(20)]
    _store(root, {"key_file": old, "key_id": "k-old"}, old_keys, {"model": "a"})
    _store(root, {"key_file": old, "key_id": "k-old"}, [b"other-ns"], {"model": "b"})
    _store(root, {"key_file": stranger, "key_id": "k-stranger"}, [b"theirs"], {"model": "a"})
    rotated = {"key_file": new, "key_id": "k-new", "retired": [{"key_file": old, "key_id": "k-old"}]}
    config = json.dumps({"root_dir": str(root), "encrypt": rotated})

    rc, out, _ = _cli(capsys, "encrypt", "scan", "fs", "--config", config, "--json")
    assert rc == 0
    rows = json.loads(out)["rows"]
    assert len({r["namespace"] for r in rows}) == 2
    totals = {}
    for r in rows:
        totals[r["key_id"], r["status"]] = totals.get((r["key_id"], r["status"]), 0) + r["chunks"]
    assert totals == {("k-old", "retired"): 21, ("k-stranger", "not configured"): 1}

    rc, out, err = _cli(capsys, "encrypt", "rewrite", "fs", "--config", config, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["rewritten"] == 21 and rep["not_configured"] == 1 and rep.get("failed", 0) == 0
    assert rep["current_key_id"] == "k-new"
    kids = sorted(read_header(p.read_bytes()[:HEADER.size])[0] for p in root.rglob("*.bin"))
    assert kids == ["k-new"] * 21 + ["k-stranger"]
    for text in (out, err):  # ids and paths only
        for path in (old, new, stranger):
            with open(path, "rb") as f:
                assert f.read().hex() not in text

    # only the new key configured now: every rewritten chunk loads with its bytes
    ctx = TierContext(Arena.allocate(20, SLOT), Namespace({"model": "a"}))
    h = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": new, "key_id": "k-new"}}, ctx)
    r = _job(h, "load", Job(2, tuple(old_keys), tuple(range(20))))
    assert r.ok, r.error
    assert all(bytes(ctx.arena[i]) == (k * (SLOT // len(k) + 1))[:SLOT] for i, k in enumerate(old_keys))
    h.close()

    rc, out, _ = _cli(capsys, "encrypt", "scan", "fs", "--config", config)
    assert rc == 0 and "k-new" in out and "current" in out and "retired" not in out


def _store_as(root, enc: dict, keys: list[bytes], tenant: str) -> None:
    from kvtiers.encryption.tenants import note_tenant

    ctx = TierContext(Arena.allocate(len(keys), SLOT), Namespace({"model": "a"}))
    for i, k in enumerate(keys):
        ctx.arena[i][:] = (k * (SLOT // len(k) + 1))[:SLOT]
    h = open_tier("fs", {"root_dir": str(root), "encrypt": enc}, ctx)
    note_tenant(h, keys, tenant)
    assert _job(h, "store", Job(1, tuple(keys), tuple(range(len(keys))))).ok
    h.close()


def test_scan_and_rewrite_tenant_keys(tmp_path, capsys):
    """A tenant's chunks under its retired key are sealed again under its current key, as its
    own (they load for it, not for another tenant); the output names tenants by label only."""
    from kvtiers.encryption.tenants import note_tenant, tenant_label

    root = tmp_path / "kv"
    a_old, a_new, b = _key(tmp_path, "a-old"), _key(tmp_path, "a-new"), _key(tmp_path, "b")
    before = {"tenants": {"alice-secret": {"key_file": a_old, "key_id": "a-1"},
                          "bob-secret": {"key_file": b, "key_id": "b-1"}}}
    a_keys, b_keys = [b"alice-%d" % i for i in range(5)], [b"bob-%d" % i for i in range(3)]
    _store_as(root, before, a_keys, "alice-secret")
    _store_as(root, before, b_keys, "bob-secret")
    after = {"tenants": {"alice-secret": {"key_file": a_new, "key_id": "a-2",
                                          "retired": [{"key_file": a_old, "key_id": "a-1"}]},
                         "bob-secret": {"key_file": b, "key_id": "b-1"}}}
    config = json.dumps({"root_dir": str(root), "encrypt": after})
    alice, bob = tenant_label("alice-secret"), tenant_label("bob-secret")

    rc, out, _ = _cli(capsys, "encrypt", "scan", "fs", "--config", config, "--json")
    assert rc == 0
    got = {(r["key_id"], r["status"], r["owner"]): r["chunks"] for r in json.loads(out)["rows"]}
    assert got == {("a-1", "retired", alice): 5, ("b-1", "current", bob): 3}

    rc, out, err = _cli(capsys, "encrypt", "rewrite", "fs", "--config", config, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["rewritten"] == 5 and rep["current"] == 3 and rep.get("failed", 0) == 0
    assert rep["current_key_ids"] == {alice: "a-2", bob: "b-1"} and rep["current_key_id"] is None
    assert "secret" not in out + err  # tenant names (vLLM: cache_salt values) are not printed
    kids = sorted(read_header(p.read_bytes()[:HEADER.size])[0] for p in root.rglob("*.bin"))
    assert kids == ["a-2"] * 5 + ["b-1"] * 3

    only_new = {"tenants": {"alice-secret": {"key_file": a_new, "key_id": "a-2"},
                            "mallory": {"key_file": b, "key_id": "b-1"}}}
    for tenant, ok in (("alice-secret", True), ("mallory", False)):
        ctx = TierContext(Arena.allocate(5, SLOT), Namespace({"model": "a"}))
        h = open_tier("fs", {"root_dir": str(root), "encrypt": only_new}, ctx)
        note_tenant(h, a_keys, tenant)
        r = _job(h, "load", Job(2, tuple(a_keys), tuple(range(5))))
        h.close()
        assert r.ok is ok, (tenant, r.error)
        if ok:
            assert all(bytes(ctx.arena[i]) == (k * (SLOT // len(k) + 1))[:SLOT] for i, k in enumerate(a_keys))

    rc, out, _ = _cli(capsys, "encrypt", "scan", "fs", "--config", config)
    assert rc == 0 and "retired" not in out and alice in out and "secret" not in out


def test_rewrite_needs_keys_and_a_directory(tmp_path, capsys):
    rc, _, err = _cli(capsys, "encrypt", "rewrite", "fs", "--config", json.dumps({"root_dir": str(tmp_path)}))
    assert rc == 2 and "rewrite needs the tier's 'encrypt' option" in err
    rc, _, err = _cli(capsys, "encrypt", "scan", "memory", "--config", "{}")
    assert rc == 2 and "its options name no existing directory" in err


def test_bench_tier_takes_encrypt(tmp_path, capsys):
    """`kvtiers bench tier TYPE --config` with 'encrypt': the tier is measured sealed."""
    config = json.dumps({"root_dir": str(tmp_path / "kv"), "encrypt": {"key_file": _key(tmp_path, "k")}})
    rc, out, err = _cli(capsys, "bench", "tier", "fs", "--config", config, "--chunk-bytes", "64KiB",
                        "--total-bytes", "1MiB", "--rounds", "1", "--no-concurrency", "--no-baseline", "--json")
    assert rc == 0, err
    rows = json.loads(out)["results"]
    assert {r["op"] for r in rows} == {"store", "load"}
    chunks = list((tmp_path / "kv").rglob("*.bin"))
    assert all(read_header(p.read_bytes()[:HEADER.size]) is not None for p in chunks)  # sealed, if kept


def test_missing_cryptography_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    """Fault injection: the package cannot be imported."""
    import sys

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    config = json.dumps({"root_dir": str(tmp_path), "encrypt": {"key_file": _key(tmp_path, "k")}})
    rc, _, err = _cli(capsys, "encrypt", "rewrite", "fs", "--config", config)
    assert rc == 2
    assert err.strip() == ("kvtiers: error: tier 'fs': encrypt: needs the 'cryptography' package: "
                           "pip install 'kvtiers[encrypt]'")
