"""The fs tier's split reads: a chunk larger than ``read_extent_bytes`` is read as concurrent
extents (the load's thread and the extent pool). Each extent lands where it belongs, a file that
ends inside any extent or whose bytes changed in one is a corrupt key (removed, reported, never
loaded), an I/O error in one extent fails that key alone, and bad values of the option are
refused by name."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from test_fs_helpers import SLOT

EXTENT = 16 << 10  # four extents per 64 KiB slot


def extent_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtiers-fs-extent")]


def test_a_chunk_read_in_extents_lands_byte_exact(env):
    t = env.open(read_extent_bytes=EXTENT)
    keys = [b"k%02d" % i for i in range(12)]
    assert env.store(t, keys).ok
    r = env.load(t, keys)
    assert r.ok, r.error
    env.check(keys)
    assert extent_threads(), "the extent pool never ran: nothing was split"


def test_extents_that_do_not_divide_the_slot(env):
    t = env.open(read_extent_bytes=24 << 10)  # 24 + 24 + 16 KiB
    assert env.store(t, [b"odd"]).ok
    assert env.load(t, [b"odd"]).ok
    env.check([b"odd"])


def test_no_split_when_the_option_is_zero(env):
    before = set(extent_threads())
    t = env.open(read_extent_bytes=0)
    assert env.store(t, [b"whole"]).ok
    assert env.load(t, [b"whole"]).ok
    env.check([b"whole"])
    assert set(extent_threads()) == before


@pytest.mark.parametrize(("cut", "why"), [
    (EXTENT + 100, f"file is {EXTENT + 100} bytes long"),  # ends in the second extent
    (3 * EXTENT, f"file is {3 * EXTENT} bytes long"),  # the last extent missing
    (SLOT + 100, f"file is {SLOT + 100} bytes long"),  # the trailer cut
    (0, "file is 0 bytes long"),
])
def test_a_file_ending_inside_an_extent_is_corrupt(env, cut, why):
    t = env.open(read_extent_bytes=EXTENT)
    assert env.store(t, [b"victim", b"other!"]).ok
    os.truncate(t.path(b"victim"), cut)
    r = env.load(t, [b"victim", b"other!"])
    assert r.failed_keys == (b"victim",)
    assert "corrupt" in r.error and why in r.error, r.error
    assert (b"victim", "corrupt") in env.removed and not os.path.exists(t.path(b"victim"))
    env.check([b"other!"], [1])


def test_a_byte_changed_in_a_middle_extent_fails_the_checksum(env):
    t = env.open(read_extent_bytes=EXTENT)
    assert env.store(t, [b"victim", b"other!"]).ok
    with open(t.path(b"victim"), "r+b") as f:
        f.seek(2 * EXTENT + 7)
        b = f.read(1)
        f.seek(2 * EXTENT + 7)
        f.write(bytes([b[0] ^ 1]))
    r = env.load(t, [b"victim", b"other!"])
    assert r.failed_keys == (b"victim",) and "checksum mismatch" in r.error, r.error
    env.check([b"other!"], [1])


def test_an_io_error_in_one_extent_fails_that_key_only(env, monkeypatch):
    t = env.open(read_extent_bytes=EXTENT)
    assert env.store(t, [b"victim", b"other!"]).ok
    victim = os.stat(t.path(b"victim")).st_ino
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):  # fault injection: EIO in the victim's second extent
        if offset == EXTENT and os.fstat(fd).st_ino == victim:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    r = env.load(t, [b"victim", b"other!"])
    assert r.failed_keys == (b"victim",) and "Input/output error" in r.error, r.error
    env.check([b"other!"], [1])
    monkeypatch.setattr(os, "preadv", real)
    assert env.load(t, [b"victim"]).ok  # the file was not damaged: the next load reads it
    env.check([b"victim"])


@pytest.mark.parametrize("bad", [-4096, 1000, 4097, 1.5, "8M", True])
def test_bad_extent_sizes_are_refused_by_name(env, bad):
    with pytest.raises(ValueError, match="read_extent_bytes"):
        env.open(read_extent_bytes=bad)

