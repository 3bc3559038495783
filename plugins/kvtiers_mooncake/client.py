"""The Mooncake Store client as the tier uses it: loading the bindings (with a clear error
naming what is missing), the return codes, and one shared client per process and setup.

An engine process has one Mooncake client: ``setup`` costs up to 0.4 s and ``close`` 1.5-2 s,
so every tier instance of a process with the same setup options shares one
``MooncakeDistributedStore``. Shared clients live until the process exits; one that
contributes a segment is closed then (so the master drops its objects at once instead of
after ``client_ttl``).

Buffers are registered once per client, refcounted (:meth:`SharedClient.register`): Mooncake's
transfer engine refuses a region that overlaps one it holds (``register_buffer`` -600,
"does not support overlapped memory region"), and two tier instances over one arena (two
namespaces, or a test and a prod instance, on one pool) register the same region.
"""

from __future__ import annotations

import atexit
import ctypes.util
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtiers import TierError

# Mooncake's return codes (ErrorCode in its client), those this tier acts on
NO_AVAILABLE_HANDLE = -200  # the pool is full: the master's asynchronous eviction frees space later
INVALID_PARAMS = -600  # empty key or value, a buffer of the wrong size
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706  # a remove within default_kv_lease_ttl of a put or get
LEASE_EXPIRED = -707  # a get whose lease ran out before its transfer ended: its bytes cannot be trusted
TRANSFER_FAIL = -800  # e.g. the segment holding the object died (until client_ttl passes)
RPC_FAIL = -900  # the master is unreachable
CODE_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE", INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL",
}  # fmt: skip

INSTALL = "pip install 'kvtiers[mooncake]'"


def code_name(rc: int) -> str:
    """``-200 (NO_AVAILABLE_HANDLE)``: a return code with its name where known."""
    name = CODE_NAMES.get(rc)
    return f"{rc} ({name})" if name else str(rc)


def missing() -> str | None:
    """What this machine lacks to run the tier, in one line, or ``None``: the Python package
    (``mooncake-transfer-engine-non-cuda``) or the system library ``libibverbs.so.1`` it
    links (Debian/Ubuntu: ``apt-get install --no-install-recommends libibverbs1``)."""
    try:
        import importlib.util

        if importlib.util.find_spec("mooncake") is None:
            return f"the Mooncake Store bindings are not installed: {INSTALL}"
    except (ImportError, ValueError):
        return f"the Mooncake Store bindings are not installed: {INSTALL}"
    if ctypes.util.find_library("ibverbs") is None:
        try:
            ctypes.CDLL("libibverbs.so.1")
        except OSError:
            return ("the system library libibverbs.so.1 (linked by Mooncake) is missing: "
                    "apt-get install --no-install-recommends libibverbs1")
    return None


def load_store_module() -> Any:
    """``mooncake.store``, or a :class:`TierError` naming what is missing."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's clients log every failed call otherwise
    try:
        import mooncake.store as store
    except ImportError as e:
        why = missing() or f"import mooncake.store failed: {e}"
        raise TierError(f"tier 'mooncake': {why}") from None
    return store


@dataclass(frozen=True)
class Setup:
    """The options of one ``MooncakeDistributedStore.setup`` call."""

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20


def address(buf: Any) -> int:
    """The address of the first byte of a writable buffer (no reference kept)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class SharedClient:
    """One set-up ``MooncakeDistributedStore``, the tier instances using it, and the buffers
    registered with it (one registration per region, shared by every user of the region)."""

    def __init__(self, setup: Setup, store: Any) -> None:
        self.setup = setup
        self.store = store
        self.users = 0
        self.lock = threading.Lock()  # register_buffer / unregister_buffer and the regions
        self.regions: dict[int, list[int]] = {}  # start address -> [size, users]

    def register(self, addr: int, size: int, what: str) -> int:
        """Make ``[addr, addr + size)`` usable for transfers. A region registered already that
        holds it (the same arena, opened by another tier instance) gets one more user instead
        of a second ``register_buffer``, which Mooncake refuses. Returns the registration (the
        start of the region counted) to give :meth:`unregister`."""
        with self.lock:
            for start, region in self.regions.items():
                if start <= addr and addr + size <= start + region[0]:
                    region[1] += 1
                    return start
            rc = self.store.register_buffer(addr, size)
            if rc == 0:
                self.regions[addr] = [size, 1]
                return addr
            overlap = [f"{start:#x}+{r[0]}" for start, r in self.regions.items()
                       if start < addr + size and addr < start + r[0]]
        why = f" (it overlaps registered region(s) {', '.join(overlap)} without lying inside one)" if overlap else ""
        raise TierError(f"tier 'mooncake': register_buffer of {what} ({size} bytes at {addr:#x}) failed: "
                        f"{code_name(rc)}{why}")

    def unregister(self, registration: int) -> None:
        """One user fewer of the region :meth:`register` returned; the last one unregisters it."""
        with self.lock:
            region = self.regions.get(registration)
            if region is None:
                return
            region[1] -= 1
            if region[1] > 0:
                return
            del self.regions[registration]
            self.store.unregister_buffer(registration)


_clients: dict[Setup, SharedClient] = {}
_clients_lock = threading.Lock()


def acquire(setup: Setup) -> SharedClient:
    """The process's client for ``setup``, set up on first use (a :class:`TierError` if the
    master cannot be reached or setup fails)."""
    with _clients_lock:
        client = _clients.get(setup)
        if client is None:
            mod = load_store_module()
            _check_reachable(setup.master_server_address)
            store = mod.MooncakeDistributedStore()
            rc = store.setup(setup.local_hostname, setup.metadata_server, setup.global_segment_size,
                             setup.local_buffer_size, setup.protocol, setup.device_name, setup.master_server_address)
            if rc != 0:
                raise TierError(
                    f"tier 'mooncake': setup against master {setup.master_server_address} failed with {code_name(rc)} "
                    f"(is mooncake_master running there? protocol={setup.protocol!r}, "
                    f"metadata_server={setup.metadata_server!r})"
                )
            client = _clients[setup] = SharedClient(setup, store)
            _warm_up(client)
        client.users += 1
        return client


CONNECT_TIMEOUT_S = 3.0


def _check_reachable(master: str) -> None:
    """A :class:`TierError` at once if nothing listens at the master's address (Mooncake's own
    setup retries for about 90 s before it gives up)."""
    import socket

    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise TierError(
            f"tier 'mooncake': no mooncake_master answers at {master} ({e}); start one "
            "(kvtiers mooncake master, or mooncake_master --rpc_port=...) or fix master_server_address"
        ) from None


WARM_PARALLEL = 8  # more than Mooncake's TCP lanes per peer (MC_TCP_LANES_PER_PEER, default 4)


def _warm_up(client: SharedClient) -> None:
    """Small puts, gets and removes through a fresh client, ``WARM_PARALLEL`` at once: its
    transport opens its connections to the pool now (Mooncake keeps a bounded number per
    peer, process-wide, like the one to the master), not during the first jobs of the first
    instance. Best effort: a pool with no space yet is no error."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    page = mmap.PAGESIZE
    mem = mmap.mmap(-1, page * WARM_PARALLEL)
    view = memoryview(mem)
    base = address(view)
    store = client.store
    tag = f"kvtiers-warmup/{os.getpid()}-{os.urandom(6).hex()}"

    def one(i: int) -> None:
        name, addr = f"{tag}-{i}", base + i * page
        for _ in range(3):
            if store.batch_put_from([name], [addr], [page])[0] != 0:
                return
            store.batch_get_into([name], [addr], [page])
            store.batch_remove([name], True)

    try:
        reg = client.register(base, len(mem), "a warm-up buffer")
        try:
            with ThreadPoolExecutor(WARM_PARALLEL, thread_name_prefix="kvtiers-mooncake-warmup") as pool:
                list(pool.map(one, range(WARM_PARALLEL)))
        finally:
            client.unregister(reg)
    except TierError:
        pass
    finally:
        view.release()
        mem.close()


def release(client: SharedClient) -> None:
    """One user fewer; the client itself stays for the next instance (see the module docstring)."""
    with _clients_lock:
        client.users -= 1


@atexit.register
def _close_at_exit() -> None:
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        if c.setup.global_segment_size > 0:  # unmount now: its objects go at once, not after client_ttl
            try:
                c.store.close()
            except Exception:
                pass
