"""Fault injection into the batch coroutines ``put_many``/``get_many_into`` of an
:class:`kvtiers.AsyncTier` that defines them, as :mod:`.async_faults` does for the per-key
ones: batch calls that raise, answer failed keys, crawl, hang, and hang while ``close``
cancels them. Exactly the keys of the faulty calls fail, within the bound, and every slot
of every reported job is poisoned on its report and must stay so (rule 6). The wrappers
are set on the instance; the healthy calls go to the tier's own batch coroutines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from ..harness import CheckSkipped, Harness, Instance, fail, qkey
from ..rules import check
from ..slotwatch import SlotWatch
from .async_faults import async_instance, chunk_keys, expect_failed
from .late_writes import defines

Items = Sequence[tuple[bytes, memoryview]]


def _batch_instance(h: Harness) -> tuple[Instance, list[str]]:
    t = async_instance(h)
    names = [n for n in ("put_many", "get_many_into") if defines(t.tier, n)]
    if not names:
        t.close()
        raise CheckSkipped("the tier has no put_many/get_many_into")
    return t, names


def _wrap(real: Callable, bad: set[bytes], mode: str, hit: set[bytes]) -> Callable:
    """A batch coroutine that fails the calls holding a key of ``bad``: ``raise`` (the
    whole call), ``reasons``/``false`` (only those keys, the rest to ``real``), ``hang``
    (the whole call), ``slow`` (every call crawls, then ``real``). ``hit`` collects the
    keys of faulty calls that must fail."""

    async def batch(items: Items):
        ours = [k for k, _ in items if k in bad]
        if mode == "slow":
            await asyncio.sleep(0.05)
            return await real(items)
        if not ours:
            return await real(items)
        if mode in ("raise", "hang"):
            hit.update(k for k, _ in items)
            if mode == "hang":
                await asyncio.sleep(3600)
            raise OSError(f"injected batch failure for {qkey(ours[0])}")
        hit.update(ours)
        rest = [(k, v) for k, v in items if k not in bad]
        out = dict(await real(rest) or {}) if rest else {}
        for k in ours:
            out[k] = False if mode == "false" else OSError(f"injected failure for {qkey(k)}")
        return out

    return batch


@check(4, "async_batch_failures")
def async_batch_failures(h: Harness) -> None:
    """put_many/get_many_into raising or answering failed keys: exactly the keys of the
    faulty calls fail, with a reason, and no slot is written after its job was reported."""
    t, names = _batch_instance(h)
    tier = t.tier
    watch = SlotWatch(t)
    keys = h.keys(12, b"M")
    bad = set(keys[::4])
    if "put_many" in names:
        for mode in ("raise", "reasons"):
            hit: set[bytes] = set()
            tier.put_many = _wrap(type(tier).put_many.__get__(tier), bad, mode, hit)
            expect_failed(t, watch.submit("store", keys, note=f"put_many {mode}"), lambda hit=hit: hit,
                          f"put_many in mode {mode}",
                          h.limits.finish_s)
            del tier.put_many
    t.store(keys)  # every key stored (again), through the tier's own path
    if "get_many_into" in names:
        for mode in ("raise", "reasons", "false"):
            hit = set()
            tier.get_many_into = _wrap(type(tier).get_many_into.__get__(tier), bad, mode, hit)
            expect_failed(t, watch.submit("load", keys, note=f"get_many_into {mode}"), lambda hit=hit: hit,
                          f"get_many_into in mode {mode}",
                          h.limits.finish_s)
            del tier.get_many_into
    watch.watch(h.limits.ownership_wait_s)
    watch.release()
    t.load_all(keys)  # healthy again


@check(5, "async_batch_hangs")
def async_batch_hangs(h: Harness) -> None:
    """put_many/get_many_into crawling or hanging: the keys of hung calls fail within
    op_timeout, crawling ones succeed; close with a hung batch in flight returns and reports
    it; no slot is written after its job was reported."""
    lim = h.limits
    t, names = _batch_instance(h)
    tier = t.tier
    watch = SlotWatch(t)
    keys = h.keys(12, b"N")
    hang = set(keys[1::4])
    bound = lim.async_op_timeout + lim.finish_s
    t.store(keys)
    fresh = h.keys(12, b"n")
    hang |= set(fresh[1::4])
    for mode in ("slow", "hang"):  # the store and the load jobs at once: one op_timeout for both
        jobs = []
        for name, kind, ks in (("put_many", "store", fresh), ("get_many_into", "load", keys)):
            if name in names:
                hit: set[bytes] = set()
                setattr(tier, name, _wrap(getattr(type(tier), name).__get__(tier), hang, mode, hit))
                jobs.append((watch.submit(kind, ks, note=f"{name} {mode}ing"), hit, f"{name} {mode}ing"))
        for jid, hit, what in jobs:
            expect_failed(t, jid, lambda hit=hit: hit, what, bound)
        for name in names:
            delattr(tier, name)
    watch.watch(lim.ownership_wait_s)
    watch.release()
    t.load_all(keys)
    t.store(fresh)  # the healthy path still stores them

    # close while a batch hangs: close must cancel it and still hand over the result
    t2, _ = _batch_instance(h)
    t2.tier.op_timeout = 3600.0
    t2.tier.close_timeout = lim.async_op_timeout
    watch = SlotWatch(t2)
    hit = set()
    name, kind = ("put_many", "store") if "put_many" in names else ("get_many_into", "load")
    if kind == "load":
        t2.store(keys)
    setattr(t2.tier, name, _wrap(getattr(type(t2.tier), name).__get__(t2.tier), hang, "hang", hit))
    jid = watch.submit(kind, keys, note=f"{name} hanging, cancelled by close")
    t0 = time.monotonic()
    results = {r.job_id: r for r in t2.close()}  # the harness fails if jid is not among them
    took = time.monotonic() - t0
    if took > bound:
        fail(f"rule 9: close with a hung {name} took {took:.1f} s")
    missed = [k for k in chunk_keys(t2, hit) if k not in results[jid].failed_keys]
    if missed:
        fail(f"rule 9: close reported the key {qkey(missed[0])} of a hung, cancelled {name} as done")
    watch.watch(lim.ownership_wait_s)
