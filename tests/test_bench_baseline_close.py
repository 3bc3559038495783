"""``kvtiers bench tier`` and a tier's baseline (issue 27): ``Baseline.close(keys)`` gets the
keys the baseline's own ``put`` was given (not the tier's), so a baseline that deletes what
it is given leaves nothing behind; ``close`` may be a coroutine function (run on the SDK's
I/O loop); and the command's errors follow the one convention, ``kvtiers: error: ...``, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from kvtiers import Baseline, hookimpl
from kvtiers.commands.bench.harness import run_tier_bench
from kvtiers.ioloop import is_io_thread
from kvtiers.memory import MemoryTier

KVTIERS = [sys.executable, "-c", "import sys; from kvtiers.commands.cli import main; sys.exit(main())"]
STORE: dict[bytes, bytes] = {}  # the baseline's medium
SEEN: dict[str, object] = {}


def _put(key: bytes, data: memoryview) -> None:
    STORE[key] = bytes(data)


def _get(key: bytes, out: memoryview) -> None:
    out[:] = STORE[key]


class DeletingBaselineTier(MemoryTier):
    """The memory tier with a baseline that deletes exactly the keys close is given."""

    @classmethod
    def bench_baseline(cls, tier, chunk_bytes: int) -> Baseline:
        SEEN["tier"] = tier

        def close(keys) -> None:
            SEEN["keys"] = list(keys)
            SEEN["thread"] = threading.current_thread()
            for k in keys:
                del STORE[k]  # KeyError if given a key its put never saw

        return Baseline("dict", _put, _get, concurrency=2, close=close)


class AsyncCloseBaselineTier(MemoryTier):
    @classmethod
    def bench_baseline(cls, tier, chunk_bytes: int) -> Baseline:
        async def close(keys) -> None:
            SEEN["async_io_thread"] = is_io_thread(threading.current_thread())
            for k in keys:
                del STORE[k]

        return Baseline("dict", _put, _get, concurrency=2, close=close)


def test_close_gets_the_baselines_own_keys_and_nothing_is_left() -> None:
    STORE.clear()
    run_tier_bench(DeletingBaselineTier, {}, chunk_sizes=[4096], chunks=8, rounds=2, concurrency=((2, 2),))
    keys = SEEN["keys"]
    assert keys and all(k.startswith((b"raw-", b"rawc-")) for k in keys), keys[:4]
    assert any(k.startswith(b"rawc-") for k in keys)  # the concurrency sweep's keys too
    assert len(keys) == len(set(keys)) and STORE == {}  # everything the baseline wrote, once
    assert isinstance(SEEN["tier"], MemoryTier)  # the tier object, not its handle
    assert SEEN["thread"] is threading.current_thread()  # a plain close runs on the bench's thread


def test_close_may_be_a_coroutine_function_run_on_the_io_loop() -> None:
    STORE.clear()
    run_tier_bench(AsyncCloseBaselineTier, {}, chunk_sizes=[4096], chunks=4, rounds=1, concurrency=())
    assert SEEN["async_io_thread"] is True and STORE == {}


def test_an_unreachable_backend_is_one_error_line_exit_2() -> None:
    """obj at a port nothing listens on: one `kvtiers: error:` line naming the tier, exit 2."""
    r = subprocess.run([*KVTIERS, "bench", "tier", "obj", "--config",
                        '{"bucket": "nothing", "endpoint_url": "http://127.0.0.1:9", "op_timeout": 1,'
                        ' "connect_timeout": 1, "max_attempts": 1}', "--no-concurrency", "--rounds", "1"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtiers: error: ") and "obj" in lines[0], r.stderr
    r = subprocess.run([*KVTIERS, "bench", "tier", "memory", "--config", '{"max_bytez": 1}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("kvtiers: error: ") and "max_bytez" in r.stderr, r.stderr


CALLS: list[tuple[str, bytes]] = []  # (who, first key) in call order


class RecordingTier(MemoryTier):
    """The memory tier noting each job's first key, with a baseline noting each call's."""

    @hookimpl
    def submit_store(self, job) -> None:
        CALLS.append(("tier store", job.keys[0]))
        super().submit_store(job)

    @hookimpl
    def submit_load(self, job) -> None:
        CALLS.append(("tier load", job.keys[0]))
        super().submit_load(job)

    @classmethod
    def bench_baseline(cls, tier, chunk_bytes: int) -> Baseline:
        def put(key: bytes, data: memoryview) -> None:
            CALLS.append(("base store", key))
            _put(key, data)

        def get(key: bytes, out: memoryview) -> None:
            CALLS.append(("base load", key))
            _get(key, out)

        return Baseline("dict", put, get, concurrency=1)


def test_tier_and_baseline_store_and_load_a_few_chunks_before_the_first_measured_round() -> None:
    """So a first transfer's setup (a connection, an endpoint) is charged to no round: every
    call before the first measured one is a warm-up key, WARM_CHUNKS of each op for each."""
    from kvtiers.commands.bench.harness import WARM_CHUNKS

    CALLS.clear()
    report = run_tier_bench(RecordingTier, {}, chunk_sizes=[4096], chunks=12, rounds=1, concurrency=(),
                            keys_per_job=4)
    first = next(i for i, (_, k) in enumerate(CALLS) if not k.startswith((b"warm-", b"raw-warm-")))
    warm = CALLS[:first]
    assert [w for w, _ in warm] == ["tier store"] * 2 + ["tier load"] * 2 + ["base store"] * 8 + ["base load"] * 8
    assert WARM_CHUNKS == 8 and [k for w, k in warm if w == "base load"] == [b"raw-warm-%d" % i for i in range(8)]
    assert CALLS[first][1].startswith(b"bench-")
    assert all(len(r["round_gbps"]) == 1 for r in report["results"])  # the warm-up is no round
