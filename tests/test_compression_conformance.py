"""The conformance suite through the ``"compress"`` option (docs/compression.md): fs at all
four levels (zstd, and lz4 compressed then sealed), the memory tier, the third-party example
tier (examples/kvtiers-sqlite) and the p2p tier against a real ``kvtiers p2p serve``, each at
the levels it claims (the obj tier on SeaweedFS compressed: with the other wrappers, in
tests/test_encryption_conformance.py). The tiers are unchanged: the
core compresses and decompresses around them. The suite's chunks are random bytes, which do
not compress: each takes two pieces, so every check also runs a chunk's further pieces."""

from __future__ import annotations

import json

import pytest
import tier_helpers
from kvtiers_conformance import TierTests
from tier_helpers import WRAPPER_LIMITS, key_file, p2p_entry

p2p_server = tier_helpers.p2p_server  # one peer server for the module

ZSTD = {"codec": "zstd"}




class TestCompressedFs(TierTests):
    levels = frozenset({"core", "durable", "shared"})
    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv"), "compress": ZSTD}


class TestCompressedFsBounded(TestCompressedFs):
    """The bound, one instance at a time. Not with two (rule 11's bounded_shared): the
    suite's random chunks do not compress, so each takes two pieces (1.5 slots) on the
    medium, and half of a bound of ``cap`` slots does not hold the ``cap // 2`` chunks that
    check stores first (docs/compression.md: what incompressible chunks cost)."""

    levels = frozenset({"core", "bounded"})


class TestCompressedSealedFs(TierTests):
    """lz4, then AES-256-GCM, then the fs tier (DESIGN.md's order)."""

    levels = frozenset({"core", "durable"})
    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv"), "compress": {"codec": "lz4"},
                      "encrypt": {"key_file": str(key_file(tmp_path))}}


class TestCompressedMemory(TierTests):
    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self):
        return "memory", {"compress": ZSTD}


class TestCompressedSqliteExample(TierTests):
    """A third-party tier found by entry point, at its claimed levels (core, durable, shared, bounded)."""

    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        pytest.importorskip("kvtiers_sqlite")
        return "sqlite", {"path": str(tmp_path / "kv.sqlite3"), "compress": ZSTD}


class TestCompressedP2P(TierTests):
    """The p2p tier, one peer server in a child process (keys salted per check)."""

    limits = WRAPPER_LIMITS.replace(examples=20)

    @pytest.fixture
    def tier_config(self, p2p_server):
        return p2p_entry(p2p_server, compress=ZSTD)


def test_conformance_cli_takes_compress_in_config(tmp_path):
    """``kvtiers conformance TYPE --config`` with ``"compress"``, from the command line in a
    real child process: the fs tier passes its core rules compressed, every chunk it kept
    (``--keep``) is in the encoded format, and a lossy codec without ``"lossy": true`` is a
    one-line error (exit 2)."""
    from test_conformance_cli import LOADED_LIMITS, run

    from kvtiers.compression import HEADER, read_header

    root = tmp_path / "kv"
    config = {"root_dir": str(root), "compress": ZSTD}
    p = run("fs", "--config", json.dumps(config), "--level", "core", "--examples", "5", "--seed", "3",
            *LOADED_LIMITS, "--keep")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("summary: PASSED: 10 passed, 0 failed")
    firsts = [c for c in root.rglob("*.bin") if c.read_bytes()[:4] == b"KVZ1"]
    assert len(firsts) > 100
    assert {read_header(c.read_bytes()[:HEADER.size])[0] for c in firsts} == {1}  # zstd
    bad = {"root_dir": str(root), "compress": {"codec": "fp8"}}
    p = run("fs", "--config", json.dumps(bad), "--level", "core", "--examples", "5")
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert "\n" not in err and "compress: codec 'fp8' changes the bytes (lossy)" in err, err
