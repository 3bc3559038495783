"""Rule 12: any byte values are keys; no traversal, no injection, no aliasing."""

from __future__ import annotations

import os
import pathlib

from kvtiers import Lookup

from ..harness import CheckSkipped, ConformanceFailure, Harness, fail
from ..rules import check

#: keys that look like paths, separators, escapes and format strings
NASTY = [
    b"/", b"//", b".", b"..", b"../", b"../../../../etc/passwd", b"/etc/passwd", b"a/../b",
    b"\x00", b"a\x00b", b"\\", b"..\\..\\x", b"C:\\x", b"~", b"$HOME", b"%s%n", b"{0}",
    b"a b", b"\n", b"\r\n", b"\t", b"*", b"?", b"'", b'"', b";", b"|", b"&", b"<x>",
    b"\xff\xfe", b"\xc0\xaf", b"\xe2\x80\xae", b" ", b"#", b"%2e%2e%2f", b"A" * 64, b"\x00" * 64,
    b"/" * 64, b"." * 64, b"\xff" * 64,
]
#: groups of keys that differ only in bytes a careless encoding drops or folds
CONFUSABLE = [
    [b"ab", b"a/b", b"a//b", b"a\\b", b"a\x00b", b"a.b", b"a b", b"a%2fb", b"A/B", b"AB", b"a/b/"],
    [b"x", b"x\x00", b"\x00x", b"x/", b"/x", b"./x", b"x.", b"X", b"x ", b" x"],
    [b"..", b"...", b"./.", b"%2e%2e", b"."],
    [b"k" * 59, b"k" * 60, b"k" * 59 + b"\x00", b"k" * 58 + b"/k"],  # 63/64 bytes once salted
]


def _store_load(h: Harness, keys: list[bytes]) -> None:
    t = h.open(num_slots=max(h.limits.num_slots, 8))
    t.store_many(keys)
    answers = t.resolve(keys)
    bad = [(k, a) for k, a in zip(keys, answers, strict=True) if a is not Lookup.HIT]
    if bad:
        fail(f"rule 12: stored key {bad[0][0]!r} answers {bad[0][1].name}")
    try:
        t.load_all(keys, why="rule 12")  # each key gets its own bytes back: no two keys alias
    except ConformanceFailure as e:
        fail(f"rule 12: keys alias or are mangled: {e}")


@check(12, "all_byte_values")
def all_byte_values(h: Harness) -> None:
    """All 256 one-byte keys and 64-byte keys of each byte value store and load their own bytes."""
    one = [bytes([b]) for b in range(256)]
    sixty_four = [bytes([b]) * 64 for b in range(0, 256, 5)] + [bytes(range(i, i + 64)) for i in (0, 64, 128, 192)]
    _store_load(h, one + sixty_four)


@check(12, "path_like_keys")
def path_like_keys(h: Harness) -> None:
    """Keys of '/', '..', NUL, escapes and format strings (salted and bare) store and load exactly."""
    salted = [(h.salt + k)[:64] for k in NASTY] + [(k + h.salt)[:64] for k in NASTY]
    _store_load(h, list(dict.fromkeys(NASTY + salted)))


@check(12, "no_aliasing")
def no_aliasing(h: Harness) -> None:
    """Keys differing only in '/', NUL, '.', case or length never alias: storing one leaves
    the others MISS, and each loads its own bytes."""
    t = h.open()
    for group in CONFUSABLE:
        group = [(h.salt + k)[:64] for k in group]
        first, others = group[0], group[1:]
        t.store([first])
        answers = t.resolve(others)
        hit = [k for k, a in zip(others, answers, strict=True) if a is Lookup.HIT]
        if hit:
            fail(f"rule 12: after storing only {first!r}, the distinct key {hit[0]!r} answers HIT (aliasing)")
        t.expect_missing(others, "rule 12 (aliasing)")
        t.store_many(others)
        try:
            t.load_all(group, why="rule 12")
        except ConformanceFailure as e:
            fail(f"rule 12: keys alias: {e}")


@check(12, "no_path_traversal")
def no_path_traversal(h: Harness) -> None:
    """For tiers whose options name directories: traversal keys create nothing outside them."""
    t = h.open()
    roots = h.path_roots()
    if not roots:
        raise CheckSkipped("the tier's options name no directory")
    watch = {r.parent for r in roots} | {r.parent.parent for r in roots} | {pathlib.Path("/tmp"), pathlib.Path("/etc")}
    before = {d: set(os.listdir(d)) for d in watch if d.is_dir()}
    keys = [k for k in NASTY if b"/" in k or b".." in k or b"\\" in k]
    leaves = {part.decode("latin-1") for k in keys for part in k.replace(b"\\", b"/").split(b"/")} - {"", ".", ".."}
    t.store_many(keys)
    t.close()
    for d, names in before.items():
        escaped = sorted((set(os.listdir(d)) - names) & leaves)
        if escaped:
            fail(f"rule 12: storing path-like keys created {os.path.join(d, escaped[0])!r} outside {roots[0]}")
