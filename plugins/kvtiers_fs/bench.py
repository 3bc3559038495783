"""The fs tier's raw baseline for ``kvtiers bench tier fs`` (alias ``kvtiers bench fs``).

The baseline does what any chunk store must at least do, with the same syscalls in the same
mode, on the same file system: per chunk ``open(O_CREAT|O_EXCL[|O_DIRECT])`` + one
``pwritev([chunk, page])`` + ``close`` + ``rename`` into the same two-level directories for
stores, and ``open`` + one ``preadv([chunk, page])`` + ``close`` for loads, with the tier's
thread counts. The tier adds checksums, the existence check, the index, job tracking and its
queues. The harness (:mod:`kvtiers.commands.bench.harness`) runs both interleaved and compares medians.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from collections.abc import Sequence
from typing import Any

from kvtiers import Baseline
from kvtiers.commands.bench.tier import bench_command

from . import direct as _direct
from . import layout


def baseline(tier: Any, chunk_bytes: int) -> Baseline:
    """Raw ``pwritev``/``preadv`` in a sibling directory of ``tier``'s namespace directory,
    in the tier's I/O mode (O_DIRECT or buffered) and with its thread counts."""
    root = os.path.join(os.path.dirname(tier.nsdir), f"bench-raw-{os.getpid()}-{secrets.token_hex(3)}")
    flag = _direct.O_DIRECT if tier.direct else 0
    wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag
    rflags = os.O_RDONLY | os.O_CLOEXEC | flag
    local = threading.local()  # one aligned trailing page per thread (O_DIRECT needs aligned buffers)
    pages: list[Any] = []

    def page() -> memoryview:
        v = getattr(local, "page", None)
        if v is None:
            buf = _direct.aligned_buffer()
            pages.append(buf)
            v = local.page = memoryview(buf)
        return v

    def put(key: bytes, data: memoryview) -> None:
        final = layout.chunk_path(root, key)
        tmp = layout.temp_path(final)
        try:
            fd = os.open(tmp, wflags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, wflags, 0o644)
        try:
            os.pwritev(fd, [data, page()], 0)
        finally:
            os.close(fd)
        os.rename(tmp, final)

    def get(key: bytes, out: memoryview) -> None:
        fd = os.open(layout.chunk_path(root, key), rflags)
        try:
            os.preadv(fd, [out, page()], 0)
        finally:
            os.close(fd)

    def close(_tier_keys: Sequence[bytes]) -> None:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tier.nsdir, ignore_errors=True)  # the bench's own namespace: everything it stored

    mode = "O_DIRECT" if tier.direct else "buffered"
    return Baseline(name=f"raw pwritev/preadv ({mode}), same directory tree and threads", put=put, get=get,
                    concurrency=tier._writes.n, load_concurrency=tier._reads.n, close=close)


bench_fs = bench_command(
    "fs", "fs",
    "Store and load GB/s, lookups per second and submit latency of the fs tier, against raw "
    "preadv/pwritev on the same directory (same mode, chunk size, threads) in the same run. "
    "The same harness as 'kvtiers bench tier fs'.",
)
