"""The fs tier's load of a large chunk in pieces: with O_DIRECT several reads at once
(kvtiers_fs.chunkio._read_pieces), buffered one small step at a time (``_read_steps``), the
xxh3-128 taken piece by piece as they land, and the same integrity as one read: a flipped byte
in any piece, or a piece that fails to read, is a failed key, and no read into the slot is
still running when the job reports."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
from kvtiers_fs import chunkio, layout
from test_fs_helpers import Env, resolve

from kvtiers import Lookup

PIECE = chunkio.PIECE_BYTES
STEP = chunkio.STEP_BYTES
SLOT = 2 * PIECE + 8192  # three pieces, the last one short


@pytest.fixture
def big(tmp_path):
    e = Env(str(tmp_path / "kv"), slots=3, slot_bytes=SLOT)
    yield e
    e.close()


class _Spy:
    """Wraps ``os.preadv`` as the fs tier sees it: records offsets and the reads in flight;
    ``fail_at`` makes the read at that offset raise EIO, ``slow`` delays every other read."""

    def __init__(self, monkeypatch, *, fail_at: int | None = None, slow: float = 0.0) -> None:
        self.real = os.preadv
        self.offsets: list[int] = []
        self.inflight = 0
        self.lock = threading.Lock()
        self.fail_at, self.slow = fail_at, slow
        monkeypatch.setattr(chunkio.os, "preadv", self)

    def __call__(self, fd, bufs, offset):
        with self.lock:
            self.offsets.append(offset)
            self.inflight += 1
        try:
            if offset == self.fail_at:
                raise OSError(errno.EIO, "Input/output error (injected)")
            if self.slow:
                time.sleep(self.slow)
            return self.real(fd, bufs, offset)
        finally:
            with self.lock:
                self.inflight -= 1


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-possible", "buffered"])
def test_large_chunks_load_in_pieces_with_exact_bytes(big, monkeypatch, direct):
    t = big.open(direct=direct)
    keys = [b"a", b"b", b"c"]
    assert big.store(t, keys).ok
    spy = _Spy(monkeypatch)
    r = big.load(t, keys)  # three keys at once: the pool is busy with whole keys and pieces
    assert r.ok, r.error
    big.check(keys)
    # every piece of every key read at its own offset (one read of the whole chunk at 0 before):
    # O_DIRECT in device-sized pieces, buffered in cache-sized steps
    offsets = range(0, SLOT, PIECE if t.direct else STEP)
    assert sorted(spy.offsets) == sorted(list(offsets) * 3)
    assert spy.inflight == 0


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-possible", "buffered"])
@pytest.mark.parametrize("where", [0, STEP - 1, STEP, PIECE - 1, PIECE, 2 * PIECE + 1, SLOT - 1])
def test_a_flipped_byte_in_any_piece_is_refused(big, where, direct):
    t = big.open(direct=direct)
    assert big.store(t, [b"victim", b"other!"]).ok
    path = t.path(b"victim")
    with open(path, "r+b") as f:
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 1]))
    r = big.load(t, [b"victim", b"other!"])
    assert r.failed_keys == (b"victim",)
    assert "checksum mismatch" in r.error
    big.check([b"other!"], [1])
    assert not os.path.exists(path) and big.removed == [(b"victim", "corrupt")]
    assert resolve(t, [b"victim"]) == [Lookup.MISS]


def test_the_piecewise_digest_is_the_recorded_one(big):
    t = big.open()
    assert big.store(t, [b"k"]).ok
    raw = open(t.path(b"k"), "rb").read()
    h = layout.data_hasher()
    for off in range(0, SLOT, PIECE):
        h.update(raw[off:min(off + PIECE, SLOT)])
    ns = layout.namespace_tag(big.ctx.namespace.digest)
    assert h.digest() == layout.check_trailer(memoryview(bytearray(raw[SLOT:])), b"k", SLOT, ns)


def test_a_piece_that_fails_to_read_fails_the_key_after_every_read_ended(big, monkeypatch):
    t = big.open()
    if not t.direct:
        pytest.skip("O_DIRECT unavailable here: buffered loads read their pieces on one thread")
    assert big.store(t, [b"k"]).ok
    # the middle piece fails at once, the others take a while: the job must not report while
    # they still write into the slot (the engine may reuse it as soon as the job fails)
    spy = _Spy(monkeypatch, fail_at=PIECE, slow=0.3)
    seen: list[int] = []
    real_done = t._key_done

    def key_done(js, key, nbytes, error):
        seen.append(spy.inflight)
        real_done(js, key, nbytes, error)

    monkeypatch.setattr(t, "_key_done", key_done)
    r = big.load(t, [b"k"])
    assert r.failed_keys == (b"k",) and "EIO" in r.error
    assert seen == [0], f"reads still in flight when the key was reported: {seen}"
    assert os.path.exists(t.path(b"k"))  # a read error is not corruption: the file stays
    monkeypatch.setattr(chunkio.os, "preadv", spy.real)
    assert big.load(t, [b"k"]).ok
    big.check([b"k"])


def test_a_buffered_step_that_fails_to_read_fails_the_key_and_keeps_the_file(big, monkeypatch):
    t = big.open(direct=False)
    assert big.store(t, [b"k", b"j"]).ok
    spy = _Spy(monkeypatch, fail_at=PIECE + STEP)  # a step inside the second piece
    r = big.load(t, [b"k", b"j"])
    assert set(r.failed_keys) == {b"k", b"j"} and "EIO" in r.error
    assert os.path.exists(t.path(b"k"))  # a read error is not corruption: the file stays
    monkeypatch.setattr(chunkio.os, "preadv", spy.real)
    assert big.load(t, [b"k"]).ok
    big.check([b"k"])
