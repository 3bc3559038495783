"""Rules 2, 3 and 4 on one instance: stored keys hit, loads are exact, failures are results."""

from __future__ import annotations

import os
import pathlib

from kvtiers import Lookup
from kvtiers.compression import medium_namespace

from ..harness import CheckSkipped, Harness, Instance, NotCertified, fail, qkey
from ..rules import check


@check(2, "read_your_writes")
def read_your_writes(h: Harness) -> None:
    """Every key of a store reported good answers HIT (after RETRYs) and loads."""
    t = h.open()
    keys = h.keys(48, b"R")
    for i in range(0, len(keys), 3):  # many small jobs: intermittent drops show up
        t.store(keys[i:i + 3])
    answers = t.resolve(keys)
    bad = [(k, a) for k, a in zip(keys, answers, strict=True) if a is not Lookup.HIT]
    if bad:
        fail(f"rule 2: {len(bad)} of {len(keys)} stored keys answer {bad[0][1].name} (e.g. {qkey(bad[0][0])})")
    t.load_all(keys)
    if t.resolve(keys) != [Lookup.HIT] * len(keys):  # and still after loading
        fail("rule 2: stored keys stopped answering HIT after being loaded")


@check(3, "exact_bytes_one_key")
def exact_bytes_one_key(h: Harness) -> None:
    """A job of 1 key: the loaded slot holds exactly the stored bytes."""
    t = h.open()
    for _ in range(3):
        k = h.key(b"1")
        t.store([k])
        r = t.load([k])  # the harness compares every byte of every good key
        if not r.ok:
            fail(f"rule 2: load of stored key {qkey(k)} failed: {r.error}")


@check(3, "exact_bytes_512_keys")
def exact_bytes_512_keys(h: Harness) -> None:
    """A job of 512 keys stored and loaded back into other slots, every byte compared."""
    n = h.limits.big_job_keys
    t = h.open(num_slots=max(h.limits.num_slots, n + 1))
    keys = h.keys(n, b"B")
    t.store(keys)
    h.rng.shuffle(keys)  # load in another order, so key i lands in another slot
    r = t.load(keys)
    if not r.ok:
        fail(f"rule 2: {len(r.failed_keys)} of {n} stored keys failed to load: {r.error}")
    if r.nbytes not in (0, n * t.slot_bytes):
        fail(f"rule 3: a load of {n} full slots reports nbytes={r.nbytes}, expected {n * t.slot_bytes}")


@check(4, "missing_keys_fail")
def missing_keys_fail(h: Harness) -> None:
    """Loading never-stored keys reports them failed; good keys of the same job still load."""
    t = h.open()
    present = h.keys(6, b"P")
    t.store(present)
    absent = h.keys(6, b"A")
    t.expect_missing(absent, "rule 4")
    mixed = [k for pair in zip(present, absent, strict=True) for k in pair]
    jid = t.submit("load", mixed, absent=absent)
    r = t.wait([jid])[jid]
    wrong = [k for k in absent if k not in r.failed_keys]
    if wrong:
        fail(f"rule 4: absent key {qkey(wrong[0])} loaded 'successfully' in a mixed job")
    lost = [k for k in present if k in r.failed_keys]
    if lost:
        fail(f"rule 4: stored key {qkey(lost[0])} failed only because its job also held absent keys")
    if r.error is None:
        fail("rule 4: a job with failed keys must say why in JobResult.error")


def _new_files(roots: list[pathlib.Path], before: set[pathlib.Path]) -> list[pathlib.Path]:
    out = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = pathlib.Path(dirpath, n)
                if p not in before and n != "config.json":
                    out.append(p)
    return out


def _all_files(roots: list[pathlib.Path]) -> set[pathlib.Path]:
    return {pathlib.Path(d, n) for root in roots for d, _, names in os.walk(root) for n in names}


@check(4, "corrupt_chunks_fail")
def corrupt_chunks_fail(h: Harness) -> None:
    """Stored chunks damaged in place (by the tier's conformance_corrupt, else chunk files
    flipped and truncated on disk) load as failed keys, never as wrong bytes."""
    corrupt = getattr(h.info.cls, "conformance_corrupt", None)
    if corrupt is not None:
        _corrupt_with_hook(h, corrupt)
    else:
        _corrupt_files(h)


def _no_medium_or_not_certified(h: Harness, t: Instance, keys: list[bytes]) -> None:
    """A tier with no hook and no directory: if another instance on the same options sees
    none of ``keys``, while ``t`` is open or after it closed, its chunks live in the
    instance's own memory and there is no medium to damage (a plain skip); otherwise the
    chunks are kept somewhere the suite cannot reach without the hook (not certified)."""
    seen = h.open().resolve(keys)
    if Lookup.HIT not in seen:
        t.close()
        seen = h.open().resolve(keys)
    if Lookup.HIT not in seen:
        raise CheckSkipped("the tier keeps its chunks in its instance (another instance on the same options "
                           "sees none of them): no medium to damage")
    raise NotCertified(f"the tier has no conformance_corrupt and its options name no directory: {NO_HOOK}")


def _corrupt_with_hook(h: Harness, corrupt) -> None:
    """``conformance_corrupt(config, namespace, key)`` damages half the keys of a store
    while the instance is open; a load must fail exactly those (the intact ones load)."""
    t = h.open()
    keys = h.keys(8, b"C")
    t.store(keys)
    damaged = keys[::2]
    for k in damaged:
        try:
            corrupt(h.options(), medium_namespace(h.options(), h.namespace(t.slot_bytes), t.slot_bytes), k)
        except NotImplementedError as e:  # e.g. a production server that takes no fault injection
            raise NotCertified(f"conformance_corrupt was refused by the backend ({type(e).__name__}: {e}): "
                               "the corruption path was not tested") from None
        except Exception as e:
            fail(f"rule 4: conformance_corrupt(config, namespace, {qkey(k)}) of a stored key raised "
                 f"{type(e).__name__}: {e}")
    jid = t.submit("load", keys, absent=damaged, absent_what="corrupted")  # the harness fails a good one
    r = t.wait([jid])[jid]
    lost = [k for k in keys if k not in damaged and k in r.failed_keys]
    if lost:
        fail(f"rule 4: intact key {qkey(lost[0])} failed only because its job also held corrupted keys: {r.error}")
    if r.error is None:
        fail("rule 4: a job with failed keys must say why in JobResult.error")


NO_HOOK = ("its corruption path was never tested: define conformance_corrupt(config, namespace, key) "
           "to damage a stored chunk")


def _corrupt_files(h: Harness) -> None:
    """For file-per-chunk tiers: flip bytes in half the chunk files and truncate the rest."""
    t = h.open()
    roots = h.path_roots()
    before = _all_files(roots)
    keys = h.keys(8, b"C")
    t.store(keys)
    if not roots:
        _no_medium_or_not_certified(h, t, keys)
    t.close()
    files = _new_files(roots, before)
    if len(files) < len(keys):
        raise NotCertified(f"the tier has no conformance_corrupt and keeps no file per chunk under a "
                           f"directory its options name ({len(files)} new files for {len(keys)} chunks): {NO_HOOK}")
    for i, p in enumerate(sorted(files)):
        size = p.stat().st_size
        if size == 0:
            continue
        with open(p, "r+b") as f:
            if i % 2:
                f.truncate(size // 2)
            else:
                for off in (size // 2, size - 1, 0):
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0xFF]))
    t2 = h.open()
    t2.resolve(keys)  # any answer; a HIT must not load wrong bytes
    t2.load(keys)  # the harness fails the check if a good key holds wrong bytes
