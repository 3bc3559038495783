"""``kvtiers encrypt scan|rewrite`` on a real fs root: chunks under a retired key are found,
sealed again under the current key, and still load; chunks under unknown keys are left alone."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from collections import Counter

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


# -- a hostile medium: FIFOs, forged headers, a rewrite killed midway --------------------------
KVTIERS = [sys.executable, "-c", "import sys; from kvtiers.commands.cli import main; sys.exit(main())"]


def _run(*argv: str, timeout: float = 120, limit_as: int | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a child process (a hang is a timeout here, not a hung test run);
    ``limit_as``: the child's address-space limit (bytes)."""
    def limits():
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    try:
        return subprocess.run([*KVTIERS, *argv], capture_output=True, text=True, timeout=timeout, preexec_fn=limits)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"kvtiers {' '.join(argv[:2])} hung: no answer within {timeout} s "
                             f"(stderr: {e.stderr!r})") from None


def _rotated(tmp_path, root, n: int, *, slot: int = SLOT) -> tuple[str, list[bytes], dict, str]:
    """``n`` chunks stored under the old key; the config that retires it; the namespace dir."""
    old, new = _key(tmp_path, "old"), _key(tmp_path, "new")
    keys = [b"chunk-%d" % i for i in range(n)]
    ctx = TierContext(Arena.allocate(n, slot), Namespace({"model": "a"}))
    for i, k in enumerate(keys):
        ctx.arena[i][:] = (k * (slot // len(k) + 1))[:slot]
    h = open_tier("fs", {"root_dir": str(root), "encrypt": {"key_file": old, "key_id": "k-old"}}, ctx)
    assert _job(h, "store", Job(1, tuple(keys), tuple(range(n)))).ok
    h.close()
    rotated = {"key_file": new, "key_id": "k-new", "retired": [{"key_file": old, "key_id": "k-old"}]}
    return json.dumps({"root_dir": str(root), "encrypt": rotated}), keys, rotated, ctx.namespace.digest


def _all_load(root, keys: list[bytes], enc: dict, slot: int = SLOT) -> list[bytes]:
    """The keys that do not load with their bytes (every chunk's file holds a whole chunk)."""
    ctx = TierContext(Arena.allocate(len(keys), slot), Namespace({"model": "a"}))
    h = open_tier("fs", {"root_dir": str(root), "encrypt": enc}, ctx)
    r = _job(h, "load", Job(9, tuple(keys), tuple(range(len(keys)))))
    h.close()
    return sorted(set(r.failed_keys) | {k for i, k in enumerate(keys)
                                        if bytes(ctx.arena[i]) != (k * (slot // len(k) + 1))[:slot]})


def _key_ids(nsdir) -> Counter:
    out: Counter = Counter()
    for p in nsdir.rglob("*.bin"):
        if not stat.S_ISREG(os.lstat(p).st_mode):
            continue
        try:
            h = read_header(p.read_bytes()[:HEADER.size])
        except OSError:
            continue
        out[h[0] if h else None] += 1
    return out


def test_fifos_under_the_root_never_hang_scan_or_rewrite(tmp_path):
    """A FIFO where a chunk, a config.json or any file could be (docs/fs.md: never a hang):
    skipped without being opened for reading, named on stderr; every real chunk rewritten."""
    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, 20)
    nsdir = root / digest
    fifos = [nsdir / "ab" / "cd" / (b"planted".hex() + ".bin"), root / "elsewhere" / "config.json",
             nsdir / "fifo", root / "top.bin"]
    for f in fifos:
        f.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(f)

    r = _run("encrypt", "scan", "fs", "--config", config, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["key_id"], x["chunks"]) for x in rows["rows"]] == [("k-old", 20)] and rows["skipped"] == 4
    for f in fifos:
        assert f"skipped {f}: a FIFO, not opened" in r.stderr

    r = _run("encrypt", "rewrite", "fs", "--config", config, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rewritten"] == 20 and rep["skipped"] == 4 and rep.get("failed", 0) == 0
    assert _key_ids(nsdir) == {"k-new": 20}
    assert all(stat.S_ISFIFO(os.lstat(f).st_mode) for f in fifos)  # left alone
    assert _all_load(root, keys, {"key_file": rotated["key_file"], "key_id": "k-new"}) == []


def test_forged_sealed_lengths_are_skipped_and_the_real_chunks_rewritten(tmp_path):
    """Bare sealed headers (nothing authenticates their length) saying 1000 bytes and 1 GiB:
    skipped and named, the 20 real chunks rewritten, and memory bounded by the files' real
    sizes (the child runs under a 3 GiB address-space limit; 16 x 1 GiB would not fit)."""
    from kvtiers.encryption import MAGIC

    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, 20)
    nsdir = root / digest
    forged = {}
    for n in (1000, 1 << 30):
        key = b"forged-%d" % n
        head = HEADER.pack(MAGIC, 5, len(key), n, os.urandom(12), b"k-old", key, bytes.fromhex(digest))
        p = nsdir / "ff" / "ff" / (key.hex() + ".bin")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(head)
        forged[n] = p

    r = _run("encrypt", "scan", "fs", "--config", config, "--json", limit_as=3 << 30)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["key_id"], x["chunks"], x["bytes"]) for x in rows["rows"]] == [("k-old", 20, 20 * SLOT)]
    assert rows["skipped"] == 2

    r = _run("encrypt", "rewrite", "fs", "--config", config, "--json", limit_as=3 << 30)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rewritten"] == 20 and rep["skipped"] == 2 and rep.get("failed", 0) == 0, rep
    for n, p in forged.items():
        assert f"skipped {p}: a forged sealed header: it says {n} bytes of chunk" in r.stderr
        assert p.read_bytes()[:8] == MAGIC  # left alone
    assert "Traceback" not in r.stderr
    assert _all_load(root, keys, {"key_file": rotated["key_file"], "key_id": "k-new"}) == []


def _inodes(paths: list) -> dict:
    out = {}
    for p in paths:
        try:
            out[p] = os.stat(p).st_ino
        except FileNotFoundError:
            out[p] = None
    return out


def test_a_rewrite_killed_midway_loses_no_chunk(tmp_path):
    """SIGKILL to a real `kvtiers encrypt rewrite` the moment it first changes a chunk's file
    (replaced or removed), twice: after each kill every chunk still loads with its bytes
    (the new file is written before the old one goes); a last run finishes the job and leaves
    no staging directory behind."""
    slot, n = 64 << 10, 96
    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, n, slot=slot)
    nsdir = root / digest
    paths = sorted(nsdir.rglob("*.bin"))
    assert len(paths) == n
    for _round in range(2):
        before = _inodes(paths)
        child = subprocess.Popen([*KVTIERS, "encrypt", "rewrite", "fs", "--config", config],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while child.poll() is None and time.monotonic() < deadline and _inodes(paths) == before:
                time.sleep(0.001)
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL, "the rewrite ended before it could be killed midway"
        assert _all_load(root, keys, rotated, slot) == [], "chunks lost by a rewrite killed midway"
        seen = _key_ids(nsdir)["k-new"]
        assert 0 < seen < n and _key_ids(nsdir) == {"k-old": n - seen, "k-new": seen}
    r = _run("encrypt", "rewrite", "fs", "--config", config, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rewritten"] + rep["current"] == n and rep["current"] == seen
    assert _key_ids(nsdir) == {"k-new": n}
    assert not [p for p in root.iterdir() if p.name.startswith(".kvtiers-rewrite-")]  # the killed ones' too
    assert _all_load(root, keys, {"key_file": rotated["key_file"], "key_id": "k-new"}, slot) == []
