"""Fault injection for tests: damage a chunk held by peer servers started with
``--test-faults`` (what :meth:`P2PTier.conformance_corrupt` does for the conformance
suite's rule 4).

The chunk lives in a server process's memory and the server checks every PUT's xxh3, so the
damage is done by the server itself: a ``CORRUPT`` request flips bytes of the stored chunk
and keeps its xxh3, and the next GET sends bytes whose hash the client rejects. A server
without ``--test-faults`` refuses the request (``no-test-faults``) and keeps serving.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from . import protocol as P
from .peers import config_peers, load_curve

_rids = itertools.count(1)


class FaultRefused(RuntimeError):
    """A peer refused or did not answer a fault-injection request."""


class CorruptRefused(FaultRefused, NotImplementedError):
    """A peer that takes no fault injection (a server started without ``--test-faults``)
    refused CORRUPT: a ``NotImplementedError`` too, which the conformance suite reports as
    a named skip of its corruption check (not certified), not as a broken tier."""


def corrupt_on_peer(url: str, namespace_digest: str, key: bytes, *, curve: Any = None,
                    timeout: float = 10.0) -> list[int]:
    """Ask the server at ``url`` to damage its copy of ``key`` in the namespace
    ``namespace_digest``; return the byte offsets it flipped (``[]``: it holds no such key).
    ``curve``: ``(server public key, client public key, client secret key)``. Raises
    :class:`FaultRefused` when the server refuses or does not answer within ``timeout``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
        sock.connect(url)
        rid = next(_rids)
        sock.send(P.pack(P.CORRUPT, rid, namespace_digest, key))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise FaultRefused(f"peer {url} did not answer CORRUPT within {timeout:g} s")
            frames = sock.recv_multipart()
            hdr = P.unpack(frames[0], reply=True)
            if hdr[1] != rid:
                continue  # not ours (cannot happen on a fresh socket; ignore anyway)
            if hdr[0] == P.ERR and len(hdr) == 4:
                raise CorruptRefused(f"peer {url} refused CORRUPT ({hdr[2]}): {hdr[3]}")
            if hdr[0] != P.OK or len(hdr) != 3 or not isinstance(hdr[2], list):
                raise FaultRefused(f"peer {url} answered CORRUPT with {hdr!r}")
            return hdr[2]
    finally:
        sock.close(0)


def corrupt(config: dict, namespace_digest: str, key: bytes) -> dict[str, list[int]]:
    """Damage ``key`` on every peer of ``config`` that holds it; return ``{peer: offsets}``
    of those that did. Raises :class:`FaultRefused` if a peer refuses or none holds it."""
    curve = load_curve(config.get("curve_server_key"), config.get("curve_secret_file"))
    timeout = float(config.get("timeout", 10.0))
    urls = config_peers(config)
    if not urls:
        raise FaultRefused("the p2p options name no peer")
    done = {}
    for url in urls:
        offsets = corrupt_on_peer(url, namespace_digest, key, curve=curve, timeout=timeout)
        if offsets:
            done[url] = offsets
    if not done:
        raise FaultRefused(f"no peer of {', '.join(urls)} holds key {key.hex()} in namespace {namespace_digest}")
    return done
