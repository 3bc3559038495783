"""The CPU side of the DMA engine's copy plan (:mod:`.dma`): which tensors one strided view
covers, which blocks and chunks one copy covers, and copies cut into parts for several
threads. numpy only: no torch, no device."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import numpy as np


def address_segments(tensors: list[Any], np_tensors: list[np.ndarray], num_blocks: int,
                     block_bytes: int) -> list[tuple[int, int, np.ndarray, tuple[np.ndarray, int]]]:
    """The tensors (slot order) cut into maximal runs that start at one address stride, each
    as ``(first tensor, count, view [count, num_blocks, block_bytes], (buffer, offset))``: a
    pool's tensors, or separate allocations made one after another (as vLLM makes them), are
    one run or a few; a copy then costs one strided ``np.copyto`` per run, not one per tensor.
    ``buffer`` is a flat byte array over the whole run and ``offset`` the position of the
    view's first byte in it, for :func:`strided` views. Only the tensors' own bytes are ever
    indexed (the view's first two axes stay within each tensor's ``num_blocks`` rows);
    ``tensors`` keeps them alive."""
    addrs = [t.data_ptr() for t in tensors]
    size = max(t.shape[0] for t in tensors) * block_bytes
    segs: list[tuple[int, int, np.ndarray, tuple[np.ndarray, int]]] = []
    i, n = 0, len(addrs)
    while i < n:
        j = i + 1
        step = addrs[j] - addrs[i] if j < n else 0
        if abs(step) >= size:  # tensors that do not overlap (aliases of one tensor stay apart)
            while j + 1 < n and addrs[j + 1] - addrs[j] == step:
                j += 1
            j += 1
        if j - i == 1:
            own = np_tensors[i].reshape(-1)
            segs.append((i, 1, np_tensors[i][None, :num_blocks], (own, 0)))
        else:
            lo = min(addrs[i], addrs[j - 1])
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * (abs(step) * (j - i - 1) + size)).from_address(lo))
            segs.append((i, j - i, np.lib.stride_tricks.as_strided(
                raw[addrs[i] - lo :], shape=(j - i, num_blocks, block_bytes), strides=(step, block_bytes, 1),
                writeable=True), (raw, addrs[i] - lo)))
        i = j
    return segs


def strided(base: tuple[np.ndarray, int], offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A writeable byte view of ``shape`` and ``strides`` starting ``offset`` bytes after a
    segment's first byte (``base``: its buffer and position, from :func:`address_segments`).
    numpy refuses a view that would reach outside the buffer. ``as_strided`` does the same
    for any array but costs about ten times as much per call, which shows on a small transfer."""
    buf, pos = base
    return np.ndarray(shape, np.uint8, buffer=buf, offset=pos + offset, strides=strides)


def copy_all(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    """Each ``(destination, source)`` copied in turn (an iterator may be shared by threads)."""
    for dst, src in pairs:
        np.copyto(dst, src)


def split_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The copies cut along their first axis longer than 1 into pieces of about
    ``total / parts`` bytes (a copy smaller than that stays whole)."""
    target = max(1, sum(d.nbytes for d, _ in pairs) // parts)
    out = []
    for d, src in pairs:
        axes = [ax for ax, n in enumerate(d.shape) if n > 1]
        m = min(d.shape[axes[0]], -(-d.nbytes // target)) if axes else 1
        if m < 2:
            out.append((d, src))
            continue
        ax = axes[0]
        cuts = [d.shape[ax] * i // m for i in range(m + 1)]
        idx = [slice(None)] * ax
        out += [(d[(*idx, slice(a, b))], src[(*idx, slice(a, b))]) for a, b in zip(cuts, cuts[1:], strict=False)]
    return out


def repeats(ids: np.ndarray) -> bool:
    """Whether any id occurs twice (a set for a few hundred ids: fewer calls than ``np.unique``)."""
    if len(ids) < 2:
        return False
    distinct = len(set(ids.tolist())) if len(ids) <= 512 else len(np.unique(ids))
    return distinct != len(ids)


def runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in position order: ``(position, first id, count)``."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def masked_runs(arr: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of positions not skipped (``-1``) whose ids are consecutive: ``(position, first id, count)``."""
    pos = np.flatnonzero(arr >= 0)
    if not len(pos):
        return []
    ids = arr[pos]
    breaks = np.flatnonzero((np.diff(pos) != 1) | (np.diff(ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pos)]))
    return [(int(pos[a]), int(ids[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def merged_runs(full: list[bool], firsts: list[int], slots: list[int], npos: int) -> list[tuple[int, int, int, int]]:
    """Chunks ``i:j`` to copy as one, ``(i, j, block step, slot step)``: full chunks (each
    ``npos`` consecutive ids from ``firsts[c]``) whose first ids step evenly by at least
    ``npos`` (up or down) going to slots that step evenly upwards; every other chunk alone
    (``j = i + 1``)."""
    out = []
    i, n = 0, len(full)
    while i < n:
        j, db, ds = i + 1, npos, 1
        if full[i] and j < n and full[j]:
            ds, db = slots[j] - slots[i], firsts[j] - firsts[i]
            if ds >= 1 and abs(db) >= npos:
                j += 1
                while j < n and full[j] and slots[j] - slots[j - 1] == ds and firsts[j] - firsts[j - 1] == db:
                    j += 1
        out.append((i, j, db, ds))
        i = j
    return out
