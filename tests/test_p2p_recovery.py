"""A p2p client refused by a full server, or whose session the server reaped, is served
again once the server has room (docs/p2p.md, Limits), each checked with a real ``kvtiers p2p
serve`` process and a real p2p tier.

The server runs with a long ``--handshake-timeout`` (30 s), so it keeps a refused client's
connection open far longer than the bound below: the client must say HELLO again on that
connection, not wait for the server to close it.

"About a second after the server has room" is checked where it is decided, not by a
stopwatch (a loaded 2-core machine): the delays the client itself computes and logs before
each HELLO it says again (0.1 s, doubling, at most 1 s), and that no HELLO goes out before
its delay (the refusals are at least that far apart). Being served once there is room is
bounded generously (``SERVED_S``)."""

from __future__ import annotations

import logging
import re
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvtiers_p2p import protocol as P  # noqa: E402
from test_p2p_attacks import GOOD_NS, fill, tier  # noqa: E402
from test_p2p_lockout import dealer, hello, served  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Lookup  # noqa: E402

KiB = 1 << 10
SERVED_S = 10.0  #: how soon after room is made the refused client must be served again (generous)
BACKOFF_S = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]  #: docs/p2p.md: 0.1 s, doubling, at most once a second
RETRY = re.compile(r"refused the handshake: HELLO again in ([0-9.]+) s")


def retries(caplog) -> list[tuple[float, float]]:
    """The refused HELLOs the client logged, in order: (when, the delay it then waits)."""
    return [(r.created, float(m.group(1))) for r in caplog.records
            if r.name == "kvtiers.p2p" and (m := RETRY.search(r.getMessage()))]


class Client:
    """A real p2p tier with short timeouts, so a refused round fails fast."""

    def __init__(self, port: int) -> None:
        self.arena = Arena.allocate(2, 64 * KiB)
        fill(self.arena, 11)
        self.h = tier(port, self.arena, GOOD_NS, timeout=3.0, negative_ttl=0.05)
        self.n = 0

    def round(self) -> bool:
        """Store a new key, look it up and load it back; True when all of it worked."""
        self.n += 1
        key, jid = b"rec-%d" % self.n, 10 * self.n
        self.h.submit_store(Job(jid, (key,), (0,)))
        if not wait(self.h, jid).ok:
            return False
        if resolve(self.h, [key]) != [Lookup.HIT]:
            return False
        self.arena[1][:] = bytes(self.arena.slot_bytes)
        self.h.submit_load(Job(jid + 1, (key,), (1,)))
        return wait(self.h, jid + 1).ok and bytes(self.arena[1]) == bytes(self.arena[0])

    def refusal(self) -> str | None:
        status = list(self.h.tier.peer_status().values())  # empty until the I/O thread added the peer
        return status[0]["error"] if status else None

    def wait_refused(self, text: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in (self.refusal() or ""):
            assert time.monotonic() < deadline, f"not refused with {text!r}: {self.refusal()!r}"
            time.sleep(0.05)
        assert not self.round(), "a refused client's round succeeded"

    def served_within(self, bound: float) -> float:
        """Seconds until a whole round succeeds; fails past ``bound``."""
        t0 = time.monotonic()
        while not self.round():
            assert time.monotonic() - t0 < bound, f"still not served {bound:g} s after room was made: {self.refusal()}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        self.h.close()


def test_a_client_refused_by_a_full_server_is_served_once_it_has_room(caplog):
    caplog.set_level(logging.DEBUG, logger="kvtiers.p2p")
    with served(["--max-clients", "2", "--max-sessions-per-peer", "4", "--handshake-timeout", "30"]) as (srv, ctx, _):
        held = [dealer(ctx, srv.port, "127.0.0.1") for _ in range(2)]
        assert all(hello(s)[0] == P.OK for s in held)  # the server is full
        c = Client(srv.port)
        try:
            c.wait_refused("maximum of 2 clients")
            deadline = time.monotonic() + 30.0  # the schedule takes 3.5 s; generous for a loaded machine
            while len(retries(caplog)) < len(BACKOFF_S):
                assert time.monotonic() < deadline, f"HELLO said again only {len(retries(caplog))} times"
                time.sleep(0.1)
            assert not c.round()
            seen = retries(caplog)
            assert [d for _, d in seen[: len(BACKOFF_S)]] == pytest.approx(BACKOFF_S)  # 0.1 s, doubling, capped
            assert all(d == pytest.approx(1.0) for _, d in seen[len(BACKOFF_S) :])
            for (t0, d), (t1, _) in zip(seen, seen[1:], strict=False):  # no HELLO before its delay
                assert t1 - t0 >= d - 0.01, (t1 - t0, d)
            held[1].send(P.pack(P.BYE, 2))  # room for one
            c.served_within(SERVED_S)
            assert c.round() and c.refusal() is None
            # the OK started its waits over: reaped and refused again, it waits 0.1 s first
            before = len(retries(caplog))
            held[0].send(P.pack(P.LOOKUP, 3, [b"x"]))  # more recently active than c ...
            assert held[0].poll(10000) and P.unpack(held[0].recv(), reply=True)[0] == P.OK
            other = dealer(ctx, srv.port, "127.0.0.2")
            assert hello(other)[0] == P.OK  # ... so c's session is the one reaped
            c.wait_refused("maximum of 2 clients")
            deadline = time.monotonic() + 10.0
            while len(retries(caplog)) == before:  # logged just after the refusal is noted
                assert time.monotonic() < deadline, "the refusal logged no wait"
                time.sleep(0.05)
            assert retries(caplog)[before][1] == pytest.approx(BACKOFF_S[0])
        finally:
            c.close()


def test_a_client_whose_session_was_reaped_is_served_once_the_server_has_room(tmp_path):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    extra = ["--max-clients", "3", "--max-sessions-per-peer", "3", "--handshake-timeout", "30"]
    with served(extra, log) as (srv, ctx, _):
        c = Client(srv.port)
        try:
            assert c.round()
            held = [dealer(ctx, srv.port, "127.0.0.1") for _ in range(2)]  # more recently active than c
            assert all(hello(s)[0] == P.OK for s in held)  # full: 127.0.0.1 holds all 3 sessions
            other = dealer(ctx, srv.port, "127.0.0.2")
            assert hello(other)[0] == P.OK  # takes the place of 127.0.0.1's least recently active: c's
            c.wait_refused("maximum of 3 clients")  # c reconnected: 2 vs 1 session, refused
            held[1].send(P.pack(P.BYE, 2))
            c.served_within(SERVED_S)
        finally:
            c.close()
    assert server_stats(log)["reaped"] >= 1
