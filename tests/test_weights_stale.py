"""Weights that change between sleeps come back changed (issue: a tier keeps an existing key,
rule 7, so keys must name the bytes), weights that did not change are not stored again, and a
damaged manifest at fork is a LookupError, never an IndexError or a MemoryError. Real fs tier,
real files."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from kvtiers.engine.weights import ModelWeights, WeightsIdentity  # noqa: E402

CHUNK = 16384


def model():
    g = torch.Generator().manual_seed(1)
    return {"emb": torch.randn(64, 128, generator=g), "w": torch.randn(128, 96, generator=g),
            "b": torch.randn(96, generator=g)}


def fs_config(root):
    return {"host_blocks_factor": 1.0, "tiers": [{"type": "fs", "root_dir": str(root)}]}


def publish_manifest(m, config, name, manifest_bytes, chunk_bytes=CHUNK):
    """Publish ``m`` as ``name`` revision v1 with ``manifest_bytes(doc)`` stored for its
    manifest, as a buggy or hostile publisher would: the bytes the tier keeps are what it was
    given, so its checksum passes. The identity."""
    from kvtiers.engine import weights as weights_mod

    real = weights_mod.manifest_bytes
    weights_mod.manifest_bytes = manifest_bytes
    try:
        with ModelWeights(m, config, name=name, revision="v1", chunk_bytes=chunk_bytes) as w:
            return w.publish()
    finally:
        weights_mod.manifest_bytes = real


def chunk_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if not f.endswith((".json", ".snapshot", ".lock", ".lease")) and "tmp" not in f)


@pytest.mark.parametrize("revision", ["v1", None])
def test_weights_changed_in_place_between_level2_sleeps_come_back_changed(tmp_path, revision):
    m = model()
    with ModelWeights(m, fs_config(tmp_path / "fs"), name="rl", revision=revision, chunk_bytes=CHUNK) as w:
        w.sleep(2)
        w.wake()
        first = w.identity
        with torch.no_grad():
            m["w"].mul_(-3)  # an RL step, in place
            m["b"].add_(1)
        want = {k: v.clone() for k, v in m.items()}
        w.sleep(2)
        assert w.wake().sources == {"fs": w.plan.num_chunks}
        second = w.identity
    for k in m:
        assert torch.equal(m[k], want[k]), k  # the new bytes, not the first sleep's
    assert first.digest != second.digest and first.revision == second.revision == revision


def test_unchanged_weights_are_not_stored_again(tmp_path):
    """Counted where the stores are made: the chunks the manager was asked to store (its
    ``stored`` events on the host, reason ``offloaded``), those it sent on to the fs tier (its
    ``stored`` events there) and the bytes of both paths. The chunk files alone would not show
    a chunk stored again: the fs tier keeps an existing file (rule 7)."""
    m, root = model(), tmp_path / "fs"
    with ModelWeights(m, fs_config(root), name="same", revision="v1", chunk_bytes=CHUNK) as w:
        stored: dict[str, list[bytes]] = {"host": [], "fs": []}

        def note(e):
            if e.kind == "stored" and (e.medium, e.reason) in (("host", "offloaded"), ("fs", None)):
                stored[e.medium].extend(e.keys)

        w.manager.add_listener(note)
        paths = w.manager.stats.paths

        def counts():
            return ({m: len(k) for m, k in stored.items()},
                    {p: (paths[p].chunks, paths[p].nbytes) for p in ("device->host", "host->fs")})

        n = w.plan.num_chunks + 1  # every data chunk and the manifest
        w.sleep(2)
        w.wake()
        assert len(set(stored["host"])) == n and set(stored["fs"]) == set(stored["host"])
        first = counts()
        assert first == ({"host": n, "fs": n}, {"device->host": (n, n * CHUNK), "host->fs": (n, n * CHUNK)})
        files = {f: os.stat(f).st_ino for f in chunk_files(root)}
        assert len(files) == n
        w.sleep(2)  # the same bytes: every tier holds every chunk already
        w.wake()
        assert counts() == first  # nothing copied to the host, nothing sent to the tier
        assert {f: os.stat(f).st_ino for f in chunk_files(root)} == files
        old = set(stored["host"])
        with torch.no_grad():
            m["b"].add_(1)
        w.sleep(2)
        w.wake()
        after = chunk_files(root)
    # the changed bytes went in under new keys (a new digest names every chunk and the
    # manifest), each once; the old files stay
    again = stored["host"][n:]
    assert len(again) == n and not set(again) & old and sorted(stored["fs"][n:]) == sorted(again)
    assert counts() == ({"host": 2 * n, "fs": 2 * n},
                        {"device->host": (2 * n, 2 * n * CHUNK), "host->fs": (2 * n, 2 * n * CHUNK)})
    assert set(files) < set(after) and len(after) == 2 * n


def test_fork_of_an_older_identity_gives_its_own_bytes(tmp_path):
    m, root = model(), tmp_path / "fs"
    old_bytes = {k: v.clone() for k, v in m.items()}
    with ModelWeights(m, fs_config(root), name="pin", revision="v1", chunk_bytes=CHUNK) as w:
        old = w.publish()
        with torch.no_grad():
            m["emb"].zero_()
        new = w.publish()
    assert old.revision == new.revision and old.digest != new.digest
    for ident, want in ((old, old_bytes), (new, m)):
        twin = {k: torch.empty_like(v) for k, v in m.items()}
        with ModelWeights.fork(twin, fs_config(root), WeightsIdentity.from_dict(ident.to_dict())):
            pass
        for k in twin:
            assert torch.equal(twin[k], want[k]), (ident, k)


@pytest.mark.parametrize("how", ["length", "json", "shape", "nested", "nested-shape"])
def test_a_damaged_manifest_at_fork_is_a_lookup_error(tmp_path, how):
    import json
    import struct

    from kvtiers.engine import weights as weights_mod
    from kvtiers.engine.weights_chunks import MANIFEST_MAGIC

    m, root = model(), tmp_path / "fs"
    real = weights_mod.manifest_bytes

    def damaged(doc):
        raw = real(doc)
        if how == "length":  # a header that claims far more bytes than were stored
            return struct.pack("<8sQ", MANIFEST_MAGIC, 1 << 40) + raw[16:]
        if how == "json":
            return raw[:16] + b"{" * (len(raw) - 16)
        if how == "nested":  # arrays nested deeper than Python's recursion limit
            body = b"[" * 5000 + b"]" * 5000
            return struct.pack("<8sQ", MANIFEST_MAGIC, len(body)) + body
        if how == "nested-shape":  # parsable, but a field nested just below that limit
            body = json.dumps({**doc, "tensors": [{**t, "dtype": [[]]} for t in doc["tensors"]]}).encode()
            body = body.replace(b"[[]]", b"[" * 900 + b"]" * 900)
            return struct.pack("<8sQ", MANIFEST_MAGIC, len(body)) + body
        body = json.dumps({"tensors": [1, 2, 3]}).encode()  # valid JSON of another shape
        return struct.pack("<8sQ", MANIFEST_MAGIC, len(body)) + body

    ident = publish_manifest(m, fs_config(root), "dmg", damaged)
    twin = {k: torch.empty_like(v) for k, v in m.items()}
    with pytest.raises(LookupError, match="manifest of model 'dmg' revision 'v1'.* is damaged"):
        ModelWeights.fork(twin, fs_config(root), ident)


def test_an_identity_without_digest_is_a_lookup_error_naming_it(tmp_path):
    m, root = model(), tmp_path / "fs"
    with ModelWeights(m, fs_config(root), name="nd", revision="v1", chunk_bytes=CHUNK) as w:
        w.publish()
    twin = {k: torch.empty_like(v) for k, v in m.items()}
    with pytest.raises(LookupError, match="no tier holds the weights of model 'nd' revision 'v1'.*names no content"):
        ModelWeights.fork(twin, fs_config(root), WeightsIdentity("nd", "v1", chunk_bytes=CHUNK))
    with pytest.raises(ValueError, match="'digest' must be 32 hex digits"):
        WeightsIdentity.from_dict({"name": "nd", "revision": "v1", "digest": "zz"})
