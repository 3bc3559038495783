"""Helpers shared by tests of any tier or manager (fs, p2p, AsyncTier, KV events, metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kvtiers_conformance import DEFAULT_LIMITS

from kvtiers import Job, JobResult, Lookup
from kvtiers.memory import MemoryTier

#: The time bounds of the conformance classes of the wrappers (sealing, compression,
#: admission) over each tier; each tier's own class keeps DESIGN.md's. Rule 5 at 5 s, not 1:
#: a wrapper's polls took 1.95 s (fs), 2.04 s (obj), 1.78 s and 3.42 s (lz4 then sealed, fs)
#: and 1.55 s (zstd over the sqlite example, 7 December) in CI runs of the whole suite (2
#: cores, the other test worker's engines running), although a hook's call does at most
#: ``POLL_BUDGET_S`` (50 ms) of each wrapper's own work; not reproduced alone (with four CPU
#: hogs beside it the sealed class's 5,985 polls took at most 0.14 s). Rules 1 and 8 at 200
#: ms, not 50: the sealed fs tier's 64-key submits took 59.9 ms (median of 5) in such a run.
#: Suspected: the wrappers' encode and seal threads, the tier's I/O threads and the caller
#: contending for the GIL on an overloaded machine. A poll that waits for a job, or a submit
#: that does a job's I/O, still fails. 30 stateful examples, not 100 (as the plain obj class):
#: each wrapper class ran 100 at 20-58 s a class in CI's runs, the eleven of them a tenth of
#: the suite's test time, while the tiers under them keep their own classes at 100 and the
#: wrappers their own unit tests (tests/test_compression.py, test_encryption.py, test_admission.py).
#: The async fault checks' op_timeout is 3 s, not 1 (as s3_limits): in a CI run the sealed SQLite
#: example's healthy key, read beside hanging ones, timed out after 1 s at the session's start (two
#: engines, the docs' servers and both workers on 2 cores).
WRAPPER_LIMITS = DEFAULT_LIMITS.replace(poll_block_s=5.0, submit_ms=200.0, lookup_ms=200.0, examples=30,
                                        async_op_timeout=3.0)


def server_stats(log: Any) -> dict:
    """The counters a ``kvtiers p2p serve`` process printed as it stopped (its last ``stats
    {...}`` line), read from its stderr: a path, or a file object it wrote to."""
    if hasattr(log, "seek"):
        log.seek(0)
        text = log.read()
    else:
        text = Path(log).read_text()
    return json.loads(text.rsplit("stats ", 1)[1].splitlines()[0])


def wait_job(tier: Any, job_id: int, timeout: float = 30.0, *, strict: bool = True) -> JobResult:
    """Poll ``get_finished_jobs`` until ``job_id`` is reported; any other result is an error,
    or, with ``strict=False`` (several jobs in flight, each waited for on its own), dropped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in tier.get_finished_jobs():
            if r.job_id == job_id:
                return r
            if strict:
                raise AssertionError(f"unexpected result {r}")
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish within {timeout} s")


def resolve_lookup(tier: Any, keys: Sequence[bytes], timeout: float = 15.0) -> list[Lookup]:
    """Ask ``lookup`` until no key answers ``RETRY`` (rule 1's bound); after ``timeout`` the
    last answers, RETRYs and all, for the caller's assert to show."""
    deadline = time.monotonic() + timeout
    while True:
        answers = tier.lookup(list(keys))
        if Lookup.RETRY not in answers or time.monotonic() > deadline:
            return answers
        time.sleep(0.002)


def key_file(directory: Path, name: str = "kvtiers.key") -> Path:
    """A fresh 32-byte key at ``directory/name``, mode 0600 (a wider one is refused)."""
    key = Path(directory) / name
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    return key


@pytest.fixture(scope="module")
def p2p_server() -> Iterator[Any]:
    """One ``kvtiers p2p serve`` child for a module's checks, with ``--test-faults`` (rule 4's
    conformance_corrupt); skipped without pyzmq. Take it into a module as ``p2p_server =
    tier_helpers.p2p_server``."""
    pytest.importorskip("zmq")
    from kvtiers_p2p.spawn import start_server

    srv = start_server(capacity=256 << 20, extra=["--test-faults"])
    yield srv
    srv.stop()  # by its own PID


def p2p_entry(server: Any, **options: Any) -> tuple[str, dict]:
    """The tier entry of a p2p tier on ``server`` (``p2p_server``), ``options`` beside it."""
    assert server.proc.poll() is None, "the peer server died during an earlier check"
    return "p2p", {"host": "127.0.0.1", "port": server.port, **options}


@contextmanager
def mounted_tmpfs(path: Any, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (e.g. ``"4m"``) mounted at the new directory ``path``, unmounted
    after; skips the test when not root or when the mount fails."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.mkdir(path)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class CopyDma:
    """A DMA engine for a manager without devices: copies complete at once."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def submit_store(self, tid: int, chunks: Any) -> None:
        self.done.append(tid)

    def submit_load(self, tid: int, chunks: Any) -> None:
        self.done.append(tid)

    def poll(self) -> list[int]:
        out, self.done = self.done, []
        return out


class InlineMemoryTier(MemoryTier):
    """The memory tier copying in the submitting call, as it did before its copies moved to a
    worker thread: for fault-injecting subclasses that change what ``super().submit_*`` has
    just done (drop a key, flip a byte, pop the result)."""

    def _dispatch(self, job: Job, work) -> None:
        work(job, time.perf_counter())
