"""The peer server's request handlers: each message read, checked and answered.

:class:`RequestHandlers` is part of :class:`kvtiers_p2p.server.PeerServer` (kept apart for
its size): HELLO, LOOKUP, GET/GETN, PUT, CANCEL, BYE and the tests' CORRUPT. A frame that
does not fit its op raises :class:`kvtiers_p2p.protocol.ProtocolError` (the serve loop then
drops its sender).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from . import protocol as P
from .sessions import Session
from .store import MIN_CHUNK_BYTES
from .streams import Stream

log = logging.getLogger("kvtiers.p2p")

E_NO_FAULTS = "no-test-faults"  #: the ERR code of a CORRUPT sent to a server without ``test_faults``


class RequestHandlers:
    """Answering the requests of :class:`~kvtiers_p2p.server.PeerServer` (uses its ``sock``,
    ``sessions``, ``store``, ``conns`` and the session table's admission)."""

    # -- what a subclass serving other memory overrides ------------------------------------
    def _lookup(self, sess: Session, rid: int, keys: list[bytes]) -> None:
        has = self.store.has
        self._reply(sess.ident, P.pack(P.OK, rid, bytes(has(sess.ns, k) for k in keys)))

    def _get(self, st: Stream) -> None:
        self.streams.append(st)

    def _error(self, ident: bytes, rid: int, code: str, message: str) -> None:
        self.stats["refused"] += 1
        self._reply(ident, P.pack(P.ERR, rid, code, message))

    def _more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def _handle(self, ident: bytes) -> None:
        """Handle one message whose routing id was just received; its frames are read
        one by one, so a PUT's chunk goes straight into a store buffer."""
        if not self._more():
            raise P.ProtocolError("a message needs a header frame")
        head = self.sock.recv(copy=False)
        until = self.banned.get(ident)
        if until is not None:
            if until > time.monotonic():
                return
            del self.banned[ident]
        hdr = P.unpack(head.buffer)
        op, rid = hdr[0], hdr[1]
        if op not in P.REQUEST_OPS:
            raise P.ProtocolError(f"unknown op {op}")
        if op == P.PUT:
            if not self._more():
                raise P.ProtocolError("PUT without a chunk frame")
        elif self._more():
            raise P.ProtocolError(f"{P.REQUEST_OPS[op]} with more than one frame")
        if op == P.HELLO:
            return self._hello(ident, rid, hdr, head)
        if op == P.CORRUPT:  # no session: the caller (conformance_corrupt) knows no chunk size
            return self._corrupt(ident, rid, hdr)
        sess = self.sessions.get(ident)
        if sess is None:
            if op not in (P.BYE, P.CANCEL):
                self._error(ident, rid, P.E_HELLO, "no session: send HELLO first (or the session idled out)")
            return
        self.ns_used[sess.ns] = sess.last_seen = time.monotonic()
        if op == P.LOOKUP:
            P.expect_len(hdr, 3, "LOOKUP")
            self._lookup(sess, rid, P.check_keys(hdr[2]))
        elif op == P.GET or op == P.GETN:
            P.expect_len(hdr, 3 if op == P.GET else 4, P.REQUEST_OPS[op])
            keys = P.check_keys(hdr[2])
            stage = None
            if op == P.GETN:
                if sess.nixl is None:
                    return self._error(ident, rid, P.E_NONIXL, "GETN without NIXL in the handshake")
                stage = hdr[3]
                n = sess.nixl[2]
                if type(stage) is not list or len(stage) != len(keys) or not all(
                        type(i) is int and 0 <= i < n for i in stage):
                    raise P.ProtocolError(f"GETN slot indexes must be {len(keys)} ints in [0, {n})")
            if sess.streams >= self.limits.max_inflight:
                return self._error(ident, rid, P.E_BUSY, f"more than {self.limits.max_inflight} GETs in flight")
            sess.streams += 1
            self._get(Stream(sess, rid, keys, stage=stage))
        elif op == P.PUT:
            P.expect_len(hdr, 4, "PUT")
            self._put(sess, rid, P.check_key(hdr[2]), P.check_hash(hdr[3]))
        elif op == P.CANCEL:
            P.expect_len(hdr, 3, "CANCEL")
            target = hdr[2]
            for st in list(self.streams):
                if st.session is sess and st.rid == target:
                    self.streams.remove(st)
                    sess.streams -= 1
                    writes = [x[1] for x in st.posted.values() if x[0] == "w"]
                    self._ended(st)
                    if st.stage is not None:  # GETN: DONE says no write of it can land any more
                        self.draining.append((ident, st.rid, writes))
        elif op == P.PIN:
            P.expect_len(hdr, 5, "PIN")
            self._pin(sess, rid, P.check_keys(hdr[2]), P.check_seconds(hdr[3]), P.check_owner(hdr[4]))
        elif op == P.UNPIN:
            P.expect_len(hdr, 4, "UNPIN")
            keys = None if hdr[2] is None else P.check_keys(hdr[2])
            owner = P.check_owner(hdr[3])
            pins = getattr(self.store, "unpin", None)
            self._reply(ident, P.pack(P.OK, rid, 0 if pins is None else pins(sess.ns, keys, owner)))
        elif op == P.BYE:
            self._drop(ident)

    def _hello(self, ident: bytes, rid: int, hdr: list, head: Any = None) -> None:
        addr = self.conns.hello(self._fd)
        if addr is None:  # its connection is being closed
            return
        if len(hdr) not in (6, 7):
            raise P.ProtocolError(f"HELLO header has {len(hdr)} items, expected 6 or 7")
        _, _, version, ns, chunk, max_bytes = hdr[:6]
        extra = hdr[6] if len(hdr) == 7 else {}
        if not isinstance(extra, dict):
            raise P.ProtocolError("HELLO: the 7th item must be a map")
        if type(version) is not int or type(ns) is not str or not 0 < len(ns) <= 64:
            raise P.ProtocolError("HELLO: bad version or namespace")
        if type(chunk) is not int or chunk <= 0 or (max_bytes is not None and (type(max_bytes) is not int
                                                                                or max_bytes < 0)):
            raise P.ProtocolError("HELLO: bad chunk size or max_bytes")
        if version != P.VERSION:
            return self._error(ident, rid, P.E_VERSION, f"protocol version {version} not served (server speaks "
                                                        f"{P.VERSION})")
        if self.namespace is not None and ns != self.namespace:
            return self._error(ident, rid, P.E_MISMATCH,
                               f"namespace mismatch: client {ns}, server {self.namespace}")
        if self.tenants is not None:
            user = head.get("User-Id") if head is not None else None
            allowed = self.tenants.get(user or "", frozenset())
            if allowed is not None and ns not in allowed:
                return self._error(ident, rid, P.E_FORBIDDEN,
                                   f"namespace {ns} is not among this client key's namespaces on the server")
        if chunk < MIN_CHUNK_BYTES:
            return self._error(ident, rid, P.E_TOO_SMALL,
                               f"chunk of {chunk} bytes is below the server's minimum of {MIN_CHUNK_BYTES}")
        if self.store is not None:
            self._forget_unused()
        want = self.pinned_chunk or self.ns_chunk.get(ns)
        if want is not None and chunk != want:
            return self._error(ident, rid, P.E_MISMATCH,
                               f"chunk size mismatch in namespace {ns}: client {chunk} bytes, server {want} bytes")
        if chunk > self.limits.max_chunk_bytes:
            return self._error(ident, rid, P.E_TOO_BIG,
                               f"chunk of {chunk} bytes exceeds the server's {self.limits.max_chunk_bytes}")
        peer = self._peer(addr, head)
        victim, reclaim = None, []  # a session to reap, namespaces to reclaim: only once the HELLO is answered OK
        if ident not in self.sessions:
            refusal, victim = self._admit(peer)
            if refusal is not None:
                return self._error(ident, rid, P.E_FULL, refusal)
        if self.store is not None and ns not in self.ns_chunk:
            refusal, reclaim = self._room_for(ns, chunk, peer, ident)
            if refusal is not None:
                return self._error(ident, rid, P.E_FULL, refusal)
        nixl = None
        if "nixl" in extra:
            x = extra["nixl"]
            if not isinstance(x, dict) or type(x.get("md")) is not bytes or not all(
                    type(x.get(k)) is int and x.get(k) > 0 for k in ("base", "n", "stride")):
                raise P.ProtocolError("HELLO: malformed nixl descriptor")
            if x["stride"] < chunk:
                raise P.ProtocolError("HELLO: nixl slot stride smaller than a chunk")
            if self.nixl is None:
                return self._error(ident, rid, P.E_NONIXL,
                                   "this server does not serve NIXL: start it with `kvtiers p2p serve --nixl`")
            try:
                nixl = (self.nixl.add_peer(x["md"]), x["base"], x["n"], x["stride"])
            except Exception as e:
                return self._error(ident, rid, P.E_NONIXL, f"NIXL refused the client's agent: {e}")
        if victim is not None:
            self._reap(victim[0], victim[1])
        if reclaim:
            self._reclaim(reclaim, ident, f"room for a namespace of {peer}")
        self.ns_chunk.setdefault(ns, chunk)
        self.ns_owner.setdefault(ns, peer)
        self.ns_used[ns] = time.monotonic()
        sess = self.sessions.get(ident)
        if sess is not None and sess.ns == ns:  # a repeated HELLO: keep its streams and queued replies
            sess.max_bytes, sess.last_seen, sess.nixl = max_bytes, time.monotonic(), nixl
        else:
            self._drop(ident)
            self.sessions[ident] = Session(ident, ns, chunk, max_bytes, time.monotonic(), nixl=nixl, fd=self._fd,
                                           peer=peer)
            self.conns.bind(self._fd, ident)
        info = {"version": P.VERSION, "instance": self.instance, "max_inflight": self.limits.max_inflight,
                "max_batch": P.MAX_BATCH, "nixl": nixl is not None, "pid": os.getpid(), "boot": P.boot_id(),
                "pins": hasattr(self.store, "pin")}
        self._reply(ident, P.pack(P.OK, rid, info))

    def _put(self, sess: Session, rid: int, key: bytes, digest: int) -> None:
        store, size = self.store, sess.chunk_bytes
        if store.has(sess.ns, key):  # idempotent: keep the copy we have
            store.get(sess.ns, key)
            n = len(self.sock.recv(copy=False))
            if n != size:
                return self._error(sess.ident, rid, P.E_MALFORMED, f"chunk of {n} bytes, the namespace's are {size}")
            return self._reply(sess.ident, P.pack(P.OK, rid, []))
        quota = self.quota(sess.ns)
        got = store.reserve(sess.ns, size, quota, self._active_ns())
        if got is None:
            self.sock.recv(copy=False)
            limit = store.capacity if quota is None else min(quota, store.capacity)
            return self._error(sess.ident, rid, P.E_CAPACITY, f"no room for a chunk of {size} bytes (capacity "
                                                              f"{limit} bytes, the rest still being sent)"
                               if size <= limit else f"a chunk of {size} bytes never fits the capacity")
        buf, evicted = got
        n = self.sock.recv_into(buf)
        if n != size or self._more():
            store.release(sess.ns, buf)
            if self._more():
                raise P.ProtocolError("PUT with more than two frames")
            return self._error(sess.ident, rid, P.E_MALFORMED, f"chunk of {n} bytes, the namespace's are {size}")
        if P.checksum(buf) != digest:  # damaged on the way: never keep it
            store.release(sess.ns, buf)
            return self._error(sess.ident, rid, P.E_CORRUPT, "chunk arrived with a wrong xxh3")
        store.commit(sess.ns, key, buf, digest)
        self.stats["chunks_stored"] += 1
        self._reply(sess.ident, P.pack(P.OK, rid, evicted[: P.MAX_BATCH]))  # the client's HITs of the rest expire

    def _pin(self, sess: Session, rid: int, keys: list[bytes], seconds: float | None, owner: str) -> None:
        """PIN: keep ``keys`` of the session's namespace from eviction (docs/pins.md); the
        answer names the keys newly pinned for ``owner``, or why the pin was refused whole."""
        pin = getattr(self.store, "pin", None)
        if pin is None:
            return self._reply(sess.ident, P.pack(P.OK, rid, {"why": "this peer keeps no pins (it serves an engine's "
                                                                     "arena)"}))
        why, new = pin(sess.ns, keys, seconds, owner, self.quota(sess.ns))
        self._reply(sess.ident, P.pack(P.OK, rid, {"why": why} if why is not None else {"new": new}))

    def _corrupt(self, ident: bytes, rid: int, hdr: list) -> None:
        """CORRUPT (servers started with ``test_faults`` only): flip the first, middle and
        last byte of a stored chunk in place and keep its xxh3, as bit rot in memory would,
        so a later GET sends bytes the client rejects. Answers the offsets flipped (none
        when the key is not stored). A GET already sending this buffer may send damaged
        bytes too, which its client rejects the same way."""
        P.expect_len(hdr, 4, "CORRUPT")
        ns, key = hdr[2], P.check_key(hdr[3])
        if type(ns) is not str or not 0 < len(ns) <= 64:
            raise P.ProtocolError("CORRUPT: bad namespace")
        if not self.test_faults:
            return self._error(ident, rid, E_NO_FAULTS, "CORRUPT refused: this server was not started with "
                                                        "--test-faults (fault injection is for tests only)")
        item = self.store.get(ns, key)
        if item is None:
            return self._reply(ident, P.pack(P.OK, rid, []))
        buf, size = item[0], item[2]
        offsets = sorted({0, size // 2, size - 1})
        for off in offsets:
            buf[off] ^= 0x5A
        self.stats["corrupted"] = self.stats.get("corrupted", 0) + 1
        log.warning("p2p server: CORRUPT damaged key %s of namespace %s (test fault)", key.hex(), ns)
        self._reply(ident, P.pack(P.OK, rid, offsets))
