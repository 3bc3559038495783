"""No p2p client can exhaust a server's namespaces or chunk sizes (docs/p2p.md, Limits),
each checked with a real ``kvtiers p2p serve`` process: an attacker storing a 4 KiB chunk in
each of 64 namespaces, or in namespaces of 8 distinct chunk sizes, leaves a well-behaved
client able to store in a new namespace; one connection saying HELLO for namespace after
namespace, and sessions held from two addresses (the server's tables and sessions full).
A namespace another peer has a session in is never reclaimed: not by the peer it is charged
to at its cap, nor for a newcomer to a full table; its user keeps its session and chunks. The
one reclaimed is the least recently used (a peer at its cap), and one without a session
before one with (a full table)."""

from __future__ import annotations

import os

import pytest

zmq = pytest.importorskip("zmq")

from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.store import SLAB_BYTES, SLAB_SHARE, MemoryStore  # noqa: E402
from test_p2p_attacks import BOUND_S, GOOD_NS, Good, tier  # noqa: E402
from test_p2p_lockout import dealer, hello, served  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Job, Lookup, Namespace  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
OTHER_NS = Namespace({"test": "p2p-namespaces-other-size"})
SIZES_CAPACITY = 9 * SLAB_BYTES  #: a slab for each of 8 chunk sizes and the good client's


def attack(ctx, port: int, src: str, specs: list[tuple[str, int]], *, hold: bool) -> tuple[list[list], list]:
    """From ``src``, a HELLO for each ``(namespace, chunk size)`` of ``specs`` and a PUT of
    one chunk in it: all on one connection (each HELLO ends the session before it), or
    ``hold``, each on a connection of its own kept open. The HELLO answers and the sockets."""
    answers, socks, s = [], [], None
    for ns, size in specs:
        if s is None or hold:
            s = dealer(ctx, port, src)
            socks.append(s)
        answers.append(hello(s, ns=ns, chunk=size))
        if answers[-1][0] == P.OK:
            data = os.urandom(size)
            s.send_multipart([P.pack(P.PUT, 2, b"k", P.checksum(data)), data])
            assert s.poll(10000), "no answer to PUT"
            reply = P.unpack(s.recv(), reply=True)
            assert reply[0] == P.OK, reply
    return answers, socks


def names(src: str, n: int) -> list[str]:
    return [f"{int(src.rsplit('.', 1)[1]):02x}{i:014x}" for i in range(n)]


@pytest.mark.parametrize("hold", [False, True], ids=["one-connection", "sessions-held"])
def test_one_client_cannot_exhaust_the_namespaces(tmp_path, hold):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(log=log) as (srv, ctx, good):
        sources = ["127.0.0.2", "127.0.0.3"] if hold else ["127.0.0.2"]
        for src in sources:  # 64 namespaces with a chunk each, 256 KiB in all
            answers, _socks = attack(ctx, srv.port, src, [(n, 4 * KiB) for n in names(src, 64 // len(sources))],
                                     hold=hold)
            assert all(a[0] == P.OK for a in answers), [a for a in answers if a[0] != P.OK][:1]
        good.append(Good(srv.port))  # a new namespace from another address is served
        for _ in range(2):
            assert good[0].round() < BOUND_S
    assert server_stats(log)["reclaimed"] >= 1


@pytest.mark.parametrize("hold", [False, True], ids=["one-connection", "sessions-held"])
def test_one_client_cannot_exhaust_the_chunk_sizes(tmp_path, hold):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    # room for a 64 MiB slab of each size: a smaller capacity evicts a size's only chunk to map the next
    with served(log=log, capacity=SIZES_CAPACITY) as (srv, ctx, good):
        sources = ["127.0.0.2", "127.0.0.3"] if hold else ["127.0.0.2"]
        for k, src in enumerate(sources):  # 8 distinct chunk sizes of 4-32 KiB, the good client's is 64 KiB
            sizes = [4 * KiB * (i + 1) for i in range(8)]
            if hold:  # 4 sizes each, the second address's distinct from the first's: the server's 8
                sizes = sizes[4 * k : 4 * k + 4] + sizes[4 * (1 - k) : 4 * (1 - k) + 1]
            answers, _socks = attack(ctx, srv.port, src, list(zip(names(src, len(sizes)), sizes, strict=True)),
                                     hold=hold)
            if hold:  # its fifth size: its four namespaces have sessions, none can go
                assert all(a[0] == P.OK for a in answers[:4]), answers
                assert answers[4][0] == P.ERR and "maximum of 4 chunk sizes from " + src in answers[4][3], answers[4]
            else:  # one connection: each new size past 4 reclaims its own least recently used one
                assert all(a[0] == P.OK for a in answers), [a for a in answers if a[0] != P.OK][:1]
        good.append(Good(srv.port))
        for _ in range(2):
            assert good[0].round() < BOUND_S
    assert server_stats(log)["reclaimed"] >= 1


# -- a namespace another peer is using is never reclaimed ----------------------------------


def made_by(src: str, ctx, port: int) -> None:
    """GOOD_NS made (so charged to ``src``) with a chunk in it, so the server keeps it after
    ``src`` leaves (a namespace with no chunk and no session is forgotten)."""
    answers, socks = attack(ctx, port, src, [(GOOD_NS.digest, 64 * KiB)], hold=True)
    assert answers[0][0] == P.OK, answers[0]
    bye(socks[0])


def bye(s) -> None:
    """End ``s``'s session, and wait until the server has (a request after it is refused)."""
    s.send(P.pack(P.BYE, 3))
    s.send(P.pack(P.LOOKUP, 4, [b"k"]))
    assert s.poll(10000), "no answer to LOOKUP"
    reply = P.unpack(s.recv(), reply=True)
    assert reply[0] == P.ERR and reply[2] == P.E_HELLO, reply


class User:
    """A real p2p tier (from 127.0.0.1) in a namespace another peer is charged with: it
    stores one chunk, and later checks the chunk loads back with the same bytes."""

    def __init__(self, port: int) -> None:
        self.good = Good(port)

    def store(self) -> None:
        h = self.good.h
        h.submit_store(Job(1, (b"kept",), (0,)))
        assert wait(h, 1).ok
        assert resolve(h, [b"kept"]) == [Lookup.HIT]

    def still_holds(self) -> None:
        """The chunk stored before loads back whole, on the same session."""
        h, arena = self.good.h, self.good.arena
        arena[1][:] = bytes(arena.slot_bytes)
        h.submit_load(Job(2, (b"kept",), (1,)))
        r = wait(h, 2)
        assert r.ok and bytes(arena[1]) == bytes(arena[0]), f"the in-use namespace lost its chunk: {r.error}"


def test_a_peer_at_its_cap_never_reclaims_a_namespace_another_peer_uses(tmp_path):
    """127.0.0.2 made GOOD_NS (charged to it) and a real tier from 127.0.0.1 uses it; at its
    cap of 2, 127.0.0.2's HELLO for a third namespace finds GOOD_NS in use by the tier and
    its other one by its own session, so none may go: it is refused (``full``), and the tier
    keeps its session and its chunk."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(["--max-namespaces-per-peer", "2"], log=log) as (srv, ctx, good):
        made_by("127.0.0.2", ctx, srv.port)
        user = User(srv.port)  # ... and 127.0.0.1 uses it
        good.append(user.good)
        user.store()
        answers, _socks = attack(ctx, srv.port, "127.0.0.2", [(n, 64 * KiB) for n in names("127.0.0.2", 2)],
                                 hold=True)  # its second namespace (session held), then a third
        assert answers[0][0] == P.OK, answers[0]
        assert answers[1][0] == P.ERR and "maximum of 2 namespaces from 127.0.0.2" in answers[1][3], answers[1]
        user.still_holds()
    stats = server_stats(log)
    assert (stats["reclaimed"], stats["reaped"]) == (0, 0), stats


def test_a_full_table_never_reclaims_a_namespace_another_peer_uses_for_a_newcomer(tmp_path):
    """127.0.0.2 holds the whole table (64 namespaces, each with a session: its own, or, for
    GOOD_NS, the least recently used, a real tier's from 127.0.0.1). A newcomer from
    127.0.0.3 gets one of 127.0.0.2's own namespaces, never GOOD_NS: the tier keeps its
    session and its chunk."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    extra = ["--max-namespaces-per-peer", "64", "--max-sessions-per-peer", "64", "--max-clients", "80"]
    with served(extra, log=log) as (srv, ctx, good):
        made_by("127.0.0.2", ctx, srv.port)
        user = User(srv.port)
        good.append(user.good)
        user.store()
        answers, _socks = attack(ctx, srv.port, "127.0.0.2", [(n, 64 * KiB) for n in names("127.0.0.2", 63)],
                                 hold=True)
        assert all(a[0] == P.OK for a in answers), [a for a in answers if a[0] != P.OK][:1]
        answers, _new = attack(ctx, srv.port, "127.0.0.3", [(n, 64 * KiB) for n in names("127.0.0.3", 1)],
                               hold=True)
        assert answers[0][0] == P.OK, answers[0]  # served: one of 127.0.0.2's namespaces was reclaimed
        user.still_holds()
    stats = server_stats(log)
    assert (stats["reclaimed"], stats["reaped"]) == (1, 1), stats  # 127.0.0.2's session in the one reclaimed


# -- which namespace is reclaimed ----------------------------------------------------------


def lookup(s, rid: int, key: bytes = b"k") -> bytes:
    """LOOKUP ``key`` on ``s`` (a session): its one 0/1 byte."""
    s.send(P.pack(P.LOOKUP, rid, [key]))
    assert s.poll(10000), "no answer to LOOKUP"
    reply = P.unpack(s.recv(), reply=True)
    assert reply[0] == P.OK, reply
    return reply[2]


def test_a_peer_at_its_cap_reclaims_its_least_recently_used_namespace(tmp_path):
    """At its cap of 2, a peer's HELLO for a third namespace reclaims the one of its two it
    used least recently (a request counts as use, not only the HELLO that made it)."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(["--max-namespaces-per-peer", "2"], log=log) as (srv, ctx, _good):
        a, b, c = names("127.0.0.2", 3)
        _answers, (s,) = attack(ctx, srv.port, "127.0.0.2", [(a, 64 * KiB), (b, 64 * KiB)], hold=False)
        assert hello(s, ns=a)[0] == P.OK and lookup(s, 2) == b"\x01"  # a used after b: b is the older
        assert hello(s, ns=c)[0] == P.OK  # at its cap: one of a and b goes
        probe = dealer(ctx, srv.port, "127.0.0.3")
        assert hello(probe, ns=a)[0] == P.OK and lookup(probe, 2) == b"\x01", "the recently used one was reclaimed"
        assert hello(probe, ns=b)[0] == P.OK and lookup(probe, 3) == b"\x00"
    assert server_stats(log)["reclaimed"] == 1


def test_a_full_table_reclaims_a_namespace_without_a_session_first(tmp_path):
    """127.0.0.2 holds the whole table: 63 namespaces with a session each, and the one it
    used last without one. A newcomer gets that one: no session is reaped for it."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    extra = ["--max-namespaces-per-peer", "64", "--max-sessions-per-peer", "64", "--max-clients", "80"]
    with served(extra, log=log) as (srv, ctx, _good):
        ns = names("127.0.0.2", 64)
        answers, _socks = attack(ctx, srv.port, "127.0.0.2", [(n, 64 * KiB) for n in ns[:63]], hold=True)
        assert all(a[0] == P.OK for a in answers), [a for a in answers if a[0] != P.OK][:1]
        answers, last = attack(ctx, srv.port, "127.0.0.2", [(ns[63], 64 * KiB)], hold=True)
        assert answers[0][0] == P.OK, answers[0]
        bye(last[0])  # the most recently used, and the only one without a session
        answers, _new = attack(ctx, srv.port, "127.0.0.3", [(n, 64 * KiB) for n in names("127.0.0.3", 1)],
                               hold=True)
        assert answers[0][0] == P.OK, answers[0]
    stats = server_stats(log)
    assert (stats["reclaimed"], stats["reaped"]) == (1, 0), stats


def test_a_full_size_table_never_reclaims_a_size_another_peer_uses_for_a_newcomer(tmp_path):
    """127.0.0.2 holds all 8 chunk sizes: GOOD_NS's 64 KiB (its least recently used, which
    a real tier from 127.0.0.1 uses) and 7 more, each namespace with a session of its own.
    A newcomer with a ninth size from 127.0.0.3 gets one of the sizes only 127.0.0.2 uses,
    never 64 KiB: the tier keeps its session and its chunk."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(["--max-chunk-sizes-per-peer", "8"], log=log, capacity=SIZES_CAPACITY) as (srv, ctx, good):
        made_by("127.0.0.2", ctx, srv.port)
        user = User(srv.port)
        good.append(user.good)
        user.store()
        sizes = [4 * KiB * (i + 1) for i in range(7)]
        answers, _socks = attack(ctx, srv.port, "127.0.0.2", list(zip(names("127.0.0.2", 7), sizes, strict=True)),
                                 hold=True)
        assert all(a[0] == P.OK for a in answers), [a for a in answers if a[0] != P.OK][:1]
        answers, _new = attack(ctx, srv.port, "127.0.0.3", [(names("127.0.0.3", 1)[0], 32 * KiB)], hold=True)
        assert answers[0][0] == P.OK, answers[0]  # served: a size of 127.0.0.2's own was reclaimed
        user.still_holds()
    stats = server_stats(log)
    assert (stats["reclaimed"], stats["reaped"]) == (1, 1), stats


def test_one_client_keeps_two_chunk_sizes_at_once(tmp_path):
    """One client (127.0.0.1) with two real tiers open at once on a 16 MiB server: 64 KiB
    chunks in one namespace, 4 KiB in another (a ModelWeights and its head record, say).
    Storing the second size, and then more of each, leaves every chunk of both loadable,
    byte for byte, and the server evicts nothing: far below the capacity, the first size's
    pool must not have mapped it all (then the second size evicted every chunk of the first)."""
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(log=log) as (srv, ctx, good):
        big, small = Good(srv.port, 64 * KiB), Good(srv.port, 4 * KiB)
        good += [big, small]
        small.h.close()  # the second one in a namespace of its own (one namespace has one chunk size)
        small.h = tier(srv.port, small.arena, OTHER_NS)
        jobs = iter(range(1, 1000))

        def store(g: Good, keys: list[bytes]) -> None:
            for k in keys:
                jid = next(jobs)
                g.h.submit_store(Job(jid, (k,), (0,)))
                assert wait(g.h, jid).ok

        def loadable(g: Good, keys: list[bytes]) -> None:
            assert resolve(g.h, keys) == [Lookup.HIT] * len(keys), "a chunk of one size was dropped"
            for k in keys:
                jid = next(jobs)
                g.arena[1][:] = bytes(g.arena.slot_bytes)
                g.h.submit_load(Job(jid, (k,), (1,)))
                r = wait(g.h, jid)
                assert r.ok and bytes(g.arena[1]) == bytes(g.arena[0]), r.error

        store(big, [b"big-%d" % i for i in range(4)])
        store(small, [b"small-0"])  # the second size: a pool of its own
        loadable(big, [b"big-%d" % i for i in range(4)])
        store(big, [b"big-4"])
        store(small, [b"small-1"])
        loadable(big, [b"big-%d" % i for i in range(5)])
        loadable(small, [b"small-0", b"small-1"])
    assert server_stats(log)["evictions"] == 0


def test_a_store_maps_a_share_of_its_capacity_per_slab_and_a_second_size_evicts_nothing():
    """The store alone, without NIXL: the first chunk size maps a slab of 1/SLAB_SHARE of the
    capacity, not all of it, so a second size maps its own beside it and nothing is evicted
    (before: the first slab took all 16 MiB, and the second size evicted every chunk of the
    first to free it)."""
    store = MemoryStore(16 * MiB)
    for i in range(8):
        buf, evicted = store.reserve("big", 64 * KiB, None)
        store.commit("big", b"big-%d" % i, buf, 0)
    assert store.mapped == 16 * MiB // SLAB_SHARE
    buf, evicted = store.reserve("small", 4 * KiB, None)
    store.commit("small", b"small-0", buf, 0)
    assert evicted == [] and store.evictions == 0
    assert all(store.has("big", b"big-%d" % i) for i in range(8))
    assert store.chunk_sizes() == {64 * KiB, 4 * KiB} and store.mapped <= store.capacity


def test_a_large_chunk_size_after_small_ones_unmaps_their_idle_slabs():
    """Small chunks fill the capacity in small slabs; a chunk size larger than any of them
    then evicts least recently used small chunks until slabs are idle, unmaps those and maps
    its own (kvtiers bench p2p's order: 4 KiB rounds, then 8 MiB). With NIXL (slabs stay
    registered) the store only carves an idle slab large enough, as before."""
    store = MemoryStore(16 * MiB)
    small = [b"s-%d" % i for i in range(16 * MiB // (64 * KiB))]
    for k in small:
        buf, _ = store.reserve("a", 64 * KiB, None)
        store.commit("a", k, buf, 0)
    assert store.mapped == 16 * MiB
    got = store.reserve("b", 8 * MiB, None)
    assert got is not None, "an 8 MiB chunk found no room in a store of 16 MiB"
    buf, _ = got
    buf[:] = b"x" * len(buf)
    store.commit("b", b"large", buf, 0)
    assert store.has("b", b"large") and store.mapped <= store.capacity
    kept = [k for k in small if store.has("a", k)]
    assert 0 < len(kept) < len(small) and kept == small[-len(kept):]  # the oldest went, the newest stayed
    nixl = MemoryStore(16 * MiB)
    nixl.on_slab = lambda view: None  # as a NIXL server registers each slab
    buf, _ = nixl.reserve("a", 64 * KiB, None)
    assert nixl.mapped == 16 * MiB  # one slab of up to SLAB_BYTES, carved anew for another size
