"""The optional NIXL data path (``backend: "nixl"``): chunk bytes through NIXL's OBJ plugin.

NIXL (``pip install 'kvtiers[nixl]'``, i.e. ``nixl-cu12``) moves bytes between registered
DRAM and S3 objects with the AWS C++ SDK on its own threads. The object names and the
object format are exactly those of :mod:`kvtiers_obj.layout` (payload, then the 32-byte
trailer), so chunks written by either backend are read by the other. Only the chunk bytes
move through NIXL; HEAD, DELETE, listing and the namespace document stay on the tier's
aiobotocore client.

How the bytes move (what NIXL's OBJ plugin allows, nixl-cu12 1.5.1):

* **Staging, not the slot.** NIXL cannot abort a transfer it has posted: a GET from a
  server that stopped answering keeps its buffer for as long as the AWS SDK retries (about
  a minute measured against a SIGSTOPped server). The tier must fail such a key within
  ``op_timeout`` and never touch the slot afterwards, so NIXL moves bytes only to and from
  a registered staging area (``max_concurrency`` buffers of ``slot_bytes + 64``, 4 KiB
  aligned, allocated at open). A cancelled operation returns at once; its staging buffer is
  quarantined until NIXL reports the transfer finished. That costs one memcpy per chunk
  (~13 GB/s here, against well under 1 GB/s on the wire).
* **Store**: one PUT per chunk. The plugin writes an object from exactly one buffer (a
  write at a non-zero object offset is refused), so the slot is copied into staging, the
  trailer written after it, and ``payload || trailer`` PUT. There is no conditional PUT:
  write-once is the tier's HEAD before the PUT; two writers racing on one key both write a
  complete, valid object of that key (the last one stays).
* **Load**: one transfer of ranged GETs of ``[0, N+64)`` into staging, in ``part_size``
  pieces fetched in parallel (one GET up to ``part_size``): payload, trailer, and 32 bytes
  preset to a fresh random pattern. A longer object overwrites the pattern (found unless its extra bytes
  happen to equal it); a shorter one leaves the trailer torn or fails the ranged GET. The
  trailer is then checked exactly as on the aiobotocore path and the payload copied into
  the slot.
* A failed transfer does not say why, so the tier HEADs the object: missing is a miss, a
  wrong size is a corrupt object, anything else an error.
* **PUT checksums**: the backend is created with ``req_checksum: required``, so the SDK
  sends a plain body instead of an aws-chunked body with a CRC trailer (SeaweedFS stores
  that framing verbatim when unsigned and rejects its signature otherwise); integrity is
  our own trailer.

All NIXL calls run on the tier's I/O loop thread (the agent is not shared across threads);
one poller task checks the transfers in flight every ``POLL_S`` seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from kvtiers_nixl import make_agent, teardown

from kvtiers import TierError

from . import layout

log = logging.getLogger("kvtiers.obj")

POLL_S = 0.001  # how often the poller checks transfers in flight
SCRATCH = 64  # trailer (40) + a random pattern (24) that a longer object overwrites


def nixl_available() -> bool:
    """Whether ``nixl_cu12`` imports here."""
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception:
        return False
    return True


def check_nixl() -> None:
    """Raise :class:`TierError` unless the NIXL path can be used (``nixl-cu12`` imports and
    has the OBJ plugin)."""
    if not nixl_available():
        raise TierError(
            "tier 'obj': backend 'nixl' needs nixl-cu12: pip install 'kvtiers[nixl]' (or use backend 'aiobotocore')"
        )


class TransferFailed(RuntimeError):
    """NIXL reported a transfer as failed (it does not say why)."""


class _Lease:
    """One staging buffer lent to an operation; given back once (later, if deferred)."""

    def __init__(self, pool: asyncio.Queue[int], index: int) -> None:
        self.pool, self.index, self.deferred, self._back = pool, index, False, False

    def give_back(self) -> None:
        if not self._back:
            self._back = True
            self.pool.put_nowait(self.index)


class NixlObjPath:
    """A NIXL agent with the OBJ backend on one bucket and a registered staging area.

    Create, use and :meth:`aclose` it on the tier's I/O loop thread only.
    """

    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str | None,
        region: str,
        credentials: tuple[str | None, str | None],
        addressing_style: str,
        slot_bytes: int,
        max_concurrency: int,
        part_size: int,
    ) -> None:
        check_nixl()
        self.part_size = part_size
        self.slot_bytes = slot_bytes
        params = {"bucket": bucket, "region": region, "req_checksum": "required"}
        # the plugin's SDK thread pool defaults to half the cores (one here): one thread per
        # operation the tier runs at once, or NIXL serialises them
        params["num_threads"] = str(max_concurrency)
        if endpoint_url:
            params["endpoint_override"] = endpoint_url
            params["scheme"] = urlsplit(endpoint_url).scheme or "https"
        virtual = addressing_style == "virtual" or (addressing_style == "auto" and not endpoint_url)
        params["use_virtual_addressing"] = "true" if virtual else "false"
        key_id, secret = credentials
        if key_id is not None and secret is not None:
            params["access_key"], params["secret_key"] = key_id, secret
        self._closed = False
        self._waiting: dict[Any, asyncio.Future] = {}
        try:  # kvtiers_nixl: the safe environment, no progress thread, torn down in this process at exit
            self.agent = make_agent("kvtiers-obj", "OBJ", params, owner_close=self._close_at_exit)
        except RuntimeError as e:
            if "no OBJ plugin" in str(e):
                raise TierError("tier 'obj': this nixl-cu12 has no OBJ plugin; use backend 'aiobotocore'") from None
            raise TierError(f"tier 'obj': cannot start NIXL's OBJ backend: {type(e).__name__}: {e}") from None
        except Exception as e:
            raise TierError(f"tier 'obj': cannot start NIXL's OBJ backend: {type(e).__name__}: {e}") from None
        self.name = self.agent.name
        self._stage_bytes = -(-(slot_bytes + SCRATCH) // 4096) * 4096
        self._stage = np.zeros(max_concurrency * self._stage_bytes, dtype=np.uint8)
        self._base = int(self._stage.ctypes.data)
        self._reg = self.agent.register_memory([(self._base, self._stage.nbytes, 0, "")], "DRAM", ["OBJ"])
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(max_concurrency):
            self._free.put_nowait(i)
        self._dev_ids = itertools.count(1)
        self._poller: asyncio.Task | None = None

    def _view(self, lease: _Lease, n: int) -> memoryview:
        lo = lease.index * self._stage_bytes
        return memoryview(self._stage)[lo : lo + n]

    # -- transfers ----------------------------------------------------------------------
    async def _run(self, op: str, name: str, obj_len: int, pieces: Sequence[tuple[int, int]], lease: _Lease) -> None:
        """One transfer of ``pieces`` ``(offset, length)`` between ``lease``'s staging buffer
        and the same offsets of object ``name`` (``obj_len`` bytes registered); raise
        :class:`TransferFailed` if NIXL reports an error. If the caller is cancelled while
        NIXL works, the lease is marked deferred and given back when NIXL has finished."""
        agent = self.agent
        dev = next(self._dev_ids)
        base = self._base + lease.index * self._stage_bytes
        reg = agent.register_memory([(0, obj_len, dev, name)], "OBJ", ["OBJ"])
        handle = None

        def cleanup() -> None:
            if handle is not None:
                try:
                    handle.release()
                except Exception as e:
                    log.debug("obj: NIXL release of the transfer of %s failed: %s", name, e)
            try:
                agent.deregister_memory(reg, ["OBJ"])
            except Exception as e:
                log.debug("obj: NIXL deregister of %s failed: %s", name, e)

        try:
            local = agent.get_xfer_descs([(base + off, n, 0) for off, n in pieces], "DRAM")
            remote = agent.get_xfer_descs([(off, n, dev) for off, n in pieces], "OBJ")
            handle = agent.initialize_xfer(op, local, remote, self.name, backends=["OBJ"])
            try:
                state = agent.transfer(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                fut = asyncio.get_running_loop().create_future()
                self._waiting[handle] = fut
                self._wake()
                try:
                    state = await asyncio.shield(fut)
                except asyncio.CancelledError:
                    lease.deferred = True

                    def late(_: asyncio.Future) -> None:
                        cleanup()
                        lease.give_back()

                    fut.add_done_callback(late)
                    raise
        except asyncio.CancelledError:
            raise
        except BaseException:
            cleanup()
            raise
        cleanup()
        if state != "DONE":
            raise TransferFailed(f"NIXL {op} of s3 object {name} failed")

    def _wake(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        agent = self.agent
        while self._waiting:
            await asyncio.sleep(POLL_S)
            for handle, fut in list(self._waiting.items()):
                try:
                    state = agent.check_xfer_state(handle)
                except Exception:
                    state = "ERR"
                if state != "PROC":
                    del self._waiting[handle]
                    if not fut.done():
                        fut.set_result(state)

    # -- the two operations ----------------------------------------------------------------
    async def write(self, name: str, payload: memoryview, trailer: bytes) -> None:
        """PUT ``payload || trailer`` as object ``name`` (one copy into staging)."""
        n = len(payload)
        size = n + len(trailer)
        if size > self._stage_bytes:
            raise ValueError(f"chunk of {n} bytes is larger than the NIXL staging buffers ({self.slot_bytes})")
        lease = _Lease(self._free, await self._free.get())
        try:
            view = self._view(lease, size)
            view[:n] = payload
            view[n:] = trailer
            await self._run("WRITE", name, size, [(0, size)], lease)
        finally:
            if not lease.deferred:
                lease.give_back()

    async def read(self, name: str, out: memoryview) -> bytes:
        """Ranged GETs of object ``name`` into staging; on success the payload is copied
        into ``out`` and the 32-byte trailer returned (unchecked). Raise
        :class:`layout.CorruptObject` if the object is longer than ``len(out) + 32`` or its
        trailer is torn (found from the pattern), :class:`TransferFailed` if NIXL fails
        (missing, shorter than ``len(out)``, server error)."""
        n = len(out)
        if n + SCRATCH > self._stage_bytes:
            raise ValueError(f"chunk of {n} bytes is larger than the NIXL staging buffers ({self.slot_bytes})")
        lease = _Lease(self._free, await self._free.get())
        try:
            view = self._view(lease, n + SCRATCH)
            pattern = os.urandom(SCRATCH)
            view[n:] = pattern
            pieces = [(a, min(a + self.part_size, n) - a) for a in range(0, n, self.part_size)]
            pieces[-1] = (pieces[-1][0], n + SCRATCH - pieces[-1][0])  # the tail rides with the last
            await self._run("READ", name, n + SCRATCH, pieces, lease)
            if view[n + layout.TRAILER_BYTES :] != pattern[layout.TRAILER_BYTES :]:
                raise layout.CorruptObject(f"object is longer than {n + layout.TRAILER_BYTES} bytes")
            out[:] = view[:n]
            return bytes(view[n : n + layout.TRAILER_BYTES])
        finally:
            if not lease.deferred:
                lease.give_back()

    async def aclose(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` s for transfers NIXL still runs, then deregister and drop
        the agent. Transfers still running then keep the agent and staging alive for good
        (NIXL would otherwise write into freed memory)."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._waiting and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._waiting:
            log.warning("obj: %d NIXL transfers still running at close; keeping their buffers", len(self._waiting))
            _KEPT.append(self)
            return
        if self._poller is not None:
            self._poller.cancel()
        agent, self.agent = self.agent, None
        teardown(agent, regs=[(self._reg, ["OBJ"])])

    def _close_at_exit(self) -> None:
        """At interpreter exit, for a tier never closed: tear down unless NIXL still works."""
        if not self._closed and not self._waiting:
            self._closed = True
            agent, self.agent = self.agent, None
            teardown(agent, regs=[(self._reg, ["OBJ"])])


_KEPT: list[NixlObjPath] = []  # paths closed while NIXL still wrote into their staging
