"""Keys are exactly bytes: a subclass of ``bytes`` is normalised to plain ``bytes`` where keys
enter (``check_key``: ``Job``, ``lookup``, ``touch``, ``evicted``, ``forget``), so no tier
derives a name from what a subclass's methods claim (issue 10, item 7)."""

from __future__ import annotations

import os
import time

from kvtiers_fs import FsTier

import kvtiers
from kvtiers import Arena, AsyncTier, Job, Lookup, TierContext
from kvtiers.types import check_key, check_keys

SLOT = 4096


class Liar(bytes):
    """A key whose methods all lie about its bytes."""

    def hex(self, *args) -> str:
        return "../../../../escaped"

    def __bytes__(self) -> bytes:
        return b"lie"

    def __getitem__(self, i):
        return b"lie"

    def __len__(self) -> int:
        return 3

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other) -> bool:
        return True

    __ne__ = lambda self, other: False  # noqa: E731


def test_check_key_returns_plain_bytes_of_the_real_value() -> None:
    k = check_key(Liar(b"real key"))
    assert type(k) is bytes and k == b"real key" and k.hex() == b"real key".hex()
    plain = b"plain"
    assert check_key(plain) is plain  # no copy for plain bytes
    assert check_keys([Liar(b"a" * 64)]) == (b"a" * 64,)


def test_job_keys_are_plain_bytes_and_distinctness_uses_real_bytes() -> None:
    job = Job(1, (Liar(b"one"), Liar(b"two")), (0, 1))  # __eq__ says equal: they are not
    assert [type(k) for k in job.keys] == [bytes, bytes]
    assert job.keys == (b"one", b"two")


def _files_outside(top: str, root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.realpath(p).startswith(os.path.realpath(root) + os.sep):
                out.append(p)
    return out


def test_fs_tier_never_writes_outside_root_dir_for_a_lying_key(tmp_path) -> None:
    root = tmp_path / "a" / "b" / "root"
    ctx = TierContext(Arena.allocate(2, SLOT))
    h = kvtiers.open_tier(FsTier, {"root_dir": str(root)}, ctx)
    try:
        ctx.arena[0][:] = bytes(range(256)) * (SLOT // 256)
        h.submit_store(Job(1, (Liar(b"key-1"),), (0,)))
        deadline = time.monotonic() + 20
        while not (done := h.get_finished_jobs()):
            assert time.monotonic() < deadline, "store never reported"
            time.sleep(0.005)
        assert done[0].ok, done[0]
        assert _files_outside(str(tmp_path), str(root)) == []
        # the chunk is under the key's real bytes: a plain key loads it
        h.submit_load(Job(2, (b"key-1",), (1,)))
        while not (done := h.get_finished_jobs()):
            assert time.monotonic() < deadline, "load never reported"
            time.sleep(0.005)
        assert done[0].ok and bytes(ctx.arena[1]) == bytes(ctx.arena[0])
        h.touch([Liar(b"key-1")])
        while (a := h.lookup([Liar(b"key-1"), Liar(b"nope")])) and Lookup.RETRY in a:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert a == [Lookup.HIT, Lookup.MISS]
    finally:
        h.close()


class Recording(AsyncTier):
    """Remembers the type of every key its coroutines receive."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.data: dict[bytes, bytes] = {}
        self.seen: list[type] = []

    async def exists(self, key):
        self.seen.append(type(key))
        return key in self.data

    async def put(self, key, data):
        self.seen.append(type(key))
        self.data[key] = bytes(data)

    async def get_into(self, key, out):
        self.seen.append(type(key))
        if key not in self.data:
            return False
        out[:] = self.data[key]
        return True


def test_asynctier_coroutines_and_caches_see_plain_bytes() -> None:
    removed = []
    ctx = TierContext(Arena.allocate(4, SLOT), removed=lambda keys, why: removed.append((keys, why)))
    t = Recording(ctx)
    try:
        t.submit_store(Job(1, (Liar(b"x"), Liar(b"y")), (0, 1)))
        deadline = time.monotonic() + 20
        while not t.get_finished_jobs():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert t.lookup([Liar(b"x"), Liar(b"zz")])[0] is Lookup.HIT
        t.evicted([Liar(b"x")])
        assert removed == [((b"x",), "evicted")] and type(removed[0][0][0]) is bytes
        assert t.lookup([b"x", b"y"]) == [Lookup.MISS, Lookup.HIT]
        t.forget([Liar(b"y")])
        while Lookup.RETRY in (a := t.lookup([b"y", Liar(b"zz")])):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert a == [Lookup.HIT, Lookup.MISS]
        assert set(t.seen) == {bytes} and all(type(k) is bytes for k in t.data)
    finally:
        t.close()
