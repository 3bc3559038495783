"""The ``p2p`` tier: KV chunks in other hosts' memory, over ZMQ.

Options follow vLLM's p2p tier (``{"type": "p2p", "host": H, "port": P}``) and add a
``peers`` list, a ``peers_file`` the tier watches, timeouts, ``max_bytes`` (the cap the
peers keep for this namespace) and CurveZMQ keys. Lookups ask every peer in one batched
request each, in parallel, answering ``RETRY`` meanwhile; a load comes from the first peer
that holds the key; a store goes to one peer chosen by rendezvous hashing of the key, so
the peers share the load and a key keeps its home when others join or leave.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtiers import ConfigError, TierError, hookimpl
from kvtiers.misscache import MissCache
from kvtiers.types import Job, JobResult, Lookup, TierContext, accept_job, check_keys, drain

from . import protocol as P
from .peers import config_peers, peer_urls
from .peers import load_curve as _load_curve

log = logging.getLogger("kvtiers.p2p")

PEERS_FILE_POLL_S = 0.5
_SUITE_SERVERS: dict[int, Any] = {}  # port -> the ServerProcess conformance_config started


def _rank(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()


class P2PTier:
    """Chunks on peer servers (``kvtiers p2p serve``, or engines with a ``serve`` block).

    Options: ``host``/``port`` and/or ``peers``; ``peers_file`` (a JSON list in the
    ``peers`` format, re-read when it changes); ``timeout`` (seconds a load or store may
    take before its keys fail); ``lookup_timeout`` (a peer not answering a LOOKUP this long
    counts as not holding the keys); ``negative_ttl`` / ``positive_ttl`` (how long a MISS /
    a HIT is remembered); ``max_bytes`` (the cap the peers keep for this namespace: the
    largest of its connected clients' caps, none while one asks none); ``curve_server_key`` (the server's
    public key file) with ``curve_secret_file`` (this client's secret key file);
    ``backend`` (``"zmq"``, or ``"nixl"``: servers write loads straight into the arena's
    slots) with ``nixl_fence_timeout`` (seconds a failed NIXL load waits for a silent server
    to settle the slots it may still write, before its keys fail anyway; ``null``: wait as
    long as it takes, the job staying unreported). Before the NIXL path is used, NIXL's
    canary runs in a child process (:func:`kvtiers_nixl.use_nixl`); if it crashes or hangs
    the tier loads over ZMQ with one warning, or with ``nixl_strict`` fails to open; likewise
    a peer that serves no NIXL is loaded from over ZMQ (with ``nixl_strict``: refused).
    ``data_path`` says which path is in use (``"nixl"`` or ``"zmq"``), as does the gauge
    ``kvtiers_tier_data_path{tier, path}``.
    """

    levels = frozenset({"core", "shared", "bounded"})

    def __init__(self, ctx: TierContext, *, host: str | None = None, port: int | None = None,
                 peers: list | None = None, peers_file: str | None = None, timeout: float = 10.0,
                 lookup_timeout: float = 2.0, negative_ttl: float = 1.0, positive_ttl: float = 30.0,
                 max_bytes: int | None = None, curve_server_key: str | None = None,
                 curve_secret_file: str | None = None, backend: str = "zmq",
                 nixl_fence_timeout: float | None = 15.0, nixl_strict: bool = False) -> None:  # fmt: skip
        try:
            from .client import PeerClient
        except ImportError as e:
            raise TierError(f"tier 'p2p' needs pyzmq and msgpack: pip install 'kvtiers[p2p]' ({e})") from None
        if P.msgpack is None:
            raise TierError("tier 'p2p' needs msgpack: pip install 'kvtiers[p2p]'")
        if backend not in ("zmq", "nixl"):
            raise ConfigError(f"tier 'p2p': backend must be 'zmq' or 'nixl', got {backend!r}")
        if backend == "nixl":
            from kvtiers_nixl import use_nixl

            if not use_nixl("tier 'p2p'", fallback="ZMQ", strict=nixl_strict):  # raises if nixl-cu12 is missing
                backend = "zmq"
        self.data_path = backend
        if timeout <= 0 or lookup_timeout <= 0:
            raise ConfigError("tier 'p2p': timeout and lookup_timeout must be positive")
        if nixl_fence_timeout is not None and nixl_fence_timeout < 0:
            raise ConfigError(f"tier 'p2p': nixl_fence_timeout must be >= 0 or null, got {nixl_fence_timeout}")
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"tier 'p2p': max_bytes must be >= 0, got {max_bytes}")
        self.ctx = ctx
        from kvtiers_nixl import PathGauge

        self._path_gauge = PathGauge(ctx, backend)
        self.timeout = float(timeout)
        self.negative_ttl = float(negative_ttl)
        self.positive_ttl = float(positive_ttl)
        self.peers_file = peers_file
        urls = peer_urls(host, port, peers)
        if peers_file is not None:
            urls = self._read_peers_file(urls)
        curve = _load_curve(curve_server_key, curve_secret_file)
        self._lock = threading.Lock()
        self._present: dict[bytes, tuple[str, float]] = {}  # key -> (peer, expiry)
        self._misses = MissCache()
        self._finished: deque[JobResult] = deque()
        self._pending = 0
        self._closed = False
        self._pinned = False  # a pin was taken: close unpins them all on the peers
        self._urls = urls
        self._file_state: tuple[float, int] | None = None
        self._client = PeerClient(
            ctx.arena, namespace=ctx.namespace.digest, chunk_bytes=ctx.arena.slot_bytes, max_bytes=max_bytes,
            lookup_timeout=float(lookup_timeout), curve=curve,
            callbacks={"on_result": self._on_result, "on_found": self._on_found, "on_stored": self._on_stored,
                       "on_evicted": self._on_evicted, "on_missing": self._on_missing,
                       "on_restart": self._on_restart},
            nixl=backend == "nixl", fence_timeout=None if nixl_fence_timeout is None else float(nixl_fence_timeout),
        )  # fmt: skip
        self._client.nixl_fallback = not nixl_strict
        if peers_file is not None:
            self._client.cb["on_tick"] = self._watch_peers_file
        self._client.start("kvtiers-p2p")
        self._client.call(lambda: self._client.set_peers(urls))

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        """Start a peer server in a child process for one check; it exits when ``scratch``
        is removed (the end of the check) or when this process dies. The environment
        variable ``KVTIERS_P2P_BACKEND=nixl`` checks the NIXL data path instead. The server
        runs with ``--test-faults``, so :meth:`conformance_corrupt` can damage its chunks."""
        from .spawn import start_server

        backend = os.environ.get("KVTIERS_P2P_BACKEND", "zmq")
        srv = start_server(capacity=1 << 30, exit_when_missing=str(scratch),
                           extra=["--test-faults"] + (["--nixl"] if backend == "nixl" else []))
        _SUITE_SERVERS[srv.port] = srv
        return {"host": "127.0.0.1", "port": srv.port, "timeout": 10.0, "backend": backend}

    @classmethod
    def conformance_cleanup(cls, config: dict) -> str | None:
        """After a conformance run: a server :meth:`conformance_config` started for it is
        stopped now (its chunks live in its memory and go with it). Other servers keep the
        suite's chunks until they evict them or restart (the p2p protocol has no delete);
        the line returned says so."""
        srv = _SUITE_SERVERS.pop(config.get("port"), None) if config.get("host") == "127.0.0.1" else None
        if srv is not None:
            srv.stop()  # by its own PID
            return None
        peers = ", ".join(config_peers(config)) or "the configured peers"
        return (f"p2p: {peers} keep the suite's chunks in memory until they evict them or restart "
                "(the p2p protocol has no delete)")

    @classmethod
    def bench_baseline(cls, tier: P2PTier, chunk_bytes: int):
        """Raw ZMQ DEALER/ROUTER put/get to a raw peer in another process on loopback (raw
        NIXL UCX writes for loads on the NIXL path), for ``kvtiers bench tier p2p``; None
        for peers off loopback (see :mod:`kvtiers_p2p.bench`)."""
        from .bench import baseline

        return baseline(tier, chunk_bytes)

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace, key: bytes) -> None:
        """Damage the stored chunk of ``key`` in ``namespace`` (a :class:`kvtiers.Namespace`)
        on the peers of ``config``: each server holding it flips three of its bytes and keeps
        its xxh3, so a load fails the key (rule 4). The servers must run with
        ``--test-faults`` (as :meth:`conformance_config` starts them); others refuse, and this
        raises saying so, as it does when no peer holds the key."""
        from .faults import corrupt

        corrupt(config, namespace.digest, key)

    # -- peers ---------------------------------------------------------------------------
    @property
    def peers(self) -> list[str]:
        """The peer addresses in use."""
        return list(self._urls)

    def set_peers(self, peers: list) -> None:
        """Replace the peer list at run time (same entry format as the ``peers`` option).
        Requests in flight to a removed peer fail; loads of their keys try the other peers."""
        urls = peer_urls(None, None, peers)
        self._urls = urls
        self._client.call(lambda: self._client.set_peers(urls))

    def _read_peers_file(self, default: list[str]) -> list[str]:
        try:
            with open(self.peers_file, "rb") as f:
                return peer_urls(None, None, json.load(f))
        except FileNotFoundError:
            return default
        except (ValueError, ConfigError) as e:
            log.warning("p2p: ignoring peers_file %s: %s", self.peers_file, e)
            return self._urls if hasattr(self, "_urls") else default

    def _watch_peers_file(self) -> None:
        """(I/O thread, twice a second) re-read ``peers_file`` when its mtime or size changes."""
        try:
            st = os.stat(self.peers_file)
        except OSError:
            return
        state = (st.st_mtime, st.st_size)
        if state == self._file_state:
            return
        self._file_state = state
        urls = self._read_peers_file(self._urls)
        if urls != self._urls:
            self._urls = urls
            self._client.set_peers(urls)

    def peer_status(self) -> dict[str, dict[str, Any]]:
        """Per peer: connected, handshaken, the server instance, its refusal (if any)."""
        return {u: {"connected": p.connected, "ready": p.ready, "instance": p.instance, "error": p.error}
                for u, p in list(self._client.peers.items())}

    def _store_peer(self, key: bytes) -> str | None:
        urls = self._urls
        if not urls:
            return None
        return max(urls, key=lambda u: _rank(key, u))

    # -- callbacks from the I/O thread ----------------------------------------------------
    def _on_result(self, result: JobResult) -> None:
        self._finished.append(result)
        self._pending -= 1

    def _on_found(self, keys: list[bytes], found: dict[bytes, list[str]]) -> None:
        now = time.monotonic()
        with self._lock:
            misses = self._misses
            for k in keys:
                misses.probing.discard(k)
                where = found.get(k)
                if where:
                    self._present[k] = (where[0], now + self.positive_ttl)
                    misses.present(k)
                else:
                    self._present.pop(k, None)
                    misses.missing(k, now + self.negative_ttl)

    def _on_stored(self, key: bytes, url: str) -> None:
        with self._lock:
            self._present[key] = (url, time.monotonic() + self.positive_ttl)
            self._misses.present(key)

    def _on_missing(self, key: bytes, url: str) -> None:
        with self._lock:
            if self._present.get(key, ("",))[0] == url:
                del self._present[key]

    def _on_evicted(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._present.pop(k, None)
        self.ctx.removed(keys, "evicted")

    def _on_restart(self, url: str) -> None:
        with self._lock:  # what that peer held is gone
            for k in [k for k, (u, _) in self._present.items() if u == url]:
                del self._present[k]

    # -- the hooks -----------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        self._path_gauge.report()
        now = time.monotonic()
        present = self._present

        def hit(k: bytes) -> bool:  # p2p HITs expire: a peer may have evicted the key meanwhile
            h = present.get(k)
            return h is not None and h[1] > now

        with self._lock:
            out, probe = self._misses.answer(keys, hit, now)
        if probe and not self._closed:
            self._client.call(lambda: self._client.probe(probe))
        return out

    def _items(self, job: Job, load: bool) -> list:
        from .inflight import Item, JobState

        now = time.monotonic()
        state = JobState(job.job_id, time.perf_counter(), now + self.timeout, len(job.keys))
        urls = list(self._urls)
        items = []
        with self._lock:
            for key, slot in zip(job.keys, job.slots, strict=True):
                cands: list[str] = []
                if load:
                    hit = self._present.get(key)
                    if hit is not None and hit[0] in urls:
                        cands.append(hit[0])
                    cands += [u for u in urls if u not in cands]
                items.append(Item(key, slot, state, cands))
        return items

    def _accept(self, job: Job) -> bool:
        accept_job(job, self.ctx.arena, closed=self._closed)
        if not job.keys:
            self._finished.append(JobResult(job.job_id))
            return False
        self._pending += 1
        return True

    @hookimpl
    def submit_store(self, job: Job) -> None:
        if not self._accept(job):
            return
        items = self._items(job, load=False)
        by_peer: dict[str | None, list] = {}
        for it in items:
            by_peer.setdefault(self._store_peer(it.key), []).append(it)
        client = self._client
        client.call(lambda: [client.store(group, url) for url, group in by_peer.items()])

    @hookimpl
    def submit_load(self, job: Job) -> None:
        if not self._accept(job):
            return
        items = self._items(job, load=True)
        self._client.call(lambda: self._client.load(items))

    @hookimpl
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Pin ``keys`` on the peers that hold them (the one a lookup or store last saw, else
        the key's store peer) for ``seconds`` (None: until unpinned), for this instance: the
        server never evicts them before then, and refuses the pin whole (with the reason) for
        keys it does not hold or past half of the namespace's cap. Waits for the answers, at
        most ``timeout`` seconds. A pin refused by one peer is taken back from the others
        (the keys newly pinned there; a pin renewed there keeps its later end)."""
        keys = list(dict.fromkeys(check_keys(keys)))
        if self._closed:
            return "p2p tier: closed"
        groups: dict[str, list[bytes]] = {}
        with self._lock:
            for k in keys:
                seen = self._present.get(k)
                url = seen[0] if seen is not None and seen[0] in self._urls else self._store_peer(k)
                if url is None:
                    return "p2p tier: no peer to pin on"
                groups.setdefault(url, []).append(k)
        parts = [(url, ks[i : i + P.MAX_BATCH]) for url, ks in groups.items() for i in range(0, len(ks), P.MAX_BATCH)]
        answers: list[Any] = [None] * len(parts)
        left = [len(parts)]
        done = threading.Event()

        def answer(i: int, body: Any) -> None:  # on the I/O thread
            answers[i] = body
            left[0] -= 1
            if left[0] == 0:
                done.set()

        client, deadline = self._client, time.monotonic() + self.timeout
        client.call(lambda: [client.pin(url, ks, seconds, deadline, lambda b, i=i: answer(i, b))
                             for i, (url, ks) in enumerate(parts)])
        if not done.wait(self.timeout + 5.0):
            why = f"p2p tier: the peers did not answer the pin within {self.timeout:g} s"
        else:
            whys = [a if isinstance(a, str) else a["why"] for a in answers if not isinstance(a, dict) or "why" in a]
            why = "; ".join(dict.fromkeys(whys)) or None
        if why is not None:
            new = [k for a in answers if isinstance(a, dict) for k in a.get("new", ()) if type(k) is bytes]
            if new:
                client.call(lambda: client.unpin(new, deadline))
        else:
            self._pinned = True
        return why

    @hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        keys = list(dict.fromkeys(check_keys(keys)))
        if keys and not self._closed:
            deadline = time.monotonic() + self.timeout
            self._client.call(lambda: [self._client.unpin(keys[i : i + P.MAX_BATCH], deadline)
                                       for i in range(0, len(keys), P.MAX_BATCH)])

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        self._path_gauge.report()
        return drain(self._finished)

    @hookimpl
    def backlog(self) -> int:
        return max(0, self._pending)

    @hookimpl
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pinned:  # pins end with the instance (rule 13): every one of ours, answered or timed out
            ended = threading.Event()
            deadline = time.monotonic() + self.timeout
            self._client.call(lambda: self._client.unpin(None, deadline, ended.set))
            ended.wait(self.timeout + 1.0)
        self._client.close()
