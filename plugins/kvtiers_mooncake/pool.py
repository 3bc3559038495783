"""A pool for tests and the conformance suite, and the suite's fault injection.

:func:`start_test_pool` starts a real ``mooncake_master`` on loopback and a ``serve`` process
contributing memory to it, with the short ``client_ttl`` and lease that make failure tests
fast; :func:`shared_test_pool` keeps one per process (``conformance_config`` uses it, so
``kvtiers conformance mooncake`` and ``kvtiers bench tier mooncake`` run without a config).
:func:`corrupt` damages a stored object in place for rule 4.
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass

from .master import MasterProcess, start_master
from .serve import ServeProcess, start_serve

TEST_CLIENT_TTL = 2  # seconds: a dead client's objects leave the pool this soon
TEST_LEASE_MS = 1000  # default_kv_lease_ttl: removes are refused this long after a put or get
# The shared pool's segment, sized for ``kvtiers bench tier``'s defaults: a round stores 256 MiB
# through the tier and as much through the raw baseline before loading either. The master
# evicts (above 90% full) the objects whose lease ran out longest ago, a put counting as a
# lease that ends at once and a get granting the lease (1 s here): so the pool must hold the
# round being measured and the one before it, whose loads ended less than a lease ago, with
# room for the allocator's rounding and the watermark. A segment's pages are only touched as
# objects are written: tests that store little use little.
SHARED_SEGMENT = 2 << 30


@dataclass
class TestPool:
    """A master and the serve processes contributing to it."""

    __test__ = False  # not a pytest class

    master: MasterProcess
    serves: list[ServeProcess]

    @property
    def address(self) -> str:
        return self.master.address

    def stop(self) -> None:
        """SIGKILL every process (a fast teardown: a graceful Mooncake close takes ~2 s)."""
        for s in self.serves:
            s.kill()
        self.master.kill()


def start_test_pool(segment: int = 512 << 20, *, serves: int = 1, client_ttl: float = TEST_CLIENT_TTL,
                    lease_ms: int = TEST_LEASE_MS, **master_args) -> TestPool:
    """A master on loopback and ``serves`` processes of ``segment`` bytes each."""
    master = start_master(client_ttl=client_ttl, default_kv_lease_ttl=lease_ms, **master_args)
    procs = []
    try:
        for _ in range(serves):
            procs.append(start_serve(master.address, segment))
    except BaseException:
        for p in procs:
            p.kill()
        master.kill()
        raise
    return TestPool(master, procs)


_shared: TestPool | None = None
_shared_lock = threading.Lock()


def shared_test_pool() -> TestPool:
    """This process's test pool, started on first use (restarted if a process of it died)."""
    global _shared
    with _shared_lock:
        if _shared is not None and not (_shared.master.alive() and all(s.alive() for s in _shared.serves)):
            _shared.stop()
            _shared = None
        if _shared is None:
            _shared = start_test_pool(SHARED_SEGMENT)
        return _shared


def corrupt(config: dict, name: str, timeout: float = 30.0) -> None:
    """Rewrite object ``name`` with three payload bytes flipped, same length, trailer kept, on
    the pool of ``config`` (an instance's options). Raises if the object is not there."""
    from . import client as mc
    from .client import address

    setup = mc.Setup(**{f: config[f] for f in mc.Setup.__dataclass_fields__ if f in config})
    client = mc.acquire(setup)
    store = client.store
    try:
        size = store.get_size(name)
        if size <= 40:
            raise ValueError(f"mooncake object {name!r} is not there to damage ({mc.code_name(size)})")
        mem = mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        view = memoryview(mem)
        addr = address(view)
        reg = client.register(addr, len(mem), "a scratch buffer")
        try:
            rc = store.get_into(name, addr, size)
            if rc != size:
                raise ValueError(f"reading mooncake object {name!r} failed: {mc.code_name(rc)}")
            n = size - 40
            for off in {0, n // 2, n - 1}:
                view[off] ^= 0xFF
            damaged = bytes(view[:size])
            deadline = time.monotonic() + timeout
            while True:  # an object under a lease refuses an upsert for a moment; read back to be sure
                rc = store.upsert_from(name, addr, size)
                if rc == 0:
                    view[:size] = b"\0" * size
                    if store.get_into(name, addr, size) == size and bytes(view[:size]) == damaged:
                        break
                    view[:size] = damaged
                if time.monotonic() > deadline:
                    raise ValueError(f"rewriting mooncake object {name!r} failed: {mc.code_name(rc)}")
                time.sleep(0.1)
        finally:
            client.unregister(reg)
            view.release()
            mem.close()
    finally:
        mc.release(client)
