"""Fault injection for tiers built on :class:`kvtiers.AsyncTier`: the instance's ``put``,
``get_into`` and ``exists`` coroutines are wrapped to fail or hang (the one place the suite
uses mocks). Failed keys must come back as failed keys within the bound, never a hang and
never an exception out of a hook. ``op_timeout`` and ``close_timeout`` are lowered on the
instance to ``Limits.async_op_timeout`` so hung coroutines are cut short quickly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from kvtiers import Lookup

from ..harness import CheckSkipped, Harness, Instance, fail, qkey
from ..rules import check


def async_instance(h: Harness) -> Instance:
    t = h.open()
    if not t.is_async:
        t.close()
        raise CheckSkipped("not an AsyncTier")
    t.tier.op_timeout = min(t.tier.op_timeout, h.limits.async_op_timeout)
    return t


def chunk_keys(t: Instance, tier_keys: Iterable[bytes]) -> list[bytes]:
    """The caller's keys of keys the tier got: the same, but for a compressed tier
    (``"compress"``), whose chunk's further pieces go under keys of their own."""
    chunk_of = getattr(getattr(t.handle.hooks, "book", None), "chunk_of", None)  # (a sealed tier's book has none)
    return sorted({chunk_of(k) for k in tier_keys} if chunk_of is not None else set(tier_keys))


def expect_failed(t: Instance, jid: int, bad: Iterable[bytes] | Callable[[], Iterable[bytes]], what: str,
                   timeout: float) -> None:
    """Job ``jid`` must fail exactly the keys ``bad`` (or what ``bad()`` names once the job
    is reported), say why, and be reported within ``timeout``."""
    t0 = time.monotonic()
    r = t.wait([jid], timeout)[jid]
    took = time.monotonic() - t0
    bad = chunk_keys(t, bad() if callable(bad) else bad)
    missed = [k for k in bad if k not in r.failed_keys]
    if missed:
        fail(f"rule 4: with {what}, key {qkey(missed[0])} was reported good")
    extra = [k for k in r.failed_keys if k not in bad]
    if extra:
        fail(f"rule 4: with {what} for other keys, the healthy key {qkey(extra[0])} failed too: {r.error}")
    if r.failed_keys and not r.error:
        fail(f"rule 4: with {what}, the result has failed keys but no error saying why")
    if took > timeout:  # pragma: no cover - wait() fails first
        fail(f"rule 5: with {what}, the job took {took:.1f} s")


@check(4, "async_failing_coroutines")
def async_failing_coroutines(h: Harness) -> None:
    """put/get_into raising or get_into answering False: exactly those keys fail, no exception escapes."""
    t = async_instance(h)
    tier = t.tier
    keys = h.keys(8, b"F")
    bad = set(keys[::3])
    put, get_into = tier.put, tier.get_into

    async def failing_put(key, data):
        if key in bad:
            raise OSError(f"injected put failure for {key.hex()}")
        return await put(key, data)

    tier.put = failing_put
    expect_failed(t, t.submit("store", keys), sorted(bad), "put raising OSError", h.limits.finish_s)
    del tier.put
    t.store(sorted(bad))
    for mode in ("raise", "false"):
        async def failing_get(key, out, _mode=mode):
            if key in bad:
                if _mode == "raise":
                    raise ValueError(f"injected checksum mismatch for {key.hex()}")
                return False
            return await get_into(key, out)

        tier.get_into = failing_get
        what = "get_into raising" if mode == "raise" else "get_into answering False"
        expect_failed(t, t.submit("load", keys), sorted(bad), what, h.limits.finish_s)
    del tier.get_into

    async def failing_exists(key):
        raise ConnectionError("injected: backend unreachable")

    tier.exists = failing_exists
    unknown = h.keys(4, b"f")
    for _ in range(3):
        for k, a in zip(unknown, t.lookup(unknown), strict=True):
            if a is Lookup.HIT:
                fail(f"rule 4: with exists raising, never-stored key {qkey(k)} answers HIT")
        time.sleep(0.01)
    del tier.exists
    t.load_all(keys)  # healthy again


@check(5, "async_slow_coroutines")
def async_slow_coroutines(h: Harness) -> None:
    """put/get_into/exists that hang or crawl: failed keys within op_timeout, lookup never
    waits for them, and close with a hung coroutine in flight returns and reports the job."""
    lim = h.limits
    t = async_instance(h)
    tier = t.tier
    keys = h.keys(8, b"G")
    hang = set(keys[1::3])
    put, get_into = tier.put, tier.get_into
    bound = lim.async_op_timeout + lim.finish_s

    def slow(op):
        """``op`` (put or get_into) hanging for the keys of ``hang``, crawling for the others."""

        async def wrapped(key, buf):
            await asyncio.sleep(3600 if key in hang else 0.05)
            return await op(key, buf)
        return wrapped

    slow_put = slow(put)
    tier.put = slow_put
    expect_failed(t, t.submit("store", keys), sorted(hang), "put hanging", bound)
    del tier.put
    t.store(sorted(hang))

    tier.get_into = slow(get_into)
    expect_failed(t, t.submit("load", keys), sorted(hang), "get_into hanging", bound)
    del tier.get_into

    async def hung_exists(key):
        await asyncio.sleep(3600)

    tier.exists = hung_exists
    unknown = h.keys(1000, b"g")
    for _ in range(3):
        t0 = time.perf_counter()
        answers = t.lookup(unknown)
        took = time.perf_counter() - t0
        if took > max(0.5, 10 * lim.lookup_ms / 1000):
            fail(f"rule 1: with exists hanging, lookup of {len(unknown)} keys took {took:.2f} s")
        if Lookup.HIT in answers:
            fail("rule 1: with exists hanging, a never-stored key answers HIT")
    del tier.exists

    # close while a put hangs: close must cancel it and still hand over the result
    t2 = async_instance(h)
    t2.tier.op_timeout = 3600.0
    t2.tier.close_timeout = lim.async_op_timeout
    t2.tier.put = slow_put
    jid = t2.submit("store", keys)
    t0 = time.monotonic()
    results = {r.job_id: r for r in t2.close()}  # the harness fails if jid is not among them
    took = time.monotonic() - t0
    if took > lim.async_op_timeout + lim.finish_s:
        fail(f"rule 9: close with a hung put took {took:.1f} s")
    r = results[jid]
    if any(k not in r.failed_keys for k in hang):
        fail("rule 9: close reported a hung, cancelled put as stored")
