"""``kvtiers bench lmcache`` without running it long: its adapter specs, where LMCache is
missing, bad options. (A real run takes minutes: docs/lmcache.md#bench gives measured ones;
``make demo-lmcache`` runs a short one.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtiers.commands.bench.lmcache import adapter_spec
from kvtiers.integrations.lmcache import parse_params

KVTIERS = [sys.executable, "-m", "kvtiers.commands"]  # in .venv, where LMCache is not installed


def test_both_sides_use_the_same_directory_kind(tmp_path: Path):
    ours = adapter_spec("kvtiers", tmp_path / "a", {"direct": False})
    assert ours["module_path"] == "kvtiers.integrations.lmcache" and ours["class_name"] == "KvtiersL2Adapter"
    p = parse_params(ours["adapter_params"])  # what the server will check at start-up
    assert p.tier_type == "fs" and p.tier_options == {"root_dir": str(tmp_path / "a"), "direct": False}
    assert adapter_spec("lmcache", tmp_path / "b") == {"type": "fs", "base_path": str(tmp_path / "b")}


def test_io_puts_both_sides_in_one_mode(tmp_path: Path):
    """``--io``: O_DIRECT or buffered on both sides (each side's own option), so a ratio
    compares like with like; without it each keeps its own default."""
    for io, direct in (("direct", True), ("buffered", False)):
        ours = parse_params(adapter_spec("kvtiers", tmp_path / "a", None, io)["adapter_params"])
        assert ours.tier_options["direct"] is direct
        assert adapter_spec("lmcache", tmp_path / "b", None, io) == {"type": "fs", "base_path": str(tmp_path / "b"),
                                                                      "use_odirect": direct}
    assert "direct" not in parse_params(adapter_spec("kvtiers", tmp_path / "a")["adapter_params"]).tier_options


def test_io_and_a_direct_tier_option_conflict_one_line():
    r = subprocess.run([*KVTIERS, "bench", "lmcache", "--io", "buffered", "--tier-options", '{"direct": true}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert 'Invalid value for --tier-options: sets "direct", which --io buffered sets for both sides' in r.stderr


def test_without_lmcache_one_line():
    r = subprocess.run([*KVTIERS, "bench", "lmcache", "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "LMCache is not installed here" in r.stderr and "pip install lmcache==0.5.6" in r.stderr


def test_bad_tier_options_one_line():
    r = subprocess.run([*KVTIERS, "bench", "lmcache", "--tier-options", "[1]"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--tier-options" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cold_drops_both_sides_files_from_the_page_cache(tmp_path: Path):
    """``--cold``: every file under a trial directory is written back and leaves the page
    cache (a read that must not wait for the device, RWF_NOWAIT, then finds nothing)."""
    import os

    from kvtiers.commands.bench.lmcache import drop_page_cache

    sub = tmp_path / "ab" / "cd"
    sub.mkdir(parents=True)
    paths = [sub / "x.bin", tmp_path / "y.data"]
    for p in paths:
        p.write_bytes(os.urandom(1 << 20))  # buffered and dirty: in the page cache

    def cached(p: Path) -> bool:
        fd = os.open(p, os.O_RDONLY)
        try:
            return os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT) == 4096
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    assert all(cached(p) for p in paths)
    assert drop_page_cache(tmp_path) == 2
    assert not any(cached(p) for p in paths)
    assert all(p.stat().st_size == 1 << 20 for p in paths)  # written back, not lost
